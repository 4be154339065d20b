"""Pipeline parallelism: this rank's stages run by torch.distributed.pipelining, as the plan's schedule says.

The compiler cut the program into stages and chose the schedule (`compiler.pipeline`);
lowering made this rank's stage modules. Here each becomes a `PipelineStage` over
the pp process group, whose timeout bounds every send and receive, and the
core schedule becomes torch's: its own class for GPipe, 1F1B, interleaved 1F1B and
ZBV, and for ZB-H1 the core's action lists on torch's schedule runtime. The loss is
computed on the last stage and every rank gets the step's mean; gradients are left
summed over the microbatches and divided once per parameter, and a parameter two
stages on different pp ranks share (tied embeddings) has its gradient summed
between them.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from meshlib import schedule as core_schedule

from ...compiler.pipeline.stages import boundary_values, param_holders
from ...compiler.program import TracedStages
from ...torch_private import local_tensor, runtime_schedule
from .. import dist as mdist
from ..comm import COUNTER

_TORCH = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}


def _loss(output, target):
    """The last stage already returns the microbatch's loss."""
    return output[0] if isinstance(output, (tuple, list)) else output


class PipelineRun:
    """This pp rank's stages under the schedule: one global batch through all microbatches at a time."""

    def __init__(self, stages: list[PipelineStage], schedule, core, group, local: list[int], owners: dict[str, int]):
        self.stages, self.schedule, self.core, self.group, self.local = stages, schedule, core, group, local
        n = len(core.placement)
        self.first, self.last = 0 in local, (n - 1) in local
        self.last_rank = dist.get_global_rank(group, core.placement[n - 1])
        self.owners = owners  # parameter -> the first stage that holds it (its gradient counts there)
        self.tied: list[tuple[set[str], object]] = []

    def owns(self, name: str) -> bool:
        return self.owners.get(name) in self.local

    def run(self, local: list[torch.Tensor], *, train: bool) -> float:
        """Every microbatch forward (and backward, training) through this rank's stages; the mean loss."""
        losses: list[torch.Tensor] = []
        target = torch.zeros(local[0].shape[0]) if self.last else None
        step = self.schedule.step if train else self.schedule.eval
        kwargs = {"target": target, "losses": losses} if self.last else {}
        try:
            step(*(local if self.first else ()), return_outputs=False, **kwargs)
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise TimeoutError(
                f"pipeline step timed out on rank {dist.get_rank()} (stages {sorted(self.local)}, schedule "
                f"{self.core.name}) waiting for a send or receive between pp ranks: {err}. A peer rank died, "
                "skipped the step or is far slower. Fix: check the other ranks' errors; if the stages are "
                "just slow, raise `timeout=` (seconds) in parallelize"
            ) from err
        value = torch.stack([x.detach().to(torch.float64) for x in losses]).mean() if losses else torch.zeros(())
        value = value.to(torch.float64)
        dist.broadcast(value, src=self.last_rank, group=self.group)
        COUNTER.record("step", "broadcast", "pp", 8, "loss")
        return float(value)

    def finish_gradients(self, params: dict[str, nn.Parameter]) -> None:
        """Divide each gradient once by the microbatch count, then sum tied parameters' between stages."""
        for p in params.values():
            if p.grad is not None:
                p.grad.div_(self.core.m)
        for names, group in self.tied:
            for name in sorted(names):
                p = params.get(name)
                if p is None or p.grad is None:
                    continue
                g = local_tensor(p.grad)
                dist.all_reduce(g, group=group)
                COUNTER.record("backward", "all_reduce", "pp", g.numel() * g.element_size(), f"tied {name}")


def apply_pipeline(par) -> PipelineRun | None:
    """The schedule step of `parallelize`: this rank's stage modules as `PipelineStage`s, torch's schedule
    for the plan's, and a process group for each parameter two pp ranks share (call on every rank)."""
    compiled = par.compiled
    if not compiled.pipelined:
        return None
    core, stages_plan = compiled.schedule, compiled.stages
    group = mdist.group(par.device_mesh, compiled.pp_axis)
    device = par.device
    traced = isinstance(compiled.program, TracedStages)
    n = len(core.placement)
    stages = []
    for s, module in zip(par.local_stages, par.stage_modules, strict=True):
        if traced:
            moved = stages_plan.layouts
            ins = boundary_values(compiled, stages_plan.inputs[s], device, moved, par._coords)
            outs = boundary_values(compiled, stages_plan.outputs[s], device, moved, par._coords)
        else:
            ins = _zeros(stages_plan.inputs[s], device, grad=s > 0)
            outs = _zeros(stages_plan.outputs[s], device, grad=s < n - 1)
        # both given: no shape-inference forward on uninitialized buffers
        stages.append(PipelineStage(module, s, n, device, input_args=ins, output_args=outs, group=group))
    count_sends(stages, compiled.pp_axis)
    sched = make_schedule(stages, core, core.m, scale_grads=False)  # a tied parameter on two local stages
    owners: dict[str, int] = {}
    for s, names in enumerate(stages_plan.params):
        for name in names:
            owners.setdefault(name, s)
    run = PipelineRun(stages, sched, core, group, par.local_stages, owners)
    run.tied = tied_groups(stages_plan, core, compiled, compiled.pp_axis)
    return run


def placement(name: str, p: int, v: int) -> tuple[int, ...]:
    """Stage -> pp rank: round-robin (`s % p`), or V-shaped for zbv."""
    return core_schedule(name, p, max(p, 2 * p), v if name != "zbv" else None).placement


def count_sends(stages: list[PipelineStage], pp_axis: str) -> None:
    """Record in `COUNTER` the bytes of every send of these stages: torch's schedules build their
    forward and backward sends from the stage's `get_fwd_send_ops` / `get_bwd_send_ops`."""
    for stage in stages:
        for method, phase, step in (("get_fwd_send_ops", "forward", 1), ("get_bwd_send_ops", "backward", -1)):
            where = f"stage {stage.stage_index} -> {stage.stage_index + step}"
            setattr(stage, method, _counted(getattr(stage, method), phase, pp_axis, where))


def _counted(send_ops, phase: str, axis: str, where: str):
    def counted(chunk: int) -> list:
        ops = send_ops(chunk)
        for op in ops:
            COUNTER.record(phase, "send_recv", axis, op.tensor.numel() * op.tensor.element_size(), where)
        return ops

    return counted


def make_schedule(stages: list[PipelineStage], core, microbatches: int, loss_fn=_loss, *, scale_grads: bool = True):
    """The torch schedule that runs this rank's `stages` as the core schedule `core` says:
    torch's own class for GPipe, 1F1B, interleaved 1F1B and ZBV, and for ZB-H1 the core's
    action lists on torch's schedule runtime (which adds the sends and receives).

    `scale_grads=False` leaves the gradients summed over the microbatches (torch divides them
    per stage, so a parameter two stages of one rank share would be divided twice)."""
    name = core.name
    kw = dict(loss_fn=loss_fn, scale_grads=scale_grads)
    if name in _TORCH:
        cls = _TORCH[name]
        return cls(stages[0], microbatches, **kw) if name in ("gpipe", "1f1b") else cls(stages, microbatches, **kw)
    return runtime_schedule(stages, microbatches, dict(enumerate(core.actions)), **kw)


def _zeros(metas: tuple, device, *, grad: bool) -> tuple:
    """Tensors shaped like one microbatch's `metas` on `device`; the hidden state (first) needs grad."""
    out = []
    for i, t in enumerate(metas):
        wants = grad and i == 0 and t.is_floating_point() and t.dim() > 0
        out.append(torch.zeros(t.shape, dtype=t.dtype, device=device, requires_grad=wants))
    return tuple(out)


def tied_groups(stage_plan, core, compiled, pp_axis: str):
    """For each parameter held by stages on different pp ranks, a process group over those ranks
    (one per coordinate of the other axes; every rank creates every group, in the same order)."""
    by_ranks: dict[tuple[int, ...], set[str]] = {}
    for name, ranks in param_holders(stage_plan, core.placement).items():
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(sorted(ranks)), set()).add(name)
    mesh = compiled.mesh
    others = [a for a in mesh.axis_names if a != pp_axis]
    me = dist.get_rank()
    out = []
    for pp_ranks, names in sorted(by_ranks.items()):
        for coords in itertools.product(*(range(mesh.axis_size(a)) for a in others)):
            ranks = [mesh.rank({**dict(zip(others, coords)), pp_axis: r}) for r in pp_ranks]
            group = dist.new_group(ranks)
            if me in ranks:
                out.append((names, group))
    return out


__all__ = ["PipelineRun", "apply_pipeline", "count_sends", "make_schedule", "placement", "tied_groups"]
