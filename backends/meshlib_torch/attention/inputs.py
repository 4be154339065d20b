"""The arguments the context-parallel attention functions take per shard, checked before any collective,
and `Problem`, the per-call state their block loops read.

Per shard, inside `shard_map` over a mesh whose axis `axis` splits the sequence (L = S/cp tokens per rank,
in the order of `layout`, `zigzag.Shards`):

- `q` (B, Hq, L, D); `k`, `v` (B, Hkv, L, D), Hq a multiple of Hkv (GQA: query head h reads key/value head
  h // (Hq/Hkv), as `scaled_dot_product_attention(..., enable_gqa=True)` does); one floating dtype.
- `mask`: this rank's query rows and every key's column, both in the layout's order: (L, S), or
  (1 or B, 1 or Hq, L, S). Boolean: True where a query may attend (as SDPA); floating: added to the scores.
  A whole (S, S) mask is passed with in spec `P("cp", None)`, a (B, H, S, S) one with `P(data, None, "cp",
  None)`; under the zigzag layout reorder both of its sequence dims first (`to_zigzag` on -2 and -1).
- `doc_ids` (B, L) integers, split like `q`: a query attends only keys of its own document (packed
  sequences); with `causal`, only earlier keys of it.

Scores are computed in float32 (float64 when the inputs are float64) and the result has the inputs' dtype.
A query that may attend no key at all gets zeros (the flash-attention convention; SDPA's math gives NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import lax
from ..spmd.region import current
from .zigzag import Shards

__all__ = ["Problem", "check", "compute_dtype", "default_scale", "host_index", "mask5", "rank_of", "split_heads"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One call's state: this rank (`rank` along the axis, its `shards`), its queries `q` (B, Hkv, G, rows, D)
    in the compute dtype, `heads` = Hkv*G, and the masks: `mask` (Bm, Hkv or 1, G or 1, rows, cols) bool or
    in the compute dtype, `doc_q` (B, rows) and `doc_k` (B, cols), the documents of the queries and of every
    key column (the layout's order)."""

    shards: Shards
    rank: int
    q: torch.Tensor
    heads: int
    scale: float
    causal: bool
    mask: torch.Tensor | None
    doc_q: torch.Tensor | None
    doc_k: torch.Tensor | None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, L, D) -> (B, Hkv, G, L, D), a view: query head h = j*G + g reads key/value head j."""
    b, hq, length, d = q.shape
    return q.view(b, kv_heads, hq // kv_heads, length, d)


def mask5(mask: torch.Tensor | None, heads: int, kv_heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A checked mask as the blocks index it: (Bm, Hkv or 1, G or 1, rows, cols), bool or in `dtype`."""
    if mask is None:
        return None
    m = mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape)
    m = m if m.dtype == torch.bool else m.to(dtype)
    if m.shape[1] == 1:
        return m.unsqueeze(2)
    return m.reshape(m.shape[0], kv_heads, heads // kv_heads, *m.shape[2:])


def host_index(axis: str, op: str) -> int:
    """This rank's index along `axis` as a Python int: the ring's schedule (which blocks a causal mask skips)
    is decided on the host. The eager backend knows it without reading a device value; a backend that does
    not gets one read of `lax.axis_index`. A dry run (meta tensors) has no rank: the last index, whose
    collectives are every rank's and whose causal blocks are the widest (contiguous: it sees every shard;
    head-tail: its first chunk is the latest), so the dry run's memory is the largest rank's."""
    region = current(op)
    if region.abstract:
        return lax.axis_size(axis) - 1
    index = getattr(region.backend, "index", None)
    return index(region.axes(axis, op)) if index is not None else int(lax.axis_index(axis))


def check(op: str, q, k, v, *, axis, causal, mask, doc_ids, scale, layout, seq_len=None) -> Shards:
    """The layout of this call's sequence, once every argument is known to fit (else a ValueError or
    TypeError naming the argument, what it is, what was needed and the fix), before any collective.
    `seq_len`: the whole sequence's tokens when cp does not divide it (torch.chunk's pieces, contiguous)."""
    if not isinstance(axis, str):
        raise TypeError(f"{op}: axis={axis!r} must be one mesh axis name, the one the sequence is split over")
    cp = lax.axis_size(axis)
    _check_qkv(op, q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal={causal!r} must be a bool")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"{op}: scale={scale!r} must be a positive number (None: 1/sqrt(head_dim))")
    shards = _shards(op, layout, cp, q.shape[2], seq_len)
    _check_mask(op, mask, q, shards.seq)
    _check_docs(op, doc_ids, q)
    return shards


def _shards(op: str, layout: str, cp: int, length: int, seq_len) -> Shards:
    if seq_len is None or seq_len == cp * length:
        return Shards(layout, cp, length)
    step = -(-seq_len // cp) if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0 else 0
    last = seq_len - (cp - 1) * step
    if not step or last <= 0 or layout != "contiguous" or length not in (step, last):
        raise ValueError(
            f"{op}: seq_len={seq_len!r} with {length} tokens on this rank over cp={cp} in the {layout!r} layout: a "
            "sequence cp does not divide is taken in torch.chunk's pieces (each rank non-empty), in the contiguous "
            "layout only. Fix: pass the whole sequence's length, layout='contiguous', or a multiple of cp"
        )
    return Shards(layout, cp, step, seq_len)


def rank_of(shards: Shards, axis: str, op: str, length: int) -> int:
    """This rank's index along `axis` (`host_index`), checked against the tokens it holds; a dry run of
    torch.chunk's pieces takes the last rank whose piece is the largest (the shape it runs with)."""
    rank = host_index(axis, op)
    if shards.length(rank) == length:
        return rank
    if current(op).abstract:
        return max(r for r in range(shards.cp) if shards.length(r) == length)
    raise ValueError(
        f"{op}: rank {rank} along {axis!r} holds {length} tokens, but torch.chunk's pieces of {shards.seq} over "
        f"{shards.cp} give it {shards.length(rank)}. Fix: split q, k and v with torch.chunk along the sequence"
    )


def default_scale(scale, q: torch.Tensor) -> float:
    return 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _check_qkv(op: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            what = f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{op}: {name} must be a 4-D floating tensor (B, heads, S/cp, D); got {what}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"{op}: shapes {shapes} per shard do not fit q (B, Hq, S/cp, D) and k, v (B, Hkv, S/cp, D): one batch, "
            "one sequence shard (self-attention), one head dim. Fix: split q, k and v alike along the sequence"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{op}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads ({shapes}). Fix: "
            "give a number of key/value heads that divides the query heads (GQA groups of equal size)"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{op}: q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_mask(op: str, mask, q: torch.Tensor, seq: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{op}: mask must be a bool tensor (True: attend) or a floating one (added); got {what}")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{op}: mask requires grad (a learned bias?), but the attention does not differentiate its mask. Fix: "
            "pass mask.detach() if it is a constant, or add a learned bias to the scores outside context parallelism"
        )
    b, hq, length, _ = q.shape
    rows_cols = (length, seq)
    ok = mask.dim() == 2 and tuple(mask.shape) == rows_cols
    fits4 = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] in (1, hq) and mask.shape[2:] == rows_cols
    ok = ok or fits4
    if not ok:
        raise ValueError(
            f"{op}: mask has shape {tuple(mask.shape)} per shard; it needs this rank's {length} query rows and all "
            f"{seq} key columns: {rows_cols}, or (1 or {b}, 1 or {hq}, {length}, {seq}). Fix: split "
            "only its query dim over the axis (in spec P('cp', None) for an (S, S) mask, P(batch, None, 'cp', None) "
            "for a 4-D one)"
        )


def _check_docs(op: str, doc_ids, q: torch.Tensor) -> None:
    if doc_ids is None:
        return
    integer = isinstance(doc_ids, torch.Tensor) and not (doc_ids.is_floating_point() or doc_ids.is_complex())
    if not integer or doc_ids.dtype == torch.bool:
        what = doc_ids.dtype if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise TypeError(f"{op}: doc_ids must be an integer tensor (B, S/cp), each token's document; got {what}")
    if tuple(doc_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"{op}: doc_ids has shape {tuple(doc_ids.shape)} per shard; it needs (B, S/cp) = {(q.shape[0], q.shape[2])}"
            ". Fix: split it like q, batch and sequence (in spec P(batch, 'cp'))"
        )
