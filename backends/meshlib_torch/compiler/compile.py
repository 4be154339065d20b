"""The compiler's entry for any mesh: `compile_model`, the whole plan with nothing run.

With a pipeline axis the program is one microbatch's graph cut into stages
with the schedule that runs them (`pipeline/compile.py`); else it is one graph
(`graph.py`), of one microbatch when the step accumulates gradients over
several. Either way the result is one `Compiled` that the runtime carries out.
"""

from __future__ import annotations

import dataclasses
import difflib
import math

import torch

from meshlib import CANONICAL_AXES, Mesh, Precision
from meshlib.options import Parallelism, Pipelining, gather

from ..experts.dispatch import assumed_load
from .capture.call import Call, LossSpec, bind_call
from .capture.moe import expert_modules
from .estimates.records import step_collectives
from .estimates.stepmem import accumulation_compute
from .graph import compile_graph
from .pipeline.compile import compile_pipeline
from .placement.placements import Shard
from .placement.shapes import ragged_dims
from .program import Compiled, input_layouts, shard_axes


def compile_model(
    model: torch.nn.Module,
    /,
    *,
    mesh: Mesh,
    rules,
    example_inputs: tuple | dict | Call = (),
    example_kwargs: dict | None = None,
    loss: LossSpec = None,
    estimate_memory: bool = False,
    parallelism: Parallelism | None = None,
    pipelining: Pipelining | None = None,
    **options,
) -> Compiled:
    """Compile `model` for `mesh`: no processes, no real memory (the model may be on meta).

    The model is called as `model(*example_inputs, **example_kwargs)` on the global batch
    (`example_inputs` may also be a dict of keyword inputs); its tensors are the compiled
    model's inputs, by name, and its other values are fixed. The compiled model returns the
    loss: the output itself, a dict's or `ModelOutput`'s `"loss"`, or what `loss=` picks (an
    index, key, attribute name or function of the output; see `compiler.capture.call`).

    The options are `Parallelism`'s and `Pipelining`'s (`meshlib.options`: each with its
    default and meaning), given as keywords (`zero=1, microbatches=4`) or as the values
    (`parallelism=Parallelism(zero=1)`). The data-parallel axes are those the inputs' batch dim is
    split over; the runtime sums gradients over them once per step, by ZeRO level. `estimate_memory`
    adds the dry run's peak, and what each layer keeps for backward, to the plan.
    """
    par, pipe, _ = gather(options, parallelism, pipelining, accept=(Parallelism, Pipelining))
    par = dataclasses.replace(par, precision=par.precision or _own_precision(model))
    call = example_inputs
    if not isinstance(call, Call):
        call = bind_call(model, example_inputs, example_kwargs, loss=loss)
    m = pipe.microbatches
    _check_microbatches(call, m)
    if m > 1 and par.uneven != "error":
        layouts = input_layouts(call.tensors, par.in_specs, mesh, par.replicate_axes, par.uneven, par.cp_layout)
        _check_ragged_batch(layouts, mesh, call, m)
    with assumed_load(par.expert_load):  # what a dry run's dropless experts draw
        if pipe.pp_axis in mesh and mesh.axis_size(pipe.pp_axis) > 1:
            compiled = compile_pipeline(model, call, mesh=mesh, rules=rules, options=par, pipelining=pipe,
                                        estimate_memory=estimate_memory)  # fmt: skip
        else:
            compiled = compile_graph(model, call.micro(m), mesh=mesh, rules=rules, options=par,
                                     estimate_memory=estimate_memory)  # fmt: skip
            compiled = dataclasses.replace(compiled, microbatches=m)
            compute = tuple(dataclasses.replace(c, backward=c.backward + accumulation_compute(
                compiled, compiled.traced.params, m)) for c in compiled.plan.compute)  # fmt: skip
            plan = compiled.plan.replace(collectives=tuple(step_collectives(compiled, m)), microbatches=m,
                                         compute=compute)  # fmt: skip
            compiled = dataclasses.replace(compiled, plan=plan)
    _check_axes_used(compiled, pipe.pp_axis, par.idle_axes)
    _check_fsdp_axes(compiled)
    compiled = dataclasses.replace(compiled, plan=_with_work(compiled.plan, call, m))
    notes, moe = [], bool(expert_modules(model))
    if m > 1 and moe:
        notes.append(("MoE", (
            "routing statistics, and a load-balancing loss computed from them, are each microbatch's (as "
            "Megatron-LM and torchtitan compute them), not the whole batch's as one step over it would; token "
            "counts for a balancing bias add up over the microbatches"
        )))  # fmt: skip
    if par.capacity_factor is None and moe:
        load = f"; this plan: expert_load={par.expert_load:g}" if par.expert_load != 1 else ""
        notes.append(("MoE routing", ROUTING_NOTE + load))
    if notes:
        compiled = dataclasses.replace(compiled, plan=compiled.plan.replace(notes=(*compiled.plan.notes, *notes)))
    return compiled


# what a plan cannot know of a dropless MoE layer before it runs: stated on every such plan
ROUTING_NOTE = (
    "dropless: how many tokens each expert gets is known only as the step runs, so this plan spreads them "
    "evenly over the experts (the all-to-all bytes, the experts' FLOPs and, in a dry run, their activations). "
    "A rank whose experts draw r times the mean computes, moves and holds r times that part; capacity_factor "
    "bounds r, and expert_load=r plans the memory of a rank that draws it"
)


def _with_work(plan, call: Call, m: int):
    """The plan with its step's tokens (the first input's batch x sequence, or batch) and, where the dry run
    counted what the ranks compute, the model's FLOPs: each pp coordinate's matrix-product FLOPs forward, three
    times (forward and backward), over the microbatches and every rank holding that coordinate's share (the
    other axes split the batch, the sequence, the heads and the experts between them)."""
    first = next(iter(call.tensors.values()), None)
    tokens = 0 if first is None or first.dim() == 0 else math.prod(first.shape[:2])
    ranks = plan.mesh.size // max(1, len(plan.compute))
    flops = 3 * m * ranks * sum(c.forward.matmul_flops for c in plan.compute)
    return plan.replace(tokens=int(tokens), model_flops=float(flops))


def _check_fsdp_axes(compiled: Compiled) -> None:
    """ZeRO-2/3 hand each parameter to FSDP2 over the data axes it is summed over; FSDP2 flattens those axes
    into one only where they are neighbours in the mesh (`_fsdp_param._build_spmd_sharding_spec` walks the
    mesh and replaces a consecutive run). Refuse, naming the order that works, before any process group."""
    if compiled.options.zero < 2:
        return
    names = [a for a in compiled.mesh.axis_names if compiled.mesh.axis_size(a) > 1]
    for name in compiled.traced.params:
        axes = [a for a in shard_axes(compiled, name) if a in names]
        at = [names.index(a) for a in axes]
        if at and at != list(range(at[0], at[0] + len(at))):
            between = [a for a in names[at[0] : at[-1] + 1] if a not in axes]
            order = [a for a in names if a not in axes and names.index(a) < at[0]] + axes
            order += [a for a in names if a not in order]
            raise ValueError(
                f"zero={compiled.options.zero}: parameter {name!r} is sharded over the data axes {axes}, which "
                f"{between} separates in the mesh ({', '.join(names)}); FSDP2 shards over data axes that are "
                f"neighbours in the mesh. Fix: order the mesh as {', '.join(order)} (e.g. "
                f"{','.join(f'{a}={compiled.mesh.axis_size(a)}' for a in order)})"
            )


def _check_ragged_batch(layouts: dict, mesh: Mesh, call: Call, microbatches: int) -> None:
    """A batch cut unevenly over the data axes cannot also be cut into microbatches: each rank's
    microbatch would not be the piece of the global microbatch the graph was compiled for."""
    for name, x in call.tensors.items():
        layout = layouts.get(name)
        micro = (x.shape[0] // microbatches, *x.shape[1:])
        if layout is not None and x.dim() and 0 in ragged_dims(micro, layout, mesh.axis_sizes):
            ways = math.prod(n for p, n in zip(layout, mesh.axis_sizes) if p == Shard(0))
            raise ValueError(
                f"input {name!r}: its microbatch of {micro[0]} does not divide over the {ways} data-parallel "
                f"ranks, and uneven='chunk' does not cut a batch that is also cut into {microbatches} "
                f"microbatches. Fix: make the batch a multiple of {microbatches * ways}, or use microbatches=1"
            )


def _check_axes_used(compiled: Compiled, pp_axis: str, idle_axes: tuple[str, ...]) -> None:
    """Refuse a mesh axis (of size > 1) that nothing is split over: not a data axis, no parameter's or
    input's layout shards over it, and it is not the pipeline's. Most often a typo (`tq` for `tp`)."""
    mesh = compiled.mesh
    used = set(compiled.data_axes) | ({pp_axis} if pp_axis in mesh else set())
    for layout in [*compiled.param_layouts.values(), *compiled.input_layouts.values()]:
        used |= {a for a, p in zip(mesh.axis_names, layout) if isinstance(p, Shard)}
    idle = [a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a not in used and a not in idle_axes]
    if not idle:
        return
    hints = []
    for axis in idle:
        near = difflib.get_close_matches(axis, [a for a in CANONICAL_AXES if a not in mesh], n=1, cutoff=0.3)
        hints.append(f"{axis!r} (did you mean {near[0]!r}?)" if near else repr(axis))
    used_text = ", ".join(a for a in mesh.axis_names if a in used) or "none"
    raise ValueError(
        f"mesh axis {', '.join(hints)} splits nothing: no parameter or input is sharded over it, it is not a "
        f"data-parallel or pipeline axis, so every rank along it would repeat the same work. Axes in use: "
        f"{used_text}. Fix: rename the axis, write rules that shard over it, or pass idle_axes={tuple(idle)!r} "
        f"(--idle-axes {','.join(idle)}) if pure replication is what you want"
    )


def _own_precision(model: torch.nn.Module) -> Precision:
    """Compute, reduce and output in the model's own dtype."""
    own = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Precision(own, own, own)


def _check_microbatches(call: Call, microbatches: int) -> None:
    """Every tensor input splits along dim 0 into `microbatches` equal parts."""
    batches = {n: x.shape[0] if x.dim() else None for n, x in call.tensors.items()}
    batch = next(iter(batches.values()))
    if microbatches != 1 and any(b != batch for b in batches.values()):
        raise ValueError(
            f"the inputs' batch sizes differ ({batches}); microbatches split every input along dim 0. "
            "Fix: give every tensor input the batch as its first dim"
        )
    if microbatches > 1 and (batch is None or batch % microbatches):
        raise ValueError(
            f"the batch of {batch} does not split into {microbatches} microbatches. Fix: make the batch a "
            f"multiple of the microbatch count, or pick a count that divides {batch}"
        )


__all__ = ["compile_model"]
