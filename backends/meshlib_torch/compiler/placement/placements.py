"""Placements of one value on one mesh axis, and what it costs to change them.

`Shard(dim, groups)` splits `dim` over the axis; with `groups > 1` the dim is
first viewed as `groups` equal parts and each part is split (a fused qkv
projection holds whole heads of q, k and v this way). `Shard(dim, parts=w)`
does the same for parts of unequal sizes, in the ratio `w` (lowest terms): a
fused qkv under grouped-query attention, q of 32 rows and k and v of 16 each, is
`Shard(0, parts=(2, 1, 1))`, and rank r of n holds rows r/n..(r+1)/n of each part.
`Shard(dim, groups=2k, mirror=True)` hands the blocks of every second part out in reverse rank
order: context parallelism's head-tail (zigzag) layout of a sequence is `Shard(1, 2, mirror=True)`,
rank r of n holding chunks r and 2n-1-r of 2n (causal attention's work balanced over the ranks).
`Replicate()` holds the whole value; `Partial()` holds a summand.

A layout is a tuple of placements, one per mesh axis, in mesh order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = float("inf")
CP_AXIS = "cp"  # context parallelism's mesh axis: a data axis outside attention (`capture.attention`)
SLICE_COST = 1e-6  # below any collective's bytes


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    groups: int = 1
    parts: tuple[int, ...] = ()  # unequal parts' sizes in lowest terms (groups stays 1), each split
    mirror: bool = False  # odd parts' blocks in reverse rank order (the zigzag layout); groups even

    def __post_init__(self):
        if self.mirror and (self.parts or self.groups < 2 or self.groups % 2):
            raise ValueError(
                f"Shard(dim={self.dim}, groups={self.groups}, mirror=True): a mirrored shard pairs each part with the "
                "next, reversed (the zigzag layout), so it needs an even number of equal groups and no parts"
            )
        if not self.parts:
            return
        w = self.parts
        if (
            self.groups != 1 or len(w) < 2 or any(not isinstance(x, int) or x < 1 for x in w)
            or math.gcd(*w) != 1 or len(set(w)) == 1
        ):  # fmt: skip
            raise ValueError(
                f"Shard(dim={self.dim}, groups={self.groups}, parts={w}): parts are the sizes of two or more "
                "unequal parts in lowest terms (positive ints, gcd 1), with groups=1; equal parts are groups=k"
            )

    @property
    def plain(self) -> bool:
        """One contiguous piece per rank (no groups, no parts)."""
        return self.groups == 1 and not self.parts

    def at(self, dim: int) -> Shard:
        """The same split (groups, parts or mirror kept) of another dim: where an op moves the dim, same size."""
        return Shard(dim, self.groups, self.parts, self.mirror)

    def reversed_part(self, part: int) -> bool:
        """Part `part` hands its blocks out in reverse rank order (every second part of a mirrored shard)."""
        return self.mirror and part % 2 == 1

    def rank_block(self, part: int, rank: int, n: int) -> int:
        """Which of part `part`'s `n` blocks rank `rank` holds: its own, or the mirror's under `mirror`."""
        return n - 1 - rank if self.reversed_part(part) else rank

    def __repr__(self) -> str:
        if self.mirror:
            return f"S({self.dim}/{self.groups}z)"
        if self.parts:
            return f"S({self.dim}/{':'.join(map(str, self.parts))})"
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim}/{self.groups})"


def zigzag(dim: int) -> Shard:
    """The head-tail placement of a sequence dim over `cp`: two chunks per rank, i and 2*cp-1-i."""
    return Shard(dim, 2, mirror=True)


def part_sizes(p: Shard, size: int) -> tuple[int, ...] | None:
    """The sizes of the parts `p` views a dim of `size` as (each then split over the axis); one part
    for a plain shard. None when `size` is no multiple of the parts' total."""
    weights = p.parts or (1,) * p.groups
    unit, rest = divmod(size, sum(weights))
    return None if rest else tuple(w * unit for w in weights)


def parts_divide(p: Shard, size: int, n: int) -> bool:
    """Every part of a dim of `size` splits evenly over `n` ranks."""
    sizes = part_sizes(p, size)
    return sizes is not None and all(s % n == 0 for s in sizes)


@dataclass(frozen=True, slots=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    def __repr__(self) -> str:
        return "P"


R = Replicate()
PARTIAL = Partial()
Placement = Shard | Replicate | Partial
Layout = tuple[Placement, ...]


def natural_grad(p: Placement) -> Placement:
    """The placement a value's gradient has when every consumer computed it in full."""
    return R if isinstance(p, Partial) else p


def kind(src: Placement, dst: Placement) -> str | None:
    """The collective that turns `src` into `dst` on one axis (None: no communication)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter" if isinstance(dst, Shard) else None
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard):
            return "all_to_all"
        return None  # -> Partial: the local block in place, zeros around it (pipeline boundaries only)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return None  # a local slice
    raise ValueError(f"no redistribution from {src} to {dst}")


def allowed(src: Placement, dst: Placement) -> bool:
    """Replicate/Shard -> Partial never happens: it would need a rank-dependent rescale."""
    return src == dst or not isinstance(dst, Partial)


BUS_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def bus_bytes(kind_: str, payload: float, n: int) -> float:
    """Ring bandwidth term: bytes each rank sends for a collective of `payload` bytes."""
    return BUS_FACTOR[kind_] * payload * (n - 1) / n if n > 1 else 0.0


def cost(src: Placement, dst: Placement, full_bytes: float, n: int, *, slice_ok: bool, grad: bool = False) -> float:
    """Bytes moved per rank to change `src` into `dst` for a value of `full_bytes` on this axis,
    forward and, when the value needs a gradient, backward (its whole gradient going back).

    `full_bytes` is the value's size with this axis unsharded. Slicing a
    replicated value is free and reduce-scattering a partial one costs half an
    all-reduce, but both start a new activation shard, which only `slice_ok`
    allows (sequence parallel regions); elsewhere they are ruled out so that
    activations stay where the parameters put them.
    """
    if src == dst:
        return 0.0
    if not allowed(src, dst):
        return INF
    k = kind(src, dst)
    if k is None and isinstance(src, Replicate) and not grad:
        # a local slice of a value nothing differentiates (a mask, positions, targets): next to free, but
        # not free, so that a value no consumer needs split stays whole
        return SLICE_COST
    if k in (None, "reduce_scatter") and not slice_ok:
        return INF
    if k is None:
        # A slice into a sequence-parallel region. Its backward all-gather mirrors the
        # reduce-scatter the region ends with, so it is not charged here: entering the
        # region early is how Megatron's sequence parallelism keeps the residual stream
        # sharded; charging it would make the greedy choice stay replicated instead.
        return 0.0
    fwd = bus_bytes(k, full_bytes, n)
    if not grad:
        return fwd
    back = kind(natural_grad(dst), natural_grad(src))
    return fwd + (0.0 if back is None else bus_bytes(back, full_bytes, n))


class Pending(__import__("torch").nn.Module):
    """Stands in the compiled graph for a collective or rank-dependent op until the
    runtime replaces it with one bound to real process groups."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec

    def forward(self, *args):
        raise RuntimeError(
            f"{self.spec.name} needs process groups: run the compiled model through "
            "meshlib_torch.runtime (e.g. `parallelize`), not the bare graph"
        )


def zero1_shard_dim(local_shape: tuple[int, ...], n: int, layout, ragged=frozenset(), axes: int = 1) -> int | None:
    """The dim of a local shard ZeRO-1 splits over `n` data-parallel ranks.

    First choice: a dim that divides evenly, and not one some axis splits in groups (a fused
    projection, whose local rows are not contiguous). Else the longest dim no other axis splits,
    unevenly, in torch.chunk's sizes as DTensor's Shard and FSDP2 use (see `chunk_rows`). None
    (a scalar, or every dim already split by another axis): each rank keeps the whole tensor. A dim
    another axis cuts unevenly (`ragged`) is never split again: DTensor cannot describe the nesting.
    Over more than one data axis (`axes`, an expert-parallel plan's dense weights over dp×ep) only a dim
    that divides evenly and that no other axis splits qualifies: there DTensor's nesting of the axes is
    the flat split the collectives make; with none, each rank keeps the whole."""
    grouped = {p.dim for p in layout if isinstance(p, Shard) and not p.plain} | set(ragged)
    if axes > 1:
        grouped |= {p.dim for p in layout if isinstance(p, Shard)}
    fits = [d for d, size in enumerate(local_shape) if size % n == 0 and size >= n and d not in grouped]
    if fits:
        return fits[0]
    if axes > 1:
        return None
    split = {p.dim for p in layout if isinstance(p, Shard)}
    free = [d for d in range(len(local_shape)) if d not in split and local_shape[d] > 1]
    return max(free, key=lambda d: local_shape[d]) if free else None


def chunk_rows(size: int, n: int, rank: int) -> tuple[int, int]:
    """(start, length) of `rank`'s piece when `size` rows split into `n` as torch.chunk does:
    pieces of ceil(size / n), the last ones shorter or empty."""
    step = -(-size // n)
    start = min(rank * step, size)
    return start, min(step, size - start)


def zero1_split(
    local_shape: tuple[int, ...], n: int, layout, ragged=frozenset(), axes: int = 1
) -> tuple[int, int] | None:
    """ZeRO-1 over `n` ranks (of `axes` mesh axes) on a tensor of this local shape: (elements of the
    largest piece, which is rank 0's; elements of the tensor padded to `n` equal pieces, which the
    collectives move). None when every rank keeps it whole; over one rank, the whole is the piece."""
    if n == 1:
        return math.prod(local_shape), math.prod(local_shape)
    d = zero1_shard_dim(local_shape, n, layout, ragged, axes)
    if d is None:
        return None
    row = math.prod(local_shape) // local_shape[d]
    step = -(-local_shape[d] // n)
    return step * row, step * n * row


def sync_axes(layout: Layout, axis_names: tuple[str, ...], data: tuple[str, ...]) -> tuple[str, ...]:
    """The data axes a parameter's gradient is summed over: those it is replicated on (an expert weight,
    split over `ep`, is summed over the data axes besides it)."""
    return tuple(a for a in data if isinstance(layout[axis_names.index(a)], Replicate))
