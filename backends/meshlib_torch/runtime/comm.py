"""The collectives the compiler inserts, as autograd functions over local tensors.

`Comm` runs one `CommSpec`: forward turns the value's layout `src` into
`dst`; backward turns the gradient from `grad_dst` into the natural gradient
layout of `src`. Each axis step is one c10d collective on that axis's process
group (the same call on NCCL and gloo), or a local slice. Every call is
counted by `COUNTER`: logical bytes per rank, by kind and by provenance.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..compiler.placement.placements import Partial, Replicate, Shard, chunk_rows, part_sizes
from ..compiler.placement.placements import kind as pl_kind
from ..compiler.placement.redistribute import CommSpec, step_order
from ..compiler.placement.shapes import chunked_groups, moved_size, padded
from ..modules.recompute import comm_forward, gathers, kept, note_gathered


@dataclass
class CommCounter:
    """Logical bytes per rank, by (phase, kind, axis) and by provenance, since `reset()`."""

    enabled: bool = True
    by_kind: dict = field(default_factory=lambda: defaultdict(int))
    by_source: dict = field(default_factory=lambda: defaultdict(int))
    calls: int = 0

    def record(self, phase: str, kind: str, axis: str, nbytes: int, where: str) -> None:
        if not self.enabled:
            return
        self.by_kind[(phase, kind, axis)] += nbytes
        self.by_source[(phase, kind, axis, where)] += nbytes
        self.calls += 1

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_source.clear()
        self.calls = 0

    def total(self, *, kind: str | None = None, axis: str | None = None) -> int:
        return sum(
            b for (_, k, a), b in self.by_kind.items() if (kind is None or k == kind) and (axis is None or a == axis)
        )

    def snapshot(self) -> dict:
        return {"by_kind": dict(self.by_kind), "by_source": dict(self.by_source), "calls": self.calls}


COUNTER = CommCounter()


# -- one axis step --------------------------------------------------------------------------
def blocks(x: torch.Tensor, p: Shard, n: int) -> torch.Tensor:
    """Each rank's block of `x` under `p`, stacked: (n, ..., local size, ...). Every part of `p.dim` (one,
    `groups` equal ones, or unequal `parts`) is viewed as (n, its block) and rank r's are concatenated."""
    dim, shape = p.dim, list(x.shape)
    pieces = x.split(list(part_sizes(p, shape[dim])), dim)
    moved = [
        piece.reshape(shape[:dim] + [n, piece.shape[dim] // n] + shape[dim + 1 :]).movedim(dim, 0) for piece in pieces
    ]
    moved = [m.flip(0) if p.reversed_part(i) else m for i, m in enumerate(moved)]
    return moved[0] if len(moved) == 1 else torch.cat(moved, dim + 1)


def unblocks(stacked: torch.Tensor, p: Shard) -> torch.Tensor:
    """Inverse of `blocks`: (n, ..., local size, ...) -> the whole dim, every part's blocks in rank order."""
    dim, n, shape = p.dim, stacked.shape[0], list(stacked.shape[1:])
    pieces = stacked.split(list(part_sizes(p, shape[dim])), dim + 1)
    pieces = [piece.flip(0) if p.reversed_part(i) else piece for i, piece in enumerate(pieces)]
    whole = [
        piece.movedim(0, dim).reshape(shape[:dim] + [n * piece.shape[dim + 1]] + shape[dim + 1 :]) for piece in pieces
    ]
    return whole[0] if len(whole) == 1 else torch.cat(whole, dim)


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _flat0(shape) -> tuple[int, ...]:
    """c10d's *_into_tensor / *_tensor collectives concatenate ranks along dim 0."""
    return (shape[0] * shape[1],) + tuple(shape[2:]) if len(shape) > 1 else (shape[0],)


def all_gather(x: torch.Tensor, p: Shard, group, n: int, size: int | None = None) -> torch.Tensor:
    """The whole dim from every rank's piece. `size`: the whole dim's size, when it does not divide
    (torch.chunk's pieces, each padded to the first's size to move, the padding dropped after)."""
    if _grouped(p, n, size):
        return _merged(all_gather(_units(x, p), Shard(p.dim + 1), group, n, size // p.groups), p.dim)
    if _ragged(p, n, size):
        x = pad_to(x, p.dim, -(-size // n))
        return all_gather(x, p, group, n).narrow(p.dim, 0, size)
    x = x.contiguous()
    flat = torch.empty(_flat0((n,) + tuple(x.shape)) if x.dim() else (n,), dtype=x.dtype, device=x.device)
    all_gather_single(flat, x if x.dim() else x.reshape(1), group=group)
    return unblocks(flat.reshape((n,) + tuple(x.shape)), p)


def reduce_scatter(x: torch.Tensor, p: Shard, group, n: int, rank: int = 0) -> torch.Tensor:
    size = x.shape[p.dim]
    if _grouped(p, n, size):
        return _merged(reduce_scatter(_units(x, p), Shard(p.dim + 1), group, n, rank), p.dim)
    if _ragged(p, n, size):
        out = reduce_scatter(pad_to(x, p.dim, padded(size, n)), p, group, n)
        return out.narrow(p.dim, 0, chunk_rows(size, n, rank)[1])
    stacked = blocks(x, p, n).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, stacked.reshape(_flat0(stacked.shape)), group=group)
    return out


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def local_slice(x: torch.Tensor, p: Shard, rank: int, n: int) -> torch.Tensor:
    if _grouped(p, n, x.shape[p.dim]):
        return _merged(local_slice(_units(x, p), Shard(p.dim + 1), rank, n), p.dim)
    if _ragged(p, n, x.shape[p.dim]):
        return x.narrow(p.dim, *chunk_rows(x.shape[p.dim], n, rank)).contiguous()
    return blocks(x, p, n)[rank].contiguous()


def local_pad(x: torch.Tensor, p: Shard, rank: int, n: int, size: int | None = None) -> torch.Tensor:
    """A partial sum from a shard: this rank's block in place, zeros in the others' (no communication)."""
    if _grouped(p, n, size):
        return _merged(local_pad(_units(x, p), Shard(p.dim + 1), rank, n, size // p.groups), p.dim)
    if _ragged(p, n, size):
        shape = list(x.shape)
        shape[p.dim] = size
        out = x.new_zeros(shape)
        out.narrow(p.dim, chunk_rows(size, n, rank)[0], x.shape[p.dim]).copy_(x)
        return out
    stacked = x.new_zeros((n,) + tuple(x.shape))
    stacked[rank] = x
    return unblocks(stacked, p)


def all_to_all(x: torch.Tensor, src: Shard, dst: Shard, group, n: int, size: int | None = None, rank: int = 0):
    """Sharded on `src.dim` -> sharded on `dst.dim` (plain shards). `size`: the whole `src.dim`, when
    either dim does not divide (both are padded to equal pieces to move)."""
    whole = x.shape[dst.dim]
    if _grouped(src, n, size) or _grouped(dst, n, whole):
        raise NotImplementedError(
            f"an all-to-all from {src} to {dst} of a dim cut in torch.chunk's pieces group by group (a sequence over "
            "cp merged with the batch, uneven='chunk'); the compiler does not plan one"
        )
    if _ragged(src, n, size) or _ragged(dst, n, whole):
        x = pad_to(pad_to(x, dst.dim, padded(whole, n)), src.dim, -(-size // n))
        out = all_to_all(x, src, dst, group, n)
        return out.narrow(src.dim, 0, size).narrow(dst.dim, 0, chunk_rows(whole, n, rank)[1])
    parts = blocks(x, dst, n).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    return unblocks(out, src)


def _ragged(p: Shard, n: int, size: int | None) -> bool:
    """A plain shard of a dim of `size` that does not divide over `n` ranks."""
    return size is not None and p.plain and size % n != 0


def _grouped(p: Shard, n: int, size: int | None) -> bool:
    """A shard in equal groups of a dim of `size` (the whole) that `n` does not divide, each group in
    torch.chunk's pieces (`shapes.chunked_groups`): every step runs on the groups' unit dim, as a plain one."""
    return size is not None and chunked_groups(p, size, n)


def _units(x: torch.Tensor, p: Shard) -> torch.Tensor:
    """`x` with `p.dim` viewed as (groups, unit)."""
    shape = list(x.shape)
    return x.reshape(shape[: p.dim] + [p.groups, shape[p.dim] // p.groups] + shape[p.dim + 1 :])


def _merged(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_units`: dims `dim` and `dim + 1` as one."""
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2 :])


def pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`x` with zeros after its end along `dim`, to `size`."""
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def step(x: torch.Tensor, a, b, group, n: int, rank: int, size: int | None = None) -> torch.Tensor:
    """Change one axis's placement from `a` to `b`; `size`: the whole size of the dim `a` shards."""
    if a == b:
        return x
    if isinstance(a, Partial):
        return all_reduce(x, group) if isinstance(b, Replicate) else reduce_scatter(x, b, group, n, rank)
    if isinstance(a, Shard) and isinstance(b, Replicate):
        return all_gather(x, a, group, n, size)
    if isinstance(a, Shard) and isinstance(b, Shard):
        return all_to_all(x, a, b, group, n, size, rank)
    if isinstance(a, Replicate) and isinstance(b, Shard):
        return local_slice(x, b, rank, n)
    if isinstance(a, Shard) and isinstance(b, Partial):
        return local_pad(x, a, rank, n, size)
    raise ValueError(f"no step from {a} to {b}")


def moved_bytes(x: torch.Tensor, a, b, n: int, size: int | None) -> int:
    """What one step moves per rank, as the plan counts it: the value with this axis whole, a dim it
    cuts unevenly padded to equal pieces (`size`: the whole of the dim `a` shards)."""
    shape = list(x.shape)
    if isinstance(a, Shard):
        shape[a.dim] = size if size is not None else shape[a.dim] * n
        shape[a.dim] = moved_size(a, shape[a.dim], n)
    if isinstance(b, Shard):
        shape[b.dim] = moved_size(b, shape[b.dim], n)
    return math.prod(shape) * x.element_size()


class Comm(nn.Module):
    """One inserted redistribution, bound to the process groups of its axes."""

    def __init__(
        self, spec: CommSpec, axes, groups: dict, ranks: dict, counter: CommCounter = COUNTER, mode: str = "none"
    ):
        super().__init__()
        self.spec, self.axes, self.groups, self.ranks, self.counter = spec, axes, groups, ranks, counter
        self.sizes = dict(zip(axes.names, axes.sizes))
        self.sync = True  # False skips backward all-reduces of partial gradients (accumulation)
        self.keep = kept(spec, mode)  # under recompute: cached through it (else it runs again)
        self.gathers = gathers(spec)  # only gathers: backward may gather again what it keeps as the shard

    def run(self, x: torch.Tensor, frm, to, phase: str) -> torch.Tensor:
        pairs = [(name, a, b) for name, a, b in zip(self.axes.names, frm, to) if a != b]
        state = dict(zip(self.axes.names, frm))
        for name, a, b in step_order(pairs):
            n = self.sizes[name]
            if phase == "backward" and not self.sync and isinstance(a, Partial) and isinstance(b, Replicate):
                continue
            size = self._whole(state, name, a.dim) if isinstance(a, Shard) else None
            payload = moved_bytes(x, a, b, n, size)
            x = step(x, a, b, self.groups.get(name), n, self.ranks.get(name, 0), size)
            state[name] = b
            if pl_kind(a, b) is not None:  # not a local slice or pad
                self.counter.record(phase, _kind(a, b), name, payload, f"{self.spec.producer}@{self.spec.source}")
        return x

    def _whole(self, state: dict, axis: str, dim: int) -> int:
        """The size of `dim` with `axis` whole: the other axes that cut it cut it evenly (an uneven dim is
        cut by one axis only), so it is the same on every rank."""
        size = self.spec.shape[dim]
        for name, p in state.items():
            if name != axis and isinstance(p, Shard) and p.dim == dim:
                size //= self.sizes[name]
        return size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CommFn.apply(x, self)


def _kind(a, b) -> str:
    if isinstance(a, Partial):
        return "all_reduce" if isinstance(b, Replicate) else "reduce_scatter"
    return "all_gather" if isinstance(b, Replicate) else "all_to_all"


class _CommFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm):
        ctx.comm = comm
        spec = comm.spec
        with torch.no_grad():
            out = comm_forward(spec.name, comm.keep, lambda phase: comm.run(x, spec.src, spec.dst, phase))
        if comm.gathers:
            note_gathered(out, x, lambda shard: comm.run(shard, spec.src, spec.dst, "backward"))
        return out

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        target = comm.spec.grad_target()
        with torch.no_grad():
            return comm.run(grad, comm.spec.grad_dst, target, "backward"), None


def reducer(groups: dict, counter: CommCounter = COUNTER):
    """The `reduce` of the rank-dependent ops (`modules.special`): an all-reduce over the named axis's
    process group, counted."""

    def reduce(x: torch.Tensor, op: str, axis: str, wait: bool = True):
        counter.record("forward", "all_reduce", axis, x.numel() * x.element_size(), "cross_entropy")
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return dist.all_reduce(x, op=reduce_op, group=groups[axis], async_op=not wait)

    return reduce


__all__ = [
    "COUNTER", "Comm", "CommCounter", "all_gather", "all_reduce", "all_gather_single", "pad_to", "reduce_scatter",
    "reducer", "reduce_scatter_single",
]  # fmt: skip
