"""The collectives the compiler inserts, as autograd functions over local tensors.

`Comm` runs one `CommSpec`: forward turns the value's layout `src` into
`dst`; backward turns the gradient from `grad_dst` into the natural gradient
layout of `src`. Each axis step is one c10d collective on that axis's process
group (the same call on NCCL and gloo), or a local slice. Every call is
counted by `COUNTER`: logical bytes per rank, by kind and by provenance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..compiler.placements import Partial, Replicate, Shard, natural_grad
from ..compiler.placements import kind as pl_kind
from ..compiler.redistribute import CommSpec


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
def blocks(x: torch.Tensor, dim: int, groups: int, n: int) -> torch.Tensor:
    """View `dim` as (groups, n, block) and move `n` first: (n, ..., groups*block, ...) per rank."""
    shape = list(x.shape)
    block = shape[dim] // (groups * n)
    v = x.reshape(shape[:dim] + [groups, n, block] + shape[dim + 1 :])
    v = v.movedim(dim + 1, 0)
    return v.reshape([n] + shape[:dim] + [groups * block] + shape[dim + 1 :])


def unblocks(stacked: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """Inverse of `blocks`: (n, ..., groups*block, ...) -> the dim of size groups*n*block."""
    n, shape = stacked.shape[0], list(stacked.shape[1:])
    block = shape[dim] // groups
    v = stacked.reshape([n] + shape[:dim] + [groups, block] + shape[dim + 1 :])
    v = v.movedim(0, dim + 1)
    return v.reshape(shape[:dim] + [groups * n * block] + shape[dim + 1 :])


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _flat0(shape) -> tuple[int, ...]:
    """c10d's *_into_tensor / *_tensor collectives concatenate ranks along dim 0."""
    return (shape[0] * shape[1],) + tuple(shape[2:]) if len(shape) > 1 else (shape[0],)


def all_gather(x: torch.Tensor, p: Shard, group, n: int) -> torch.Tensor:
    x = x.contiguous()
    flat = torch.empty(_flat0((n,) + tuple(x.shape)) if x.dim() else (n,), dtype=x.dtype, device=x.device)
    _all_gather_single(flat, x if x.dim() else x.reshape(1), group=group)
    return unblocks(flat.reshape((n,) + tuple(x.shape)), p.dim, p.groups)


def reduce_scatter(x: torch.Tensor, p: Shard, group, n: int) -> torch.Tensor:
    stacked = blocks(x, p.dim, p.groups, n).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, stacked.reshape(_flat0(stacked.shape)), group=group)
    return out


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def local_slice(x: torch.Tensor, p: Shard, rank: int, n: int) -> torch.Tensor:
    return blocks(x, p.dim, p.groups, n)[rank].contiguous()


def local_pad(x: torch.Tensor, p: Shard, rank: int, n: int) -> torch.Tensor:
    """A partial sum from a shard: this rank's block in place, zeros in the others' (no communication)."""
    stacked = x.new_zeros((n,) + tuple(x.shape))
    stacked[rank] = x
    return unblocks(stacked, p.dim, p.groups)


def all_to_all(x: torch.Tensor, src: Shard, dst: Shard, group, n: int) -> torch.Tensor:
    """Sharded on `src.dim` -> sharded on `dst.dim` (plain shards)."""
    parts = blocks(x, dst.dim, dst.groups, n).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    return unblocks(out, src.dim, src.groups)


def step(x: torch.Tensor, a, b, group, n: int, rank: int) -> torch.Tensor:
    """Change one axis's placement from `a` to `b`."""
    if a == b:
        return x
    if isinstance(a, Partial):
        return all_reduce(x, group) if isinstance(b, Replicate) else reduce_scatter(x, b, group, n)
    if isinstance(a, Shard) and isinstance(b, Replicate):
        return all_gather(x, a, group, n)
    if isinstance(a, Shard) and isinstance(b, Shard):
        return all_to_all(x, a, b, group, n)
    if isinstance(a, Replicate) and isinstance(b, Shard):
        return local_slice(x, b, rank, n)
    if isinstance(a, Shard) and isinstance(b, Partial):
        return local_pad(x, a, rank, n)
    raise ValueError(f"no step from {a} to {b}")


def _order(pairs: list) -> list:
    """Reductions first, then gathers from the innermost axis out, then slices outermost first."""
    red = [p for p in pairs if isinstance(p[1], Partial)]
    gat = [p for p in pairs if isinstance(p[1], Shard) and not isinstance(p[2], Shard)][::-1]
    rest = [p for p in pairs if p not in red and p not in gat]
    return red + gat + rest


class Comm(nn.Module):
    """One inserted redistribution, bound to the process groups of its axes."""

    def __init__(self, spec: CommSpec, axes, groups: dict, ranks: dict, counter: CommCounter = COUNTER):
        super().__init__()
        self.spec, self.axes, self.groups, self.ranks, self.counter = spec, axes, groups, ranks, counter
        self.sizes = dict(zip(axes.names, axes.sizes))
        self.sync = True  # False skips backward all-reduces of partial gradients (accumulation)

    def run(self, x: torch.Tensor, frm, to, phase: str) -> torch.Tensor:
        pairs = [(name, a, b) for name, a, b in zip(self.axes.names, frm, to) if a != b]
        for name, a, b in _order(pairs):
            n = self.sizes[name]
            if phase == "backward" and not self.sync and isinstance(a, Partial) and isinstance(b, Replicate):
                continue
            payload = x.numel() * x.element_size() * (1 if not isinstance(a, Shard) else n)
            x = step(x, a, b, self.groups.get(name), n, self.ranks.get(name, 0))
            if pl_kind(a, b) is not None:  # not a local slice or pad
                self.counter.record(phase, _kind(a, b), name, payload, f"{self.spec.producer}@{self.spec.source}")
        return x

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
        with torch.no_grad():
            return comm.run(x, comm.spec.src, comm.spec.dst, "forward")

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        target = tuple(natural_grad(p) for p in comm.spec.src)
        with torch.no_grad():
            return comm.run(grad, comm.spec.grad_dst, target, "backward"), None


def reducer(groups: dict, counter: CommCounter = COUNTER):
    """The `reduce` of the rank-dependent ops (`compiler.special`): an all-reduce over the named axis's
    process group, counted."""

    def reduce(x: torch.Tensor, op: str, axis: str, wait: bool = True):
        counter.record("forward", "all_reduce", axis, x.numel() * x.element_size(), "cross_entropy")
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return dist.all_reduce(x, op=reduce_op, group=groups[axis], async_op=not wait)

    return reduce


__all__ = ["COUNTER", "Comm", "CommCounter", "all_gather", "all_reduce", "reduce_scatter", "reducer"]
