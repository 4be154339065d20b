"""Shape arithmetic: how dims map through views and indexing, and local shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .placements import Layout, Shard, chunk_rows, part_sizes, parts_divide


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dims of `src` and `dst` whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi = src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj = dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def view_shards(src: Sequence[int], dst: Sequence[int], dim: int, groups: int = 1) -> list[tuple[int, int]]:
    """`(dst dim, groups)` shards that a shard of `src` dim `dim` (in `groups` parts) may become
    after a view; each is right wherever its dim splits evenly over the axis (`divides`).

    Within the run of dims the view merges or splits, the shard is, in the run's flat order,
    `G` equal groups each split n ways, where `G` is `groups` times the sizes of the run's dims
    before `dim`. In `dst` that is a shard of a dim of the run whose preceding sizes `P` divide
    `G`, in `G / P` groups: merging `(batch, seq)` with the sequence split gives the merged dim
    split in `batch` groups, and splitting it back gives the sequence shard again.
    """
    found = view_groups(src, dst)
    if found is None:
        return []
    for gi, gj in found:
        if dim not in gi:
            continue
        flat = groups * math.prod(src[d] for d in gi if d < dim)
        out, before = [], 1
        for j in gj:
            if flat % before == 0 and dst[j] > 1 and dst[j] % (flat // before) == 0:
                out.append((j, flat // before))
            before *= dst[j]
        return out
    return []


def expand_index(shape: Sequence[int], index) -> list | None:
    """A basic index (slices, ints, None, Ellipsis) as one item per input dim (Ellipsis expanded, `None`s
    kept where they insert a dim); None for any other index."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not (isinstance(it, (slice, int)) or it is None or it is Ellipsis) for it in items):
        return None
    n_real = sum(1 for it in items if it is not None and it is not Ellipsis)
    expanded: list = []
    for it in items:
        if it is Ellipsis:
            expanded += [slice(None)] * (len(shape) - n_real)
        else:
            expanded.append(it)
    return expanded + [slice(None)] * (len(shape) - sum(1 for it in expanded if it is not None))


def index_items(shape: Sequence[int], index) -> dict[int, tuple[object, int | None]] | None:
    """For basic indexing, input dim -> (its item, its output dim: None where an int removes it)."""
    expanded = expand_index(shape, index)
    if expanded is None:
        return None
    out: dict[int, tuple[object, int | None]] = {}
    d = o = 0
    for it in expanded:
        if it is None:
            o += 1
            continue
        out[d] = (it, None if isinstance(it, int) else o)
        o += not isinstance(it, int)
        d += 1
    return out


def index_dim_map(shape: Sequence[int], index) -> dict[int, int | None] | None:
    """For basic indexing, input dim -> output dim (None: sliced or removed)."""
    items = index_items(shape, index)
    if items is None:
        return None
    whole = lambda d, it: isinstance(it, slice) and it.indices(shape[d]) == (0, shape[d], 1)  # noqa: E731
    return {d: o if whole(d, it) else None for d, (it, o) in items.items()}


def local_shape(shape: Sequence[int], layout: Layout, sizes: Sequence[int], coords=None) -> tuple[int, ...]:
    """The shape the rank at `coords` (default: coordinate 0 on every axis, the largest piece) holds
    of a value of global `shape`. A dim that does not divide is cut in torch.chunk's sizes, as
    DTensor's Shard cuts it; a shard in groups that do not divide, each group so (`chunked_groups`)."""
    out = list(shape)
    for i, (p, n) in enumerate(zip(layout, sizes)):
        if isinstance(p, Shard) and p.parts:
            if not parts_divide(p, out[p.dim], n):
                raise ValueError(f"dim {p.dim} of {tuple(shape)} does not split over {n} ranks in parts {p.parts}")
            out[p.dim] //= n
        elif isinstance(p, Shard):
            if chunked_groups(p, out[p.dim], n):
                out[p.dim] = p.groups * chunk_rows(out[p.dim] // p.groups, n, coords[i] if coords else 0)[1]
            elif out[p.dim] % (n * p.groups) == 0 or (p.groups > 1 and out[p.dim] % n == 0):
                out[p.dim] //= n
            elif p.groups == 1:
                out[p.dim] = chunk_rows(out[p.dim], n, coords[i] if coords else 0)[1]
            else:
                raise ValueError(f"dim {p.dim} of {tuple(shape)} does not divide over {n} ranks in {p.groups} groups")
    return tuple(out)


def dim_ways(layout: Layout, sizes: Sequence[int]) -> dict[int, int]:
    """Each dim `layout` cuts, mapped to how many pieces all its axes cut it into."""
    ways: dict[int, int] = {}
    for p, n in zip(layout, sizes):
        if isinstance(p, Shard):
            ways[p.dim] = ways.get(p.dim, 1) * n
    return ways


def ragged_dims(shape: Sequence[int], layout: Layout, sizes: Sequence[int]) -> set[int]:
    """The dims of a value of global `shape` that `layout` cuts unevenly: their size differs by rank."""
    size, out = list(shape), set()
    for p, n in zip(layout, sizes):  # in mesh order, each axis cutting what the ones before it left
        if not isinstance(p, Shard):
            continue
        d = p.dim
        if chunked_groups(p, size[d], n):
            out.add(d)
            size[d] = p.groups * -(-(size[d] // p.groups) // n)
        else:
            out |= {d} if size[d] % n else set()
            size[d] = -(-size[d] // n)
    return out


def chunked_groups(p: Shard, size: int, n: int) -> bool:
    """`p` cuts a dim of `size` in equal groups that `n` does not divide, each group in torch.chunk's pieces
    (every rank non-empty): a sequence cut unevenly, merged with the batch before it ((B, S) -> B*S rows,
    the sequence over context parallelism under uneven='chunk')."""
    return (p.groups > 1 and not p.mirror and size % p.groups == 0 and (size // p.groups) % n != 0
            and chunk_fits(size // p.groups, n))  # fmt: skip


def divides(shape: Sequence[int], p, n: int, uneven: bool = False) -> bool:
    """`p` can cut `shape` over `n` ranks: evenly, or with `uneven` in torch.chunk's sizes (a plain
    shard, every rank's piece non-empty)."""
    if not isinstance(p, Shard):
        return True
    if p.dim >= len(shape):
        return False
    size = shape[p.dim]
    if parts_divide(p, size, n):
        return True
    return uneven and (p.plain and chunk_fits(size, n) or chunked_groups(p, size, n))


def chunk_fits(size: int, n: int) -> bool:
    """torch.chunk cuts `size` into `n` non-empty pieces (7 over 4 does, as 2,2,2,1; 5 over 4 does not)."""
    return size >= n and (n - 1) * -(-size // n) < size


def padded(size: int, n: int) -> int:
    """`size` rounded up to `n` equal pieces: what a collective over an uneven dim moves."""
    return -(-size // n) * n


def moved_size(p: Shard, size: int, n: int) -> int:
    """A dim of `size` that `p` cuts over `n` ranks, as a collective moves it: padded to equal pieces (group by
    group where each group is cut in torch.chunk's pieces)."""
    groups = p.groups if chunked_groups(p, size, n) else 1
    return groups * padded(size // groups, n)


def shard_indices(shape, layout: Layout, sizes, coords) -> list[torch.Tensor]:
    """Per dim, the global indices this rank holds (nested shards applied in mesh order; a plain
    shard that does not divide in torch.chunk's sizes; a shard in groups or parts: its block of each)."""
    idx = [torch.arange(n) for n in shape]
    for p, n, c in zip(layout, sizes, coords):
        if isinstance(p, Shard):
            d = idx[p.dim]
            if p.plain and d.numel() % n:
                idx[p.dim] = d.narrow(0, *chunk_rows(d.numel(), n, c))
                continue
            if chunked_groups(p, d.numel(), n):
                unit = d.numel() // p.groups
                idx[p.dim] = d.view(p.groups, unit).narrow(1, *chunk_rows(unit, n, c)).reshape(-1)
                continue
            pieces = d.split(list(part_sizes(p, d.numel())))
            idx[p.dim] = torch.cat([piece.reshape(n, -1)[p.rank_block(i, c, n)] for i, piece in enumerate(pieces)])
    return idx


def rank_order(shape, layout: Layout, sizes) -> dict[int, torch.Tensor]:
    """For each dim a shard in unequal parts cuts: the model's index of each row when the rows are laid
    out in rank order (rank 0's block of every part, then rank 1's, ...), as a DTensor `Shard(dim)`
    holds them (DTensor has no placement for unequal parts). Row `i` in rank order is the model's row
    `order[dim][i]`; empty for a layout without unequal parts."""
    out = {}
    for p, n in zip(layout, sizes):
        if isinstance(p, Shard) and p.parts:
            rows = [shard_indices(shape, (p,), (n,), (c,))[p.dim] for c in range(n)]
            out[p.dim] = torch.cat(rows)
    return out
