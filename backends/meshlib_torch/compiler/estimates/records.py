"""Records: the plan's collectives, with the bytes each moves per rank and where it comes from.

Three sources: the collectives `redistribute` inserted, those inside the
rank-dependent ops (the vocab-parallel loss's all-reduces), and the gradient
sync over the data-parallel axes that the runtime runs once per step, by ZeRO
level (`dp_sync_steps`). The plan's notes say which tracer ran, what meshlib
fixed in the call, which ops run whole on every rank and which draw random
numbers.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from meshlib import Collective, Plan
from meshlib.options import Parallelism

from ...torch_private import OpOverload
from ..buckets import grad_buckets
from ..capture.source import source_line
from ..capture.trace import Traced
from ..placement.placements import sync_axes, zero1_split
from ..placement.propagate import Axes
from ..placement.rank_ops import RANK_OPS
from ..placement.redistribute import RERUN, collective_records
from ..placement.shapes import local_shape, ragged_dims
from ..program import deferred_loss, fsdp_whole


def graph_collectives(
    comms, specials, axes: Axes, *, count: int = 1, pp_rank: int = -1, remat=None
) -> list[Collective]:
    """The collectives of one run of a graph holding `comms` and `specials`, `count` runs per step
    (a microbatch each) on the ranks at pp coordinate `pp_rank`; `remat`: what recompute and
    backward run again (`saved.remat_of`)."""
    records = collective_records(comms, axes, remat)
    for spec in specials:  # rank-dependent ops': a region a recomputed layer runs again moves its forward again
        mine = RANK_OPS[spec.kind].records(spec, axes)
        again = remat is not None and spec.name in remat.rerun
        records += mine + [dict(r, phase="recompute", reason=f"{r['reason']} ({RERUN})")
                           for r in mine if again and r["phase"] == "forward"]  # fmt: skip
    return [
        Collective(
            r["kind"], r["axes"], r["bytes"], r["node"], r["op"], r["source"], r["reason"], r["phase"], count,
            r["group"], r.get("consumer", ""), pp_rank,
        )
        for r in records
    ]  # fmt: skip


def step_collectives(compiled, m: int) -> list[Collective]:
    """A program without a pipeline: its collectives per rank in one step of `m` microbatches
    (gradient accumulation). The graph's run once per microbatch, the loss's sum over the data axes
    in the output dtype (the runtime runs it on the loss it returns); the gradients are synced once,
    and ZeRO-2/3 gather the parameters again for every microbatch (FSDP2 reshards after backward)."""
    out = graph_collectives(compiled.comms, compiled.specials, compiled.axes, count=m, remat=compiled.remat)
    deferred = deferred_loss(compiled)
    if deferred is not None:
        spec, _ = deferred
        nbytes = getattr(torch, compiled.options.precision.output).itemsize
        out = [
            dataclasses.replace(c, bytes=nbytes) if (c.node, c.consumer) == (spec.producer, spec.consumer) else c
            for c in out
        ]
    whole = fsdp_whole(compiled) if compiled.options.zero >= 2 else set()
    return out + dp_collectives(
        compiled.traced, compiled.param_layouts, compiled.axes, compiled.data_axes, compiled.options,
        compiled.synced_params, gathers=m, whole=whole,
    )  # fmt: skip


def plan_of(mesh, specs, comms, specials, axes, traced, groups, plans, sp, layouts) -> Plan:
    """The plan of one graph, without its collectives: those are a step's, which `step_collectives`
    (one graph) or `pipeline.stage_collectives` (its stages) count once the program is whole."""
    notes = {"trace": traced.path}
    for name in traced.call.chosen:
        notes[f"{name} (set by meshlib)"] = repr(traced.call.constants[name])
    if traced.reason:
        notes["trace fallback reason"] = traced.reason
    if groups:
        notes["fused projections"] = ", ".join(f"{n} ({k} parts)" for n, (_, k) in sorted(groups.items()))
    fallback = [node for node, p in plans.items() if p.replicated_fallback]
    if fallback:
        notes["ops run whole on every rank (no rule)"] = "\n".join(
            f"{node.name} ({op_name(node.target)}) at {source_line(node) or 'an unknown line'}" for node in fallback
        )
    random = [node for node, p in plans.items() if _is_random(p.view)]
    if random:
        notes[RANDOM_NOTE] = (
            f"{len(random)} ({', '.join(sorted({op_name(n.target) for n in random}))}): every rank seeds torch's "
            "generator alike, so ranks holding the same values draw the same numbers"
        )
    notes["sequence parallel"] = "on" if sp else "off"
    placements = {n: tuple(repr(p) for p in layouts[n]) for n in specs}
    return Plan(mesh, specs=specs, notes=notes, placements=placements)


RANDOM_NOTE = "random ops"


_RANDOM = re.compile(r"rand|bernoulli|normal|multinomial|dropout")


def _is_random(view) -> bool:
    """Dropout that drops (p > 0, training), or any op that draws random numbers."""
    if view.kind == "dropout":
        return bool(view.p.get("p")) and view.p.get("training") is not False
    if view.kind == "sdpa":
        return bool(view.p.get("dropout_p"))
    return view.node.op == "call_function" and bool(_RANDOM.search(op_name(view.node.target)))


def op_name(target) -> str:
    """`aten.cumsum.default`, `torch.special.erfcx`, `Tensor.foo`: how a node's target reads in a plan."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    if isinstance(target, OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    module = {"torch._C._special": "torch.special", "torch._C._nn": "torch.nn.functional"}.get(module, module)
    return f"{module}.{getattr(target, '__name__', target)}".lstrip(".")


def with_data_parallel(plan: Plan, data: tuple[str, ...], options: Parallelism) -> Plan:
    """The plan's data-parallel axes, zero level, precision and recompute (the gradient sync itself
    is a step's collectives: `dp_collectives`)."""
    notes = dict(plan.notes) | {"data-parallel axes": ",".join(data) or "-"}
    if options.replicate_axes:
        notes["hsdp replicate axes"] = ",".join(options.replicate_axes)
    return plan.replace(
        zero=options.zero,
        precision=options.precision,
        recompute=options.recompute,
        notes=tuple(notes.items()),
        uneven=options.uneven,
    )


GRAD_SYNC, PARAM_GATHER = "grad sync", "param gather"  # ZeRO-2/3 gather parameters before use


def dp_collectives(
    traced: Traced, layouts, axes: Axes, data: tuple[str, ...], options: Parallelism, synced, *,
    names=None, pp_rank: int = -1, gathers: int = 1, whole=frozenset(), level: int | None = None,
    scatter_phase: str = "backward",
) -> list[Collective]:  # fmt: skip
    """The data-parallel traffic of one step for the parameters in `names` (all by default), on the
    ranks at pp coordinate `pp_rank`; ZeRO-2/3's parameter all-gathers happen `gathers` times, and
    the gradients of what FSDP2 leaves `whole` are all-reduced. `level`: the ZeRO level whose
    traffic it is, when not the plan's (ZeRO-3 in pipeline stages moves as ZeRO-2 does). `scatter_phase`:
    where ZeRO-1's reduce-scatters run (`program.zero1_in_backward`): "backward", or "optimizer" (the step,
    after a pipeline's schedule)."""
    records, bucketed, pieces = [], [], []
    sizes = dict(zip(axes.names, axes.sizes))
    param_b, reduce_b = (
        torch.empty((), dtype=getattr(torch, d)).element_size()
        for d in (options.precision.param, options.precision.reduce)
    )
    for name, p in traced.params.items():
        if name not in synced or (names is not None and name not in names):
            continue  # its gradient is already whole (computed on activations gathered over the data axes)
        local = local_shape(tuple(p.shape), layouts[name], axes.sizes)
        summed = sync_axes(layouts[name], axes.names, data)  # an expert weight: not over ep
        shard = tuple(a for a in summed if a not in options.replicate_axes)
        n_shard = math.prod(sizes[a] for a in shard)
        zero = 0 if name in whole else options.zero if level is None else level
        in_buckets = zero == 0  # `GradSync`'s (ZeRO-1 all-reduces what it cannot split in its optimizer)
        numel = math.prod(local)
        if zero == 1 and n_shard > 1:
            ragged = ragged_dims(tuple(p.shape), layouts[name], axes.sizes)
            split = zero1_split(local, n_shard, layouts[name], ragged, len(shard))
            if split is None:
                zero = 0  # kept whole: its gradient is all-reduced
            else:
                numel = split[1]  # an uneven split moves its padding too
        for kind, phase, nbytes, over, count in dp_sync_steps(
            zero, numel, param_b, reduce_b, shard, options.replicate_axes, n_shard
        ):
            group = math.prod(sizes[a] for a in over)
            if group > 1 and in_buckets:
                bucketed.append((name, over, nbytes))  # summed with others in DDP's buckets (`GradSync`)
            elif group > 1 and zero == 1 and kind == "reduce_scatter":
                pieces.append((name, over, nbytes))  # ZeRO-1's buckets (`zero1_buckets`): padded, as they move
            elif group > 1 and not (zero == 1 and kind == "all_gather"):
                gather = kind == "all_gather" and phase != "optimizer"
                op, count = (PARAM_GATHER if gather else GRAD_SYNC), count * (gathers if gather else 1)
                records.append(
                    Collective(
                        kind, over, nbytes, name, op, "", f"zero-{options.zero}", phase, count, group, name, pp_rank
                    )
                )
    for over, names, nbytes in grad_buckets(bucketed):
        group = math.prod(sizes[a] for a in over)
        why = f"zero-{options.zero}: a bucket of {len(names)}"
        records.append(
            Collective(
                "all_reduce", over, nbytes, names[0], GRAD_SYNC, "", why, "backward", 1, group, names[-1], pp_rank
            )
        )
    for over, names, nbytes in grad_buckets(pieces):
        group, why = math.prod(sizes[a] for a in over), f"zero-1: a bucket of {len(names)}"
        gathered = nbytes // reduce_b * param_b  # the updated pieces, in the parameters' dtype
        for kind, phase, size in (("reduce_scatter", scatter_phase, nbytes), ("all_gather", "optimizer", gathered)):
            records.append(
                Collective(kind, over, size, names[0], GRAD_SYNC, "", why, phase, 1, group, names[-1], pp_rank)
            )
    return records


def dp_sync_steps(zero: int, numel: int, param_b: int, reduce_b: int, shard: tuple, replicate: tuple, n_shard: int):
    """`(kind, phase, bytes, axes, count)` of one parameter's data-parallel traffic per step.

    0: all-reduce the gradient. 1: reduce-scatter it, all-gather the updated
    shard. 2: all-gather once in forward (kept through backward), reduce-scatter
    the gradient. 3: all-gather in forward and again in backward. With HSDP the
    shard's gradient is also all-reduced over the replicate axes.
    """
    if zero == 0:
        return [("all_reduce", "backward", numel * reduce_b, shard + replicate, 1)] if shard + replicate else []
    steps = [("reduce_scatter", "backward", numel * reduce_b, shard, 1)]
    gather = numel * param_b
    steps += {1: [("all_gather", "optimizer", gather, shard, 1)], 2: [("all_gather", "forward", gather, shard, 1)]}.get(
        zero, [("all_gather", "forward", gather, shard, 1), ("all_gather", "backward", gather, shard, 1)]
    )
    if replicate:
        steps.append(("all_reduce", "backward", numel * reduce_b // max(1, n_shard), replicate, 1))
    return steps


__all__ = [
    "GRAD_SYNC", "PARAM_GATHER", "RANDOM_NOTE", "dp_collectives", "dp_sync_steps", "graph_collectives", "op_name",
    "plan_of", "step_collectives", "with_data_parallel",
]  # fmt: skip
