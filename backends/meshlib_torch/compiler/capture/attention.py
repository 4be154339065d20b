"""Context parallelism: attention over a sequence split along `cp` becomes one `shard_map` region of
`ring_attention`.

With a `cp` axis (size > 1) in the mesh the inputs' sequence dim is split over it
(`program.default_in_spec`). While the model is traced (`attention_as_regions`), every call of
`torch.nn.functional.scaled_dot_product_attention` (q, k, v laid out (B, H, S, D)) is a call of
`attention.ring_attention` mapped over the mesh: q, k and v split on their sequence dim (2) over `cp`,
their batch over the other data axes and their heads over `tp` when the mesh has it, so no rank
gathers the whole sequence; keys and values travel around the ring of cp ranks (`lax.ppermute`,
their bytes in the plan). Every other op works on sequence shards with the collectives propagation
inserts.

The layout (`cp_layout`) is head-tail by default: the sequence is cut in 2*cp chunks and cp rank i holds
chunks i and 2*cp-1-i (`zigzag`, the placement `Shard(dim, 2, mirror=True)`), so causal attention costs
every rank the same. It is a placement like any other: the value is the whole sequence's, in token order,
and only which rank holds which rows changes. So a whole value meeting the sequence (learned positions,
rotary tables sliced to the length, targets) is sliced to each rank's chunks, a gather puts the chunks back
in order, and nothing in the model changes. The region takes its q, k, v in that layout
(`ShardMapped.zigzag`, read by `placement.ops.region_layouts`) and its per-shard attention knows it.
"contiguous": rank i holds tokens [i*S/cp, (i+1)*S/cp), as `P("cp")` cuts them (the last rank's causal
work is cp times the first's).

Grouped-query attention: keys and values move at their own number of heads. A model that repeats them to
the query heads before the call (the bundled Llama's `repeat_interleave`, transformers' `repeat_kv`) would
send every repeat around the ring (torchtitan#1283: 4x the bytes on Llama-3-8B). The region takes the
keys and values as they were before the repeat (`kv.repeated`; `enable_gqa` semantics: query head h reads
key/value head h // (Hq/Hkv), which is what both repeats build), where the key/value heads divide over `tp`.

Masks: an `attn_mask` goes into the region split like the queries' rows, every key's column on each rank
(put in the layout's order there), so padding, packed documents (transformers builds their block-diagonal
mask from reset `position_ids`) and sliding windows (Mistral, Gemma-2) are exact. A mask that is the causal
one (transformers builds it from the positions even where `is_causal` would do, since it cannot skip it
while traced) is recognised by its value (`masks.constant_mask`) and becomes `causal=True`: no mask moves
or is stored, and fully masked blocks are skipped.

Tracing records each call as one `cp_sdpa` node (the call with its arguments, run on meta values as SDPA);
`attention_regions` then makes each a region, knowing every value's shape: the GQA heads before their
repeat, the mask's spec, the causal mask recognised. Under torch.export (a model fx cannot trace) the call
becomes its region at once from the fake tensors' shapes, its mask kept as given.

`dropout_p` > 0 is refused while tracing, before any collective, naming the call and the fix.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch.fx as fx
import torch.nn.functional as F

from meshlib import Mesh, P

from ..placement.placements import CP_AXIS, Layout, Shard, zigzag
from ..placement.shapes import chunk_fits
from .source import TORCH_DIR


def zigzag_input(
    layout: Layout, mesh: Mesh, shape: tuple[int, ...], name: str, layout_name: str = "zigzag", uneven: str = "error"
) -> Layout:
    """An input's layout with its sequence dim (1), where `cp` splits it, in the `layout_name` layout ("zigzag":
    head-tail chunks); refused, naming the fix, where the sequence does not cut into equal shards (2*cp chunks
    for the head-tail layout, cp pieces for the contiguous one), unless `uneven="chunk"` and the contiguous
    layout take torch.chunk's pieces (every rank non-empty)."""
    if CP_AXIS not in mesh.axis_names:
        return layout
    i = mesh.axis_names.index(CP_AXIS)
    if layout[i] != Shard(1) or len(shape) < 2:
        return layout
    n, zig = mesh.axis_size(CP_AXIS), layout_name == "zigzag"
    parts = 2 * n if zig else n
    chunked = uneven == "chunk" and not zig and chunk_fits(shape[1], n)
    if shape[1] % parts and not chunked:
        if uneven == "chunk" and zig and chunk_fits(shape[1], n):
            raise ValueError(
                f"input {name!r} {list(shape)}: its sequence of {shape[1]} tokens does not cut into 2*cp = {parts} "
                f"equal chunks, which the head-tail layout of cp={n} needs; uneven='chunk' takes torch.chunk's pieces "
                f"in the contiguous layout only. Fix: pass cp_layout='contiguous' (--cp-layout contiguous; causal work "
                f"then unbalanced), or pad the sequence to {-(-shape[1] // parts) * parts} tokens (the padding's "
                "labels ignored)"
            )
        other = (
            f"pass cp_layout='contiguous' (--cp-layout contiguous; a multiple of {n}, with causal work unbalanced)"
            if zig and shape[1] % n == 0 else "use fewer cp ranks"
        )  # fmt: skip
        raise ValueError(
            f"input {name!r} {list(shape)}: its sequence of {shape[1]} tokens does not cut into "
            f"{'2*cp = ' if zig else 'cp = '}{parts} equal {'chunks' if zig else 'pieces'}, which the "
            f"{layout_name} layout of cp={n} needs"
            + (" (each rank holds a chunk from the head and one from the tail, so causal attention costs every rank"
               " the same)" if zig else "")
            + f"; context parallelism takes equal shards (uneven='chunk' takes torch.chunk's pieces in the contiguous "
            f"layout, each rank non-empty). Fix: make the sequence a multiple of {parts} (pad it to "
            f"{-(-shape[1] // parts) * parts}, the padding's labels ignored), or {other}"
        )
    return (*layout[:i], zigzag(1), *layout[i + 1 :]) if zig else layout


def cp_size(mesh: Mesh) -> int:
    """The size of the mesh's `cp` axis (1 without one)."""
    return mesh.axis_size(CP_AXIS) if CP_AXIS in mesh.axis_names else 1


def attention_spec(mesh: Mesh, data: tuple[str, ...]) -> P:
    """How q, k, v (B, H, S, D) and the result are split in the region: batch over the data axes besides
    `cp`, heads over `tp` (when the mesh has it), sequence over `cp`."""
    batch = tuple(a for a in data if a != CP_AXIS) or None
    return P(batch, _heads_axis(mesh), CP_AXIS)


def _heads_axis(mesh: Mesh) -> str | None:
    return "tp" if "tp" in mesh.axis_names and mesh.axis_size("tp") > 1 else None


def mask_spec(mesh: Mesh, data: tuple[str, ...], mask: tuple[int, ...], batch: int, heads: int) -> P:
    """How a mask of shape `mask` (S, S) or (1 or B, 1 or H, S, S) is split in the region: its query rows over
    `cp` (every key column whole), its batch and heads as q's where it has them; anything else is refused."""
    if len(mask) == 2:
        return P(CP_AXIS, None)
    spec = attention_spec(mesh, data)
    if len(mask) != 4 or mask[0] not in (1, batch) or mask[1] not in (1, heads) or mask[2] != mask[3]:
        raise ValueError(
            f"an attention mask of shape {list(mask)}: context parallelism takes (S, S) or (1 or B, 1 or H, S, S) "
            f"(B = {batch}, H = {heads}). Fix: give the mask one of those shapes"
        )
    b = spec[0] if mask[0] == batch and batch > 1 else None
    return P(b, spec[1] if mask[1] == heads and heads > 1 else None, CP_AXIS, None)


def _variant(method: str):
    """The per-shard attention `cp_method` names (`meshlib.options.CP_METHODS`)."""
    from ...attention import allgather_attention, ring_attention, ulysses_attention

    return {"ring": ring_attention, "all-gather": allgather_attention, "all-to-all": ulysses_attention}[method]


@functools.cache
def _mapped(mesh: Mesh, spec: P, causal: bool, scale, method: str, layout: str, mask: P | None = None, seq=None):
    """The region of one attention call. `seq`: the sequence's length where cp does not divide it (uneven='chunk':
    each rank holds torch.chunk's piece)."""
    from ...attention.zigzag import Shards
    from ...lax import axis_size
    from ...spmd.shard_map import shard_map

    fn = _variant(method)

    def attention(q, k, v, mask=None):
        if mask is not None and layout == "zigzag":  # every key's column, in the order the ranks hold the keys
            mask = mask.index_select(-1, Shards(layout, axis_size(CP_AXIS), q.shape[2]).everyone(mask.device))
        extra = {} if seq is None else {"seq_len": seq}
        return fn(q, k, v, axis=CP_AXIS, causal=causal, scale=scale, layout=layout, mask=mask, **extra)

    attention.__name__ = attention.__qualname__ = fn.__name__
    attention.cp_call = (causal, scale)  # `attention_regions` finds torch.export's regions by it
    specs = (spec, spec, spec) if mask is None else (spec, spec, spec, mask)
    mapped = shard_map(attention, mesh=mesh, in_specs=specs, out_specs=spec)
    mapped.zigzag = CP_AXIS if layout == "zigzag" else None
    mapped.chunked = {} if seq is None else {CP_AXIS: seq}
    return mapped


_SDPA = F.scaled_dot_product_attention  # torch's own, while the tracing hook stands in for it


def cp_sdpa(q, k, v, mask=None, *, causal: bool, scale, where: str):
    """One attention call of a traced model, before `attention_regions` makes it a region: on meta values,
    SDPA itself (key/value heads fewer than the queries' read as `enable_gqa`)."""
    gqa = k.shape[1] != q.shape[1]
    return _SDPA(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


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


def _check(dropout_p, where: str, n: int) -> None:
    if isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise ValueError(
            f"scaled_dot_product_attention at {where} has dropout_p={dropout_p}: the ring over cp={n} runs no "
            "attention dropout (no parallel run would draw the single process's random mask). Fix: set the "
            "attention dropout to 0 (e.g. dropout_p=0.0, or the model config's attention dropout)"
        )


@dataclass(frozen=True)
class Setting:
    """What every attention region of one compiled model shares."""

    mesh: Mesh
    data: tuple[str, ...]
    method: str
    layout: str


@contextlib.contextmanager
def attention_as_regions(mesh: Mesh, data: tuple[str, ...], method: str = "ring", layout: str = "zigzag"):
    """While the block runs (tracing), `F.scaled_dot_product_attention` is recorded as `cp_sdpa` calls (fx), or
    made a region at once (torch.export), when `cp` (of size > 1) splits the inputs' sequence (`data`, the
    data axes, holds it); else it does nothing. Yields the `Setting` to give `attention_regions` after
    tracing."""
    setting = Setting(mesh, data, method, layout)
    n = cp_size(mesh)
    if n <= 1 or CP_AXIS not in data:
        yield setting
        return
    refusal = _Refusal()

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        where = _where()
        try:
            _check(dropout_p, where, n)
        except ValueError as err:
            refusal.error = refusal.error or err
            raise
        kwargs = {"causal": bool(is_causal), "scale": scale, "where": where}
        if isinstance(q, fx.Proxy):
            return q.tracer.create_proxy("call_function", cp_sdpa, (q, k, v, attn_mask), kwargs)
        return region_call(setting, q, k, v, attn_mask, kwargs)  # torch.export: shapes known now

    F.scaled_dot_product_attention = sdpa
    try:
        yield setting
    except Exception:
        if refusal.error is not None:
            raise refusal.error from None
        raise
    finally:
        F.scaled_dot_product_attention = _SDPA
    if refusal.error is not None:
        raise refusal.error


def region_call(setting: Setting, q, k, v, mask, kwargs):
    """The region of one call on tensors (torch.export's fake ones): its mask kept as it is."""
    spec = attention_spec(setting.mesh, setting.data)
    m = None if mask is None else mask_spec(setting.mesh, setting.data, tuple(mask.shape), q.shape[0], q.shape[1])
    mapped = _mapped(setting.mesh, spec, kwargs["causal"], kwargs["scale"], setting.method, setting.layout, m,
                     _ragged(setting, q.shape[2], kwargs["where"]))  # fmt: skip
    return mapped(q, k, v) if mask is None else mapped(q, k, v, mask)


def attention_regions(gm: fx.GraphModule, s: Setting) -> dict[str, int]:
    """Each `cp_sdpa` node of `gm` becomes its region (see the module docstring), with every value's shape
    known (`meta["val"]`): keys and values taken before a repeat to the query heads where their heads divide
    over `tp` (`kv.repeated`), a causal mask recognised by its value (`masks.constant_mask`) and dropped, any
    other mask split by its query rows; attention written out as softmax(Q Kᵀ · scale + mask) V is found first
    (`eager_attention`). Returns what it did: {"calls", "unrepeated", "causal masks", "masks", "written out"}."""
    from .kv import repeated
    from .masks import constant_mask

    tp = s.mesh.axis_size("tp") if _heads_axis(s.mesh) else 1
    spec = attention_spec(s.mesh, s.data)
    done = {"calls": 0, "unrepeated": 0, "causal masks": 0, "masks": 0, "written out": 0}
    if cp_size(s.mesh) > 1 and CP_AXIS in s.data:
        from .eager_attention import eager_calls
        from .source import source_line

        done["written out"] = eager_calls(gm, cp_sdpa, source_line)
    found = [(n, c) for n in gm.graph.nodes if (c := _call_of(n)) is not None]
    if not found:
        return done
    for node, (q, k, v, mask, causal, scale, where) in found:
        src = [repeated(x) for x in (k, v)]
        if None not in src and src[0][1] == src[1][1] and src[0][0].meta["val"].shape[1] % tp == 0:
            k, v = src[0][0], src[1][0]
            done["unrepeated"] += 1
        if mask is not None:
            kind = constant_mask(gm, mask)
            if kind in ("causal", "none"):
                causal, mask = kind == "causal", None
                done["causal masks"] += kind == "causal"
        m = None
        if mask is not None:
            shape, qs = tuple(mask.meta["val"].shape), q.meta["val"].shape
            try:
                m = mask_spec(s.mesh, s.data, shape, qs[0], qs[1])
            except ValueError as err:
                raise ValueError(f"scaled_dot_product_attention at {where}: {err}") from None
            done["masks"] += 1
        seq = _ragged(s, q.meta["val"].shape[2], where)
        node.target = _mapped(s.mesh, spec, causal, scale, s.method, s.layout, m, seq)
        node.args, node.kwargs = ((q, k, v) if mask is None else (q, k, v, mask)), {}
        done["calls"] += 1
    from .effects import eliminate_dead_code

    eliminate_dead_code(gm.graph)
    gm.recompile()
    return done


def _ragged(s: Setting, seq: int, where: str) -> int | None:
    """The sequence's length where cp does not divide it (its ranks hold torch.chunk's pieces), else None;
    refused for the all-to-all, whose exchange of sequence shards for head shards needs equal ones."""
    if seq % cp_size(s.mesh) == 0:
        return None
    if s.method == "all-to-all":
        raise ValueError(
            f"scaled_dot_product_attention at {where}: a sequence of {seq} tokens over cp={cp_size(s.mesh)} comes in "
            "torch.chunk's pieces (uneven='chunk'), and the all-to-all swaps equal sequence shards for head shards. "
            f"Fix: cp_method='ring' or 'all-gather' (which take unequal pieces), or a sequence that cp divides"
        )
    return seq


def _call_of(node: fx.Node):
    """`(q, k, v, mask, causal, scale, where)` of an attention call: a `cp_sdpa` node (fx), or the region
    torch.export's trace made at once (`_mapped`'s function says its `cp_call`); None for any other node."""
    from ...spmd.mapped import ShardMapped
    from .source import source_line

    if node.target is cp_sdpa:
        return (*node.args, node.kwargs["causal"], node.kwargs["scale"], node.kwargs["where"])
    fn = node.target
    if not isinstance(fn, ShardMapped) or getattr(fn.f, "cp_call", None) is None:
        return None
    q, k, v, *mask = node.args
    return (q, k, v, mask[0] if mask else None, *fn.f.cp_call, source_line(node))


__all__ = [
    "CP_AXIS", "Setting", "attention_as_regions", "attention_regions", "attention_spec", "cp_sdpa", "cp_size",
    "mask_spec", "zigzag", "zigzag_input",
]  # fmt: skip
