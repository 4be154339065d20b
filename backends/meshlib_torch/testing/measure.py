"""What one training step moves and holds on each rank, to set beside the plan's figures.

`measure_step(run)` runs on every rank, for a bundled model's `RunConfig` or any
model's `reference.Trial`: two steps (the first makes the optimizer state), then a
third counted by `COUNTER`; it returns this rank's bytes per
(phase, kind, axis) and its model state (parameters, gradients after backward,
optimizer state). `planned(plan, coords)` is what the plan says for a rank at
those mesh coordinates. The two must be equal on every rank.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from ..runtime.comm import COUNTER
from ..runtime.memory import model_state_bytes
from .parity import RunConfig, batch_of, build_parallel
from .reference import Trial, parallelize_trial


def measure_step(run: RunConfig | Trial) -> dict:
    """This rank's collective bytes in one step, by (phase, kind, axis), and its model-state bytes."""
    if isinstance(run, Trial):
        par = parallelize_trial(run)
        opt, batch = run.make_optimizer(par.optimizer), run.batch
    else:
        par = build_parallel(run)
        opt, batch = par.optimizer(lr=run.lr), functools.partial(batch_of, run)
    for step in range(2):
        par.train_step(batch(step), opt)
    COUNTER.reset()
    grads = {}
    step = opt.step

    def counted_step(*args, **kwargs):  # the gradients as they are when the update starts
        grads.update(model_state_bytes(par, opt))
        return step(*args, **kwargs)

    opt.step = counted_step
    par.train_step(batch(2), opt)
    opt.step = step
    comm = dict(COUNTER.by_kind)
    state = model_state_bytes(par, opt) | {"grads": grads["grads"]}
    rank = torch.distributed.get_rank()
    return {"rank": rank, "coords": par.compiled.mesh.coords(rank), "comm": comm, "state": state, "plan": par.plan}


def planned(plan, coords: dict) -> dict:
    """The plan's bytes per (phase, kind, axis) on the rank at `coords`, and its model state there."""
    pp = coords.get(plan.pp_axis, 0) if plan.stages else None
    comm: dict = defaultdict(int)
    for c in plan.rank_collectives(pp):
        comm[(c.phase, c.kind, "_".join(c.axes))] += c.total_bytes
    mem = plan.rank_memory(pp)
    return {"comm": dict(comm), "state": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}}


__all__ = ["measure_step", "planned"]
