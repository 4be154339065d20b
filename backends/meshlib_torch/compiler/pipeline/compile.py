"""Pipeline: one microbatch's program cut into stages, the schedule that runs them, and the plan.

`compile_pipeline` compiles the graph of one global microbatch, balances its
layers over `p * v` stages (`costs`), cuts the graph into one graph per stage
(`stages`) and puts the stages, what crosses each boundary per microbatch and
the schedule into the plan. A model neither fx nor torch.export can trace is
cut by module FQN on the eager model instead (`fqn_split`: `EagerStages`, and a
`Compiled` without a graph), its cost from a run of a meta copy; the plan's
notes say so, with both reasons. Nothing here runs on values or needs a process.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from meshlib import Collective, Compute, Memory, Stage, StageCompute
from meshlib import schedule as core_schedule
from meshlib.options import Parallelism, Pipelining
from meshlib.schedules import resolve_schedule

from ..capture.blocks import layer_paths
from ..capture.call import Call
from ..capture.trace import Untraceable
from ..estimates.dryrun import stage_peaks
from ..estimates.records import dp_collectives, graph_collectives
from ..estimates.stepmem import accumulation_compute, optimizer_compute
from ..graph import compile_graph
from ..program import Compiled, EagerStages, TracedStages, fsdp_whole, model_state
from .costs import graph_costs, layer_costs, stage_ranges
from .fqn_split import split_eager
from .stages import build_stages, param_holders, rank_params

GATHERED = (
    "each stage's parameters are all-gathered at its first microbatch and kept until the step's last backward "
    "(one all-gather per step, not one per microbatch, as torchtitan does; zero-bubble schedules need it): "
    "sharded between steps, gathered within one as under ZeRO-2"
)


def compile_pipeline(
    model: nn.Module, call: Call, /, *, mesh, rules, options: Parallelism, pipelining: Pipelining,
    estimate_memory: bool = False,
) -> Compiled:  # fmt: skip
    """The program of a mesh with a pipeline axis: `call` is the global batch's (see `compile_model`)."""
    microbatches, pp_axis, balance, split_points = (
        pipelining.microbatches, pipelining.pp_axis, pipelining.balance, pipelining.split_points
    )
    name, v = resolve_schedule(pipelining.schedule, pipelining.chunks)
    p = mesh.axis_size(pp_axis)
    core = core_schedule(name, p, microbatches, v)  # checks p, m and v before any communication
    _check_recompute(core, options.recompute)
    micro = call.micro(microbatches)
    layers = layer_paths(model)
    by = "params" if balance == "params" else "flops"  # "layers" splits evenly; its stages' costs in FLOPs
    try:
        compiled = compile_graph(
            model, micro, mesh=mesh, rules=rules, options=options, estimate_kept=estimate_memory,
            count_flops=balance != "params",
        )  # fmt: skip
    except Untraceable as reason:
        costs = layer_costs(model, layers, micro, by=by)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points, even=balance == "layers")
        compiled, stages = split_eager(
            model, reason=reason, mesh=mesh, call=micro, layers=layers, ranges=ranges, costs=costs, options=options,
            pp_axis=pp_axis, microbatches=microbatches,
        )  # fmt: skip
        split, eager = "by module FQN on the eager model", True
    else:
        costs = graph_costs(compiled, model, layers, by=by)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points, even=balance == "layers")
        stages = build_stages(
            compiled.graph, compiled.parts, ranges, len(layers), compiled.axes, compiled.plans, compiled.comms,
            compiled.input_layouts,
        )
        split, eager = f"by layer FQN on the {compiled.traced.path} graph", False
    stages.costs = costs.of(ranges)
    stages.balance = balance if split_points is None else "user split points"
    program = EagerStages(stages, core) if eager else TracedStages(compiled.graph, stages, core)
    compiled = dataclasses.replace(compiled, program=program, microbatches=microbatches, pp_axis=pp_axis)
    plan = _plan_with_stages(compiled, stages, core, layers, microbatches, pp_axis, split, estimate_memory)
    if options.zero == 3:
        plan = plan.replace(notes=plan.notes + (("ZeRO-3 in stages", GATHERED),))
    return dataclasses.replace(compiled, plan=plan)


def _check_recompute(core, recompute: str) -> None:
    """A zero-bubble schedule splits each backward into an input-gradient and a weight-gradient pass,
    and torch's weight pass is one autograd call per group of weights: each call recomputes every
    checkpointed layer again (checkpoint recomputes once per backward call), so recompute would run
    a layer's forward, collectives included, an unknowable number of times."""
    if recompute != "none" and any(a.kind in ("I", "W") for row in core.actions for a in row):
        raise ValueError(
            f"recompute={recompute!r} with the {core.name} schedule: its split backward recomputes every "
            "checkpointed layer once per group of weights, not once. Fix: use recompute='none' with a "
            "zero-bubble schedule, or recompute with gpipe, 1f1b or interleaved-1f1b"
        )


def torch_refuses(core, m: int) -> str | None:
    """Why torch's pipelining would refuse to run the core schedule `core` with `m` microbatches, with the
    fix; None where it runs it."""
    stages = len(core.placement)
    if core.name == "1f1b" and m < stages:
        return (
            f"schedule '1f1b' with {m} microbatch(es) on {stages} pipeline stages: torch's Schedule1F1B needs at "
            f"least as many microbatches as stages. Fix: microbatches={stages} or more, or schedule='gpipe' (the "
            "same order when there are fewer microbatches than stages)"
        )
    return None


def _plan_with_stages(compiled, stages, core, layers: list[str], m: int, pp_axis: str, split: str, estimate: bool):
    """The plan's stages (layers, cost, what each sends per microbatch) and its collectives per rank
    per step: each with the pp coordinate of the ranks that run it (`stage_collectives`)."""
    plan = compiled.plan
    out = []
    for s, ((a, b), sends) in enumerate(zip(stages.layers, stages.sends)):
        mods = tuple(layers[a:b])
        out.append(Stage(s, core.placement[s], mods, stages.costs[s] if stages.costs else 0.0, tuple(sends)))
    notes = dict(plan.notes) | {"stage split": f"{split}, balanced by {stages.balance}"}
    if (refused := torch_refuses(core, m)) is not None:
        notes["schedule"] = f"{refused}. This plan does not run: parallelize refuses it"
    memory, compute = stage_memory(compiled, stages, core, estimate)
    return plan.replace(
        stages=tuple(out), schedule=core.name, microbatches=m, pp_axis=pp_axis, notes=tuple(notes.items()),
        collectives=tuple(stage_collectives(compiled, stages, core, m, pp_axis)), stage_memory=memory,
        memory=max(memory, key=lambda mem: (mem.peak, mem.params + mem.grads + mem.optimizer)), compute=compute,
    )  # fmt: skip


def stage_memory(compiled, stages, core, estimate: bool = False) -> tuple[tuple[Memory, ...], tuple]:
    """The memory of the ranks at each pp coordinate: the model state of the parameters their stages
    hold, and with `estimate` the dry run's peak of their part of the schedule (`dryrun.stage_peaks`) and
    what they compute per microbatch (their stages' passes together) and per step (the optimizer)."""
    placed = rank_params(stages, core.placement)
    out = [model_state(compiled, held) for held in placed]
    if not (estimate and isinstance(compiled.program, TracedStages)):
        return tuple(out), ()
    held = [m.params + m.optimizer for m in out]
    grads = [model_state(compiled, names).grads for names in stages.params]
    peaks, per_stage = stage_peaks(compiled, core, held, grads)
    states = [m.params + m.grads + m.optimizer for m in out]
    out = [dataclasses.replace(m, activations=p - s, peak=p) for m, s, p in zip(out, states, peaks)]
    compute = []
    for r, names in enumerate(placed):
        mine = [c for c, rank in zip(per_stage, core.placement) if rank == r]
        weights = [c.weight for c in mine if c.weight is not None]
        added = accumulation_compute(compiled, names, core.m)  # in the weight pass where it runs apart
        compute.append(StageCompute(
            sum((c.forward for c in mine), Compute()), sum((c.backward for c in mine), Compute()) + (
                Compute() if weights else added),
            sum((c.recompute for c in mine), Compute()), sum(weights, added) if weights else None,
            optimizer_compute(compiled, names),
        ))  # fmt: skip
    return tuple(out), tuple(compute)


def stage_collectives(compiled, stages, core, m: int, pp_axis: str) -> list[Collective]:
    """What the ranks at each pp coordinate run in one step of `m` microbatches.

    A stage's own collectives (tensor parallelism, the loss) run once per microbatch. Each pp
    rank syncs over the data axes the gradients of the parameters its stages hold, once per step
    (ZeRO-2/3 gather them once per step too: a stage keeps them gathered through the step).
    A parameter stages on several pp ranks hold is summed between them over `pp_axis`. Every
    boundary is sent by the rank before it in forward and by the rank after it in backward, and
    the last stage broadcasts the step's loss to every pp rank."""
    place = core.placement
    out: list[Collective] = []
    if isinstance(compiled.program, TracedStages):
        for s, graph in enumerate(stages.graphs):
            mods = {n.target for n in graph.nodes if n.op == "call_module"}
            comms = [c for c in compiled.comms if c.name in mods]
            specials = [c for c in compiled.specials if c.name in mods]
            out += graph_collectives(comms, specials, compiled.axes, count=m, pp_rank=place[s], remat=compiled.remat)
    else:  # the eager stages' one collective: the loss's mean over the data axes, on the last stage
        out += [dataclasses.replace(c, pp_rank=place[-1]) for c in compiled.plan.collectives if c.op == "loss"]
    held = rank_params(stages, place)
    holders = param_holders(stages, place)
    opts = compiled.options
    zero = 2 if opts.zero == 3 else opts.zero  # kept gathered from the first microbatch to the last
    whole = fsdp_whole(compiled) if zero >= 2 else set()
    for r, names in enumerate(held):
        out += dp_collectives(
            compiled.traced, compiled.param_layouts, compiled.axes, compiled.data_axes,
            opts, compiled.synced_params, names=names, pp_rank=r, whole=whole, level=zero,
            scatter_phase="optimizer",  # ZeRO-1's, after the schedule (`program.zero1_in_backward`)
        )  # fmt: skip
        for name in sorted(n for n in names if len(holders[n]) > 1):
            nbytes = math.prod(compiled.local_param_shape(name)) * getattr(torch, opts.precision.param).itemsize
            why = f"tied between pp ranks {sorted(holders[name])}"
            out.append(
                Collective(
                    "all_reduce", (pp_axis,), nbytes, name, "tied gradient", "", why, "backward", 1,
                    len(holders[name]), name, r,
                )
            )  # fmt: skip
        out.append(Collective("broadcast", (pp_axis,), 8, "loss", "loss", "", "the step's loss", "step", 1, 2, "", r))
    for s, sends in enumerate(stages.sends):
        if s + 1 >= len(place) or place[s] == place[s + 1]:
            continue  # the next stage is on this rank (the V's turn): torch hands the tensors over, no send
        for bnd in sends:
            ways = [(f"stage {s} -> {s + 1}", "forward", place[s])]
            ways += [(f"stage {s + 1} -> {s}", "backward", place[s + 1])] if bnd.grad else []
            out += [
                Collective("send_recv", (pp_axis,), bnd.bytes, bnd.name, "pipeline", "", why, phase, m, 2, "", r)
                for why, phase, r in ways
            ]
    return out


__all__ = ["compile_pipeline", "stage_collectives", "stage_memory", "torch_refuses"]
