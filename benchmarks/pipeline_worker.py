"""The rank-side jobs of the pipeline benchmark (run by bench_pipeline.py through a RankPool, not by hand).

Each stage is a `WaitStage`: its forward, input-grad and weight-grad passes
sleep for fixed times instead of computing, so that 4 ranks on 2 cores do not
compete for the CPU and the timeline shows only the schedule and the
communication. The input path and the weight path meet in one multiply:

    out = Forward(x) * Weight(w)

`Forward` sleeps `t_f` forward and `t_i` backward; `Weight` returns `w` and
sleeps `t_w` backward. torch's zero-bubble split (`stage_backward_input`, then
`stage_backward_weight` from the saved multiply) runs `Forward`'s backward in
I and `Weight`'s in W; a full backward runs both. The script checks the split
on one process before it starts any rank.

- `latency`: one-way send/recv time of an activation between ranks 0 and 1.
- `run_schedule`: the schedule meshlib builds (`make_schedule`) over these
  stages, a warm-up step, then each step's (start, end, kind, stage,
  microbatch) of every compute action on this rank, by `time.perf_counter`.

They live in their own module because a RankPool job pickles by qualified name.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from meshlib import schedule as core_schedule
from meshlib_torch.runtime.parallelisms.pipeline import make_schedule

WIDTH = 8  # activation elements per microbatch: small, so a hop costs latency, not bandwidth


class _Forward(torch.autograd.Function):
    """Identity on the input path: sleeps `t_f` forward and `t_i` backward."""

    @staticmethod
    def forward(ctx, x, t_f: float, t_i: float):
        ctx.t_i = t_i
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_i)
        return grad, None, None


class _Weight(torch.autograd.Function):
    """Identity on the weight path: free forward, sleeps `t_w` backward."""

    @staticmethod
    def forward(ctx, w, t_w: float):
        ctx.t_w = t_w
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_w)
        return grad, None


class WaitStage(nn.Module):
    """A pipeline stage (chunk) whose passes take `t_f`, `t_i` and `t_w` seconds."""

    def __init__(self, t_f: float, t_i: float, t_w: float):
        super().__init__()
        self.t_f, self.t_i, self.t_w = t_f, t_i, t_w
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        if not x.requires_grad:  # the first stage's input: its backward still pays t_i, as a real stage's layers do
            x = x.detach().requires_grad_()
        return _Forward.apply(x, self.t_f, self.t_i) * _Weight.apply(self.weight, self.t_w)


def sum_loss(output, target):
    return (output - target).sum()


# -- p2p latency ---------------------------------------------------------------------------------
def latency(iters: int) -> list[float]:
    """Rank 0's one-way times (half a round trip, seconds) for an activation to rank 1 and back."""
    rank, x = dist.get_rank(), torch.zeros(1, WIDTH)
    out = []
    dist.barrier()
    for _ in range(iters):
        start = time.perf_counter()
        if rank == 0:
            dist.isend(x, 1).wait()
            dist.irecv(x, 1).wait()
        elif rank == 1:
            dist.irecv(x, 0).wait()
            dist.isend(x, 0).wait()
        out.append((time.perf_counter() - start) / 2)
    dist.barrier()
    return out if rank == 0 else []


# -- one schedule --------------------------------------------------------------------------------
def run_schedule(name: str, m: int, v: int | None, times: tuple[float, float, float], steps: int) -> dict:
    """This rank's action records for a warm-up step and `steps` timed steps of schedule `name`.
    `times` are one rank's (t_f, t_i, t_w) per microbatch; each of the `v` chunks takes 1 / v of them."""
    p, rank = dist.get_world_size(), dist.get_rank()
    core = core_schedule(name, p, m, v)
    local = [s for s in range(core.stages) if core.placement[s] == rank]
    stages = [_stage(s, core.stages, [t / core.v for t in times]) for s in local]
    records: list[tuple] = []
    for stage in stages:
        _instrument(stage, records)
    sched = make_schedule(stages, core, m, loss_fn=sum_loss)
    args = (torch.randn(m, WIDTH),) if 0 in local else ()
    target = torch.zeros(m, WIDTH) if core.stages - 1 in local else None
    out = []
    for _ in range(steps + 1):
        out.append(_timed_step(sched, stages, args, target, records))
    return {"rank": rank, "local": local, "warmup": out[0], "steps": out[1:]}


def _stage(index: int, n: int, times: list[float]) -> PipelineStage:
    example = torch.zeros(1, WIDTH, requires_grad=True)  # torch takes what needs a gradient from these
    module = WaitStage(*times)
    return PipelineStage(module, index, n, torch.device("cpu"), input_args=(example,), output_args=(example,))


def _instrument(stage: PipelineStage, records: list) -> None:
    """Record (start, end, kind, stage, microbatch) of every compute call the schedule makes on `stage`."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def timed(kind: str, fn, mb: int, *args, **kwargs):
        start = time.perf_counter()
        result = fn(mb, *args, **kwargs)
        records.append((start, time.perf_counter(), kind, stage.stage_index, mb))
        return result

    stage.forward_one_chunk = lambda mb, *a, **k: timed("F", forward, mb, *a, **k)
    stage.backward_one_chunk = lambda mb, *a, **k: timed(
        "B" if k.get("full_backward", True) else "I", backward, mb, *a, **k
    )
    stage.backward_weight_one_chunk = lambda mb, *a, **k: timed("W", weight, mb, *a, **k)


def _timed_step(sched, stages, args, target, records: list) -> list[tuple]:
    """One step after a barrier, with the garbage collector paused; this rank's records."""
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
    records.clear()
    gc.collect()
    gc.disable()
    dist.barrier()
    try:
        sched.step(*args, target=target, losses=[] if target is not None else None, return_outputs=False)
    finally:
        gc.enable()
    dist.barrier()
    for stage in stages:
        if stage.submod.weight.grad is None:
            raise RuntimeError(f"stage {stage.stage_index} has no weight gradient after the step")
    return list(records)
