"""A compiled plan's step as a `Workload`, and its predicted time: `predict_plan(plan, profile)`.

The plan holds what each rank computes (its dry run's count, `Plan.compute`, per pipeline coordinate and
microbatch) and every collective with its bytes, phase and count per step. They become a `Workload` as
meshlib's runtime runs them:

- a collective of the graph (tensor parallelism, the loss, a region's own: the ring's hops, the experts'
  all-to-alls) runs once per microbatch, in its phase; the ring's hops travel behind their blocks;
- the gradient sync runs as backward frees the gradients (per-parameter hooks; FSDP2's reduce-scatters
  under ZeRO-2/3): behind the last microbatch's backward. ZeRO-2/3's parameter gathers are prefetched
  (FSDP2): behind the step's compute. ZeRO-1's reduce-scatters run behind the last microbatch's
  backward too, but in the optimizer step after a pipeline's schedule (the record's phase says which),
  and its gather of the updated shards follows the update. FSDP2 moves a unit's parameters (a layer's;
  the rest of the model is one more unit) in one collective over a flat buffer: the plan lists each
  parameter's bytes, the time model pays one call per unit (`fsdp_unit`);
- a pipeline's activations and their gradients cross each stage boundary once per microbatch.

Example:
    >>> from meshlib import Mesh, Plan, Precision, Collective, A100
    >>> from meshlib.workload import Compute, StageCompute
    >>> sc = StageCompute(forward=Compute(((1e12, 0.0, 1),)), backward=Compute(((1e12, 0.0, 2),)))
    >>> sync = Collective("all_reduce", ("dp",), 10**9, op="grad sync", phase="backward", group=8)
    >>> plan = Plan(Mesh(dp=8), collectives=(sync,), compute=(sc,), model_flops=24e12, tokens=8192,
    ...             precision=Precision.parse("bf16"))
    >>> w = workload_of(plan)
    >>> w.stages[0].step_comm[0].overlap
    'backward'
    >>> p = predict_plan(plan, A100)  # 3 TFLOP of matrix products; the all-reduce runs behind the backward
    >>> p.compute > 10 * p.comm, p.step_time == p.compute + p.comm + p.bubble + p.optimizer
    (True, True)
"""

from __future__ import annotations

from .devices import DeviceProfile, device_profile
from .plan import Plan
from .predict import Prediction, predict
from .workload import Comm, Compute, StageWork, Workload

__all__ = ["predict_plan", "workload_of"]

# the records of the data-parallel traffic (`meshlib_torch.compiler.estimates.records`)
GRAD_SYNC, PARAM_GATHER = "grad sync", "param gather"


def fsdp_unit(name: str) -> str:
    """The FSDP2 unit a parameter's ZeRO-2/3 traffic moves in: its layer (the path up to the first index,
    `layers.3` of `layers.3.attention.wq.weight`), or the root unit for parameters outside the layers."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _per_unit(comms: list[Comm], units: list[str | None]) -> list[Comm]:
    """FSDP2's collectives (`units[i]` not None) merged into one per unit, kind, axes, phase and count."""
    out, merged = [], {}
    for c, unit in zip(comms, units):
        if unit is None:
            out.append(c)
            continue
        key = (unit, c.kind, c.axes, c.phase, c.count, c.overlap)
        if key in merged:
            i = merged[key]
            out[i] = Comm(c.kind, c.axes, out[i].bytes + c.bytes, c.phase, c.count, c.overlap)
        else:
            merged[key] = len(out)
            out.append(c)
    return out


def workload_of(plan: Plan) -> Workload:
    """`plan`'s step as a `Workload`; the plan needs its dry run's compute (`estimate_memory=True`)."""
    if not plan.compute:
        raise ValueError(
            "this plan has no count of what its ranks compute: compile it with estimate_memory=True (meshlib plan "
            "--profile does), which runs its step on meta tensors and counts every op"
        )
    m = max(1, plan.microbatches)
    stages = tuple(_stage(plan, r, m) for r in range(len(plan.compute)))
    pp = len(plan.compute) if plan.stages else 1
    chunks = max(1, len(plan.stages) // pp) if plan.stages else 1
    return Workload(
        mesh=plan.mesh, stages=stages, tokens=plan.tokens, model_flops=plan.model_flops, dtype=plan.precision.param,
        schedule=plan.schedule if plan.stages else "", microbatches=m, chunks=chunks, pp_axis=plan.pp_axis or "pp",
    )  # fmt: skip


def predict_plan(plan: Plan, profile: DeviceProfile | str, *, simulate_pipeline: bool = True) -> Prediction:
    """The predicted step of `plan` on devices of `profile` (a `DeviceProfile`, or a name or path for
    `meshlib.device_profile`)."""
    return predict(workload_of(plan), device_profile(profile), simulate_pipeline=simulate_pipeline)


def _stage(plan: Plan, r: int, m: int) -> StageWork:
    staged = bool(plan.stages)
    work = plan.compute[r]
    per, step, units = [], [], []
    for c in plan.rank_collectives(r if staged else None):
        if staged and c.kind == "send_recv" and c.axes == (plan.pp_axis,):
            continue  # the boundary's activations: the pipeline's sends (`send`)
        if c.op in (GRAD_SYNC, PARAM_GATHER):
            overlap = "backward" if c.op == GRAD_SYNC else ("forward" if c.phase != "optimizer" else "none")
            if c.reason.startswith("zero-1") and c.phase != "backward":  # in the optimizer step, after backward
                overlap = "none"
            if staged and c.op == GRAD_SYNC:  # after a stage's last backward (FSDP2) or the schedule (buckets)
                overlap = "none"
            step.append(Comm(c.kind, c.axes, c.bytes, c.phase, c.count, overlap))
            fsdp = c.reason in ("zero-2", "zero-3") and c.kind in ("all_gather", "reduce_scatter")
            units.append(fsdp_unit(c.node) if fsdp else None)
        elif c.phase == "step":
            step.append(Comm(c.kind, c.axes, c.bytes, c.phase, c.count))
            units.append(None)
        else:
            overlap = "compute" if c.op.startswith("lax.ppermute") else "none"
            per.append(Comm(c.kind, c.axes, c.bytes, c.phase, c.count / m, overlap))
    sends = [_sent(plan, s) for s in plan.stages if s.rank == r]
    backward = work.backward if work.weight is None else work.backward + work.weight
    mem = plan.rank_memory(r if staged else None)
    return StageWork(
        forward=work.forward, backward=backward, recompute=work.recompute, weight=work.weight, comm=tuple(per),
        send=max(sends, default=0.0), step_comm=tuple(_per_unit(step, units)), optimizer=work.optimizer or Compute(),
        memory=mem.peak if mem is not None else 0,
    )  # fmt: skip


def _sent(plan, stage) -> float:
    """Bytes `stage` sends its neighbours per microbatch, the larger way: its activations forward, or the
    gradient of what it received backward (the last stage sends only that)."""
    ahead = sum(b.bytes for b in stage.sends)
    before = [s for s in plan.stages if s.index == stage.index - 1]
    back = sum(b.bytes for b in before[0].sends if b.grad) if before else 0
    return float(max(ahead, back))
