"""Context parallelism: attention over a sequence split along `cp` becomes one `shard_map` region of
`ring_attention`.

With a `cp` axis (size > 1) in the mesh the inputs' sequence dim is split over it
(`program.default_in_spec`). While the model is traced (`attention_as_regions`), every call of
`torch.nn.functional.scaled_dot_product_attention` (q, k, v laid out (B, H, S, D)) is a call of
`attention.ring_attention` mapped over the mesh: q, k and v split on their sequence dim (2) over `cp`,
their batch over the other data axes and their heads over `tp` when the mesh has it, so no rank
gathers the whole sequence; keys and values travel around the ring of cp ranks (`lax.ppermute`,
their bytes in the plan). Every other op works on sequence shards with the collectives propagation
inserts. The layout is contiguous: rank i holds tokens [i*S/cp, (i+1)*S/cp), so causal attention is
not balanced across ranks yet (the zigzag layout is not wired into compiled models).

What the ring does not run is refused while tracing, before any collective, naming the call and the
fix: an `attn_mask`, `dropout_p` > 0.
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn.functional as F

from meshlib import Mesh, P

from .source import TORCH_DIR

CP_AXIS = "cp"


def cp_size(mesh: Mesh) -> int:
    """The size of the mesh's `cp` axis (1 without one)."""
    return mesh.axis_size(CP_AXIS) if CP_AXIS in mesh.axis_names else 1


def attention_spec(mesh: Mesh, data: tuple[str, ...]) -> P:
    """How q, k, v (B, H, S, D) and the result are split in the region: batch over the data axes besides
    `cp`, heads over `tp` (when the mesh has it), sequence over `cp`."""
    batch = tuple(a for a in data if a != CP_AXIS) or None
    heads = "tp" if "tp" in mesh.axis_names and mesh.axis_size("tp") > 1 else None
    return P(batch, heads, CP_AXIS)


def _variant(method: str):
    """The per-shard attention `cp_method` names (`meshlib.options.CP_METHODS`)."""
    from ...attention import allgather_attention, ring_attention, ulysses_attention

    return {"ring": ring_attention, "all-gather": allgather_attention, "all-to-all": ulysses_attention}[method]


@functools.cache
def _mapped(mesh: Mesh, spec: P, causal: bool, scale, method: str = "ring"):
    from ...spmd.shard_map import shard_map

    fn = _variant(method)

    def attention(q, k, v):
        return fn(q, k, v, axis=CP_AXIS, causal=causal, scale=scale, layout="contiguous")

    attention.__name__ = attention.__qualname__ = fn.__name__
    return shard_map(attention, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


class _Refusal:
    """The first call the ring cannot run, noted while tracing (a tracer would wrap the error)."""

    def __init__(self):
        self.error: ValueError | None = None


def _where() -> str:
    import sys

    frame = sys._getframe(2)
    while frame is not None and (TORCH_DIR.search(frame.f_code.co_filename) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "an unknown line"


def _check(attn_mask, dropout_p, where: str, n: int) -> None:
    if attn_mask is not None:
        raise ValueError(
            f"scaled_dot_product_attention at {where} passes attn_mask: context parallelism over cp={n} runs "
            "causal or full attention without a mask in compiled models so far. Fix: use is_causal=True instead "
            "of a causal mask, or compile without a cp axis"
        )
    if isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise ValueError(
            f"scaled_dot_product_attention at {where} has dropout_p={dropout_p}: the ring over cp={n} runs no "
            "attention dropout (no parallel run would draw the single process's random mask). Fix: set the "
            "attention dropout to 0 (e.g. dropout_p=0.0, or the model config's attention dropout)"
        )


@contextlib.contextmanager
def attention_as_regions(mesh: Mesh, data: tuple[str, ...], method: str = "ring"):
    """While the block runs (tracing), `F.scaled_dot_product_attention` is the per-shard attention `method`
    names (`ring_attention` by default, see `_variant`) mapped over `mesh` (see the module docstring), when
    `cp` (of size > 1) splits the inputs' sequence (`data`, the data axes, holds it); else it does nothing.
    Yields a list that holds where each call made into a region was."""
    calls: list[str] = []
    n = cp_size(mesh)
    if n <= 1 or CP_AXIS not in data:
        yield calls
        return
    spec, refusal = attention_spec(mesh, data), _Refusal()
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        where = _where()
        try:
            _check(attn_mask, dropout_p, where, n)
        except ValueError as err:
            refusal.error = refusal.error or err
            raise
        calls.append(where)
        return _mapped(mesh, spec, bool(is_causal), scale, method)(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield calls
    except Exception:
        if refusal.error is not None:
            raise refusal.error from None
        raise
    finally:
        F.scaled_dot_product_attention = original
    if refusal.error is not None:
        raise refusal.error


__all__ = ["CP_AXIS", "attention_as_regions", "attention_spec", "cp_size"]
