"""Pass 8, pipeline: one microbatch's program cut into stages, the schedule that runs them, and the plan.

`compile_pipeline` compiles the graph of one global microbatch, balances its
layers over `p * v` stages (`costs`), cuts the graph into one graph per stage
(`stages`) and puts the stages, what crosses each boundary per microbatch and
the schedule into the plan. A model neither fx nor torch.export can trace is
cut by module FQN on the eager model instead (`fqn_split`: `EagerStages`, and a
`Compiled` without a graph), its cost from a run of a meta copy; the plan's
notes say so, with both reasons. Nothing here runs on values or needs a process.
"""

from __future__ import annotations

from torch import nn

from meshlib import Collective, Stage
from meshlib import schedule as core_schedule
from meshlib.schedules import resolve_schedule

from .call import Call
from .costs import graph_costs, layer_costs, stage_ranges
from .fqn_split import split_eager
from .graph import compile_graph
from .program import Compiled, Options
from .split import layer_paths
from .stages import build_stages
from .trace import Untraceable

GATHERED = (
    "each stage's parameters are all-gathered at its first microbatch and kept until the step's last backward "
    "(one all-gather per step, not one per microbatch, as torchtitan does; zero-bubble schedules need it): "
    "sharded between steps, gathered within one as under ZeRO-2"
)


def compile_pipeline(
    model: nn.Module, call: Call, /, *, mesh, rules, options: Options, in_specs=None, sequence_parallel: bool = False,
    microbatches: int, schedule: str = "1f1b", chunks: int | None = None, pp_axis: str = "pp", split_points=None,
    balance: str = "flops", estimate_memory: bool = False,
) -> Compiled:  # fmt: skip
    """The program of a mesh with a pipeline axis: `call` is the global batch's (see `compile_model`)."""
    name, v = resolve_schedule(schedule, chunks)
    p = mesh.axis_size(pp_axis)
    core = core_schedule(name, p, microbatches, v)  # checks p, m and v before any communication
    micro = call.micro(microbatches)
    layers = layer_paths(model)
    try:
        compiled = compile_graph(
            model, micro, mesh=mesh, rules=rules, options=options, in_specs=in_specs,
            sequence_parallel=sequence_parallel, estimate_memory=estimate_memory, count_flops=balance == "flops",
        )  # fmt: skip
    except Untraceable as reason:
        costs = layer_costs(model, layers, micro, by=balance)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points)
        compiled, stages = split_eager(
            model, reason=reason, mesh=mesh, call=micro, layers=layers, ranges=ranges, costs=costs,
            in_specs=in_specs, zero=options.zero, precision=options.precision, recompute=options.recompute,
            sequence_parallel=sequence_parallel, pp_axis=pp_axis, microbatches=microbatches,
        )  # fmt: skip
        split = "by module FQN on the eager model"
    else:
        costs = graph_costs(compiled, model, layers, by=balance)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points)
        stages = build_stages(
            compiled.graph, compiled.parts, ranges, len(layers), compiled.axes, compiled.plans, compiled.comms,
            compiled.input_layouts,
        )
        split = f"by layer FQN on the {compiled.traced.path} graph"
    stages.costs = costs.of(ranges)
    stages.balance = balance if split_points is None else "user split points"
    compiled.plan = _plan_with_stages(compiled.plan, stages, core, layers, microbatches, pp_axis, split)
    if options.zero == 3:
        compiled.plan = compiled.plan.replace(notes=compiled.plan.notes + (("ZeRO-3 in stages", GATHERED),))
    compiled.stages, compiled.schedule, compiled.microbatches, compiled.pp_axis = stages, core, microbatches, pp_axis
    return compiled


def _plan_with_stages(plan, stages, core, layers: list[str], m: int, pp_axis: str, split: str):
    """The plan's stages (layers, cost, what each sends per microbatch) and its pipeline traffic."""
    records = []
    out = []
    for s, ((a, b), sends) in enumerate(zip(stages.layers, stages.sends)):
        mods = tuple(layers[a:b])
        out.append(Stage(s, core.placement[s], mods, stages.costs[s] if stages.costs else 0.0, tuple(sends)))
        if s + 1 < len(core.placement) and core.placement[s] == core.placement[s + 1]:
            continue  # the next stage is on this rank (the V's turn): torch hands the tensors over, no send
        for bnd in sends:
            records.append(
                Collective(
                    "send_recv", (pp_axis,), bnd.bytes, bnd.name, "pipeline", "", f"stage {s} -> {s + 1}",
                    "forward", m, 2,
                )
            )  # fmt: skip
            if bnd.grad:
                records.append(
                    Collective(
                        "send_recv", (pp_axis,), bnd.bytes, bnd.name, "pipeline", "", f"stage {s + 1} -> {s}",
                        "backward", m, 2,
                    )
                )  # fmt: skip
    notes = dict(plan.notes) | {"stage split": f"{split}, balanced by {stages.balance}"}
    return plan.replace(
        stages=tuple(out),
        schedule=core.name,
        microbatches=m,
        collectives=plan.collectives + tuple(records),
        notes=tuple(notes.items()),
    )



__all__ = ["compile_pipeline"]
