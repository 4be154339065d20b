"""Data parallelism: each data-parallel rank's gradient is a partial sum, summed once per step.

The compiled loss is each rank's share of the global mean (its targets over
the global count), so the summed gradients are the single process's. ZeRO-0
sums them with `GradSync` as DDP does: in DDP's buckets, each all-reduced
asynchronously once its gradients are in, behind the rest of backward, off
while microbatches accumulate (or a pipeline runs) and flushed after. ZeRO-1
sums them in the optimizer, ZeRO-2/3 in FSDP2 (`zero.py`).

A model cut by module FQN (no tracer could follow it) computes its own loss
on each rank's rows: its last stage averages that loss over the data-parallel
ranks (`MeanOver`), which equals the global mean when every rank's microbatch
counts the same number of targets.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...compiler.buckets import Buckets
from ...compiler.placement.placements import Shard, sync_axes
from ...compiler.program import EagerStages, deferred_loss
from .. import dist as mdist
from ..comm import COUNTER, CommCounter, local_slice


def sync_groups(par, params: dict[str, torch.nn.Parameter]) -> dict[str, tuple]:
    """Per parameter, the group (and its axes' name) its gradient is summed over: the data axes it is
    replicated on (`sync_axes`; an expert weight split over `ep` is summed over the others)."""
    c = par.compiled
    out = {}
    for name in params:
        axes = sync_axes(c.param_layouts[name], c.axes.names, c.data_axes)
        out[name] = (mdist.group(par.device_mesh, axes), "_".join(axes)) if axes else None
    return out


class GradSync(Buckets):
    """Sum every parameter's gradient over its data-parallel group (`groups`: per name, the group and its
    axes' name; None: nothing to sum) once its last microbatch is in, as DDP does: in DDP's buckets, each
    all-reduced asynchronously behind the rest of backward, all summed when `backward()` returns
    (`compiler.buckets.Buckets`). Not DDP itself: a DDP instance sums over one process group, while a
    rank's parameters sum over several (an expert weight not over `ep`), and a pipeline's stages run
    under torch's schedule with the sums deferred to one `flush()`."""

    def __init__(self, params: dict[str, torch.nn.Parameter], groups: dict[str, tuple | None],
                 reduce_dtype: torch.dtype, order=(), counter: CommCounter = COUNTER):  # fmt: skip
        super().__init__(params, groups, reduce_dtype, order)
        self.counter = counter

    def reduce(self, buf: torch.Tensor, bucket):
        work = dist.all_reduce(buf, group=bucket.group, async_op=True)
        self.counter.record("backward", "all_reduce", bucket.axis, buf.numel() * buf.element_size(), "grad sync")
        return work

    def flush(self) -> None:
        """Sum every gradient now (after a pipeline's microbatches, which ran with sync off)."""
        self.finish()


class MeanOver(torch.autograd.Function):
    """The mean of each rank's loss over a group; backward hands each rank its 1/n share."""

    @staticmethod
    def forward(ctx, loss, group, n: int, axis: str):
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        COUNTER.record("forward", "all_reduce", axis, total.numel() * total.element_size(), "loss mean")
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n, None, None, None


class LossSum:
    """The loss's sum over a data axis, out of the graph: the step starts it as soon as a microbatch's
    loss is computed and waits for it after backward, which it runs beside (the plan counts it as the
    forward all-reduce it is)."""

    def __init__(self, spec, group, axis: str, counter: CommCounter = COUNTER):
        self.spec, self.group, self.axis, self.counter = spec, group, axis, counter

    def start(self, loss: torch.Tensor):
        """`(value, work)`: `value` holds the sum once `work.wait()` returns."""
        value = loss.detach().clone()
        where = f"{self.spec.producer}@{self.spec.source}"  # as the graph's own collective would say
        self.counter.record("forward", "all_reduce", self.axis, value.numel() * value.element_size(), where)
        return value, dist.all_reduce(value, group=self.group, async_op=True)

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        """The sum, now; its gradient goes to `loss` as it is (an all-reduce's backward on a replicated value)."""
        value, work = self.start(loss)
        work.wait()
        return loss + (value - loss).detach()


class TargetCounts:
    """A loss's global count of targets per microbatch, counted by every rank from the whole batch it
    holds (the targets come from an input through views, pads and slices: `rank_ops.count_recipe`), so
    the loss needs no all-reduce for it."""

    def __init__(self, module, recipe: dict, layout, axes, microbatches: int):
        self.module, self.recipe, self.layout, self.axes, self.m = module, recipe, layout, axes, microbatches

    def set(self, inputs: dict[str, torch.Tensor]) -> None:
        """Hand the loss the counts of the microbatches of this global batch, in order."""
        x = inputs[self.recipe["input"]]
        ignore = self.module.ignore_index
        counts = [torch.zeros((), dtype=torch.int64) for _ in range(self.m)]
        for piece in _every_rank_part(x, self.layout, self.axes):
            for i, chunk in enumerate(piece.chunk(self.m)):
                counts[i] += (_apply(self.recipe["steps"], chunk) != ignore).sum()
        self.module.counts = counts


def _every_rank_part(x: torch.Tensor, layout, axes) -> list[torch.Tensor]:
    """The rows of a global input each coordinate of the axes that split its batch (dim 0) holds, every other
    dim whole: the recipe's pads and slices act on those (a label shift along a sequence split over `cp`
    reads the neighbouring rank's first label)."""
    parts = [x]
    for p, n in zip(layout, axes.sizes):
        if isinstance(p, Shard) and p.dim == 0:
            parts = [local_slice(part, p, c, n) for part in parts for c in range(n)]
    return parts


def _apply(steps, x: torch.Tensor) -> torch.Tensor:
    for step in steps:
        if step[0] == "pad":
            x = torch.nn.functional.pad(x, list(step[1]), value=step[2])
        else:
            _, dim, start, end, stride = step
            x = x[(slice(None),) * dim + (slice(start, end, stride),)]
    return x


def target_counts(par) -> list[TargetCounts]:
    """One `TargetCounts` per loss of this rank that can count its targets from the batch."""
    from ...modules.special import CrossEntropy

    compiled = par.compiled
    out = []
    for module in par.root.modules():
        recipe = module.spec.args.get("count_from") if isinstance(module, CrossEntropy) else None
        if recipe is not None:
            layout = compiled.input_layouts[recipe["input"]]
            out.append(TargetCounts(module, recipe, layout, compiled.axes, compiled.microbatches))
    return out


class DataSync(NamedTuple):
    """What the data step adds: the losses that count their targets from the whole batch, the loss's
    sum over a data axis the runtime runs beside backward, and ZeRO-0's gradient sum."""

    target_counts: list[TargetCounts]
    loss_sum: LossSum | None = None
    grad_sync: GradSync | None = None


class MeanOverRanks:
    """The eager last stage's loss averaged over the data-parallel ranks (its `meshlib_cut.finish`)."""

    def __init__(self, group, size: int, axis: str):
        self.group, self.size, self.axis = group, size, axis

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return MeanOver.apply(loss, self.group, self.size, self.axis)


def apply_data(par) -> DataSync:
    """ZeRO-0: a `GradSync` over the parameters whose gradients are partial sums over the data axes;
    the loss's sum over a data axis; and the eager last stage's loss averaged over them."""
    compiled = par.compiled
    counts = target_counts(par)
    data = compiled.data_axes
    if not data:
        return DataSync(counts)
    deferred = deferred_loss(compiled)
    loss_sum = grad_sync = None
    if deferred is not None:
        loss_sum = LossSum(deferred[0], mdist.group(par.device_mesh, deferred[1]), deferred[1])
    group, axis = mdist.group(par.device_mesh, data), "_".join(data)
    if compiled.options.zero == 0:
        synced = {n: q for n, q in par.named_model_parameters().items() if n in compiled.synced_params}
        reduce = getattr(torch, compiled.options.precision.reduce)
        grad_sync = GradSync(synced, sync_groups(par, synced), reduce, order=list(compiled.traced.params))
    last = len(compiled.stages.modules) - 1 if isinstance(compiled.program, EagerStages) else None
    if last is not None and last in par.local_stages:
        size = math.prod(compiled.mesh.axis_size(a) for a in data)
        par.stage_modules[par.local_stages.index(last)].meshlib_cut.finish = MeanOverRanks(group, size, axis)
    return DataSync(counts, loss_sum, grad_sync)


__all__ = [
    "DataSync", "GradSync", "LossSum", "MeanOver", "MeanOverRanks", "TargetCounts", "apply_data", "sync_groups",
    "target_counts",
]  # fmt: skip
