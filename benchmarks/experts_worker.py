"""The rank-side jobs of the expert-parallel benchmark (run by bench_experts.py through a RankPool, not by hand).

Each function runs on every rank of a gloo `RankPool` and returns plain data:

- `counted`: one training step of `tests/moe_models.build_balanced` (moe-tiny-ds, fp64, every router's
  choices fixed and even) after two warm-up steps (`testing.measure.measure_step`), with the bytes
  `COUNTER` counted on this rank by (phase, op) and the plan's own records for this rank.
- `race`: the same MoE model parallelized twice on the same 4 ranks, experts over `ep` and experts
  replicated on `dp`, from the same initial values; checks both take the same first step, then times
  them alternately.

They live in their own module because a RankPool job pickles by qualified name.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from zero_worker import _timed  # the same timer as the ZeRO race

from meshlib import Mesh
from meshlib_torch import COUNTER, data, models, parallelize
from meshlib_torch.testing.measure import measure_step


# -- part 1: what each rank counts -----------------------------------------------------------------
def counted(trial) -> dict:
    """This rank's counted bytes of one step by (phase, op), and the plan's records of its kinds, with each
    op named as the counter names it (`all_to_all_v`, not the plan's `lax.all_to_all_v`)."""
    result = measure_step(trial)  # COUNTER keeps the counted (third) step until the next reset
    by_op: dict = defaultdict(int)
    for (phase, _kind, _axis, where), nbytes in COUNTER.by_source.items():
        by_op[(phase, where.split("@", 1)[0])] += nbytes
    plan = result["plan"]
    planned = [(c.phase, c.op.removeprefix("lax."), c.total_bytes, c.bus_bytes) for c in plan.collectives
               if c.kind in KINDS]  # fmt: skip
    return {"rank": result["rank"], "coords": result["coords"], "counted": dict(by_op), "planned": planned}


KINDS = ("all_to_all", "host_sync")


# -- part 2: step time, experts over ep against experts replicated on dp --------------------------------
def _init(cfg):
    cls = models.model_class(cfg)
    return lambda name: cls.param_init(name, cfg)


def _build(cfg, mesh: str, example):
    m = Mesh.parse(mesh)
    return parallelize(models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=example,
                       init=_init(cfg))  # fmt: skip


def race(model: str, overrides: dict, meshes: tuple[str, str], batch: int, seq: int, rounds: int, steps: int) -> dict:
    """Both meshes' first two losses, then `rounds` rounds of `steps` timed steps of each, alternated
    (A B, then B A, ...)."""
    torch.use_deterministic_algorithms(False)  # as under plain torchrun; the same for both sides
    cfg = models.config(model, **overrides)
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(4)]
    pars = {mesh: _build(cfg, mesh, batches[0]) for mesh in meshes}
    opts = {mesh: par.optimizer(lr=1e-3) for mesh, par in pars.items()}
    steps_of = {mesh: (lambda b, m=mesh: pars[m].train_step(batches[b], opts[m])) for mesh in meshes}
    losses = {mesh: [float(fn(0)), float(fn(1))] for mesh, fn in steps_of.items()}
    times: dict = {mesh: [] for mesh in meshes}
    for r in range(rounds):
        for mesh in meshes if r % 2 == 0 else meshes[::-1]:
            times[mesh].append(_timed(steps_of[mesh], steps, range(len(batches))))
    params = dict(models.build(cfg).named_parameters())
    experts = sum(p.numel() for n, p in params.items() if n.endswith(("gate_up_proj", "down_proj")))
    total = sum(p.numel() for p in params.values())
    return {"losses": losses, "times": times, "experts": experts, "params": total}
