"""Dims split in parts: a fused projection's output cut into q, k and v.

A shard in parts (`Shard(dim, groups=k)` for k equal parts, `Shard(dim, parts=w)`
for unequal ones, as grouped-query attention's q, k and v) holds on each rank a
block of every part. So a slice that takes exactly one part of that dim needs no
communication: its result is a plain shard of the part, and on each rank it
takes the part's local block (`local_part_bounds`). Here: how a traced graph
cuts a projection's output (`cut_sizes`: one `split` into sizes, or slices that
tile the dim), which part a slice takes (`part_taken`), its bounds on a rank,
and where a view carries a shard in unequal parts (`view_dims`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.fx as fx

from .bind import OpView, bind
from .placements import Shard, part_sizes
from .shapes import expand_index, index_items, local_shape, view_groups


def slice_bounds(v: OpView) -> tuple[int, int, int, int]:
    """`(dim, start, end, step)` of a "slice" op (`aten.slice.Tensor`, `narrow`), clamped to the dim."""
    shape = v.shape(v.tensors[0])
    dim = (v.p.get("dim") or 0) % len(shape)
    if "length" in v.p:  # narrow(dim, start, length)
        start = v.p.get("start") or 0
        start += shape[dim] if start < 0 else 0
        return dim, start, start + v.p["length"], 1
    return (dim, *slice(v.p.get("start"), v.p.get("end"), v.p.get("step") or 1).indices(shape[dim]))


def index_slice(shape: Sequence[int], index) -> tuple[int, slice, int] | None:
    """`(input dim, its slice, output dim)` of a basic index that slices one dim and keeps the others
    whole (None or Ellipsis aside); None for any other index."""
    items = index_items(shape, index)
    if items is None:
        return None
    cut = [(d, it, o) for d, (it, o) in items.items() if not _whole(it, shape[d])]
    return cut[0] if len(cut) == 1 and isinstance(cut[0][1], slice) else None


def _whole(item, size: int) -> bool:
    return isinstance(item, slice) and item.indices(size) == (0, size, 1)


def part_taken(p: Shard, size: int, start: int, end: int, step: int = 1) -> int | None:
    """The part of a dim of `size`, cut as `p` cuts it, that `[start, end)` is exactly; else None."""
    sizes = part_sizes(p, size)
    if p.plain or p.mirror or sizes is None or step != 1:  # a mirrored part alone is no plain shard
        return None
    at = 0
    for i, s in enumerate(sizes):
        if (start, end) == (at, at + s):
            return i
        at += s
    return None


def local_bounds(p: Shard, local_size: int, i: int) -> tuple[int, int]:
    """Where part `i` lies in a rank's block of the dim (`local_size`: that block's size)."""
    sizes = part_sizes(p, local_size)
    start = sum(sizes[:i])
    return start, start + sizes[i]


def part_cut(view: OpView, need) -> tuple[int, Shard] | None:
    """`(dim, placement)` where a slice or basic index `view`, its input in layout `need`, cuts a dim
    held in parts (propagation chose it, so the cut takes exactly one part); else None."""
    if view.kind == "slice":
        dim = slice_bounds(view)[0]
    else:
        cut = index_slice(view.shape(view.tensors[0]), view.p["index"])
        if cut is None:
            return None
        dim = cut[0]
    held = [p for p in need if isinstance(p, Shard) and p.dim == dim and not p.plain]
    return (dim, held[0]) if held else None


def local_part_bounds(node: fx.Node, view: OpView, need, sizes: Sequence[int]) -> None:
    """Rewrite `node`, a slice (or index, or narrow) of one part of a dim held in parts, to take that
    part's block on a rank: its local bounds in the rank's block of the dim (`local_bounds`)."""
    dim, p = part_cut(view, need)
    shape = view.shape(view.tensors[0])
    if view.kind == "slice":
        _, start, end, step = slice_bounds(view)
    else:
        start, end, step = index_slice(shape, view.p["index"])[1].indices(shape[dim])
    lo, hi = local_bounds(p, local_shape(shape, need, sizes)[dim], part_taken(p, shape[dim], start, end, step))
    x = node.args[0]
    if view.kind == "index":
        items = expand_index(shape, view.p["index"])
        at = [i for i, it in enumerate(items) if it is not None][dim]
        node.args = (x, tuple(items[:at] + [slice(lo, hi)] + items[at + 1 :]))
    elif "length" in view.p:  # narrow
        node.args, node.kwargs = (x, dim, lo, hi - lo), {}
    else:
        node.args, node.kwargs = (x, dim, lo, hi), {}


def view_dims(src: Sequence[int], dst: Sequence[int], dim: int, parts: tuple[int, ...]) -> list[int]:
    """The dims of `dst` that a shard in unequal `parts` of `src` dim `dim` may become after a view.

    In the run of dims the view merges or splits, `dim` must come first (only size-1 dims before
    it), so each rank's block of a part is one contiguous run of the run's flat order. In `dst` it
    is then a dim with only size-1 dims before it in the run, whose rows each part fills whole:
    `(B, S, 64)` to `(B * S, 64)` or `(B, S, 8, 8)`, with 64 = 32 + 16 + 16, carries the parts."""
    for gi, gj in view_groups(src, dst) or []:
        if dim not in gi:
            continue
        if math.prod(src[d] for d in gi if d < dim) != 1 or src[dim] % sum(parts):
            return []
        total = math.prod(src[d] for d in gi)
        unit = src[dim] // sum(parts) * math.prod(src[d] for d in gi if d > dim)  # flat elements per weight
        out, before = [], 1
        for j in gj:
            if before == 1 and dst[j] > 1 and unit % (total // dst[j]) == 0:
                out.append(j)
            before *= dst[j]
        return out
    return []


def cut_sizes(cur: fx.Node, users: list[fx.Node]) -> list[int] | None:
    """The sizes of the parts `users` cut the last dim of `cur` into: one `split` along it, or slices
    of it alone (each user one) that tile it; None for anything else or a single part."""
    shape = tuple(cur.meta["val"].shape)
    views = [bind(u) for u in users]
    if len(views) == 1 and views[0].kind == "split":
        split = views[0]
        if (split.p.get("dim") or 0) % len(shape) != len(shape) - 1:
            return None
        sizes = [tuple(t.shape)[-1] for t in split.out]
    else:
        spans = sorted({_span(v, shape) for v in views})
        if not spans or None in spans:
            return None
        ends = [0] + [e for _, e in spans]
        if any(s != ends[i] or e <= s for i, (s, e) in enumerate(spans)) or ends[-1] != shape[-1]:
            return None
        sizes = [e - s for s, e in spans]
    return sizes if len(sizes) > 1 else None


def _span(v: OpView, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """`(start, end)` of a slice of the last dim alone, with step 1."""
    if v.kind == "slice":
        dim, start, end, step = slice_bounds(v)
        return (start, end) if dim == len(shape) - 1 and step == 1 else None
    if v.kind == "index":
        cut = index_slice(shape, v.p["index"])
        if cut is None or cut[0] != len(shape) - 1:
            return None
        start, end, step = cut[1].indices(shape[-1])
        return (start, end) if step == 1 else None
    return None


__all__ = [
    "cut_sizes", "index_slice", "local_bounds", "local_part_bounds", "part_cut", "part_taken", "slice_bounds",
    "view_dims",
]  # fmt: skip
