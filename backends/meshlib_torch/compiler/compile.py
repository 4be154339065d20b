"""The compiler's orchestrator: trace -> annotate -> propagate -> redistribute -> localize.

`compile_model(model, mesh=..., rules=..., example_inputs=...)` needs no
processes and no real memory: the model may live on the meta device and the
mesh is the core's abstract `Mesh`. It returns a `Compiled` holding the local
graph (run later by the runtime, on a real DeviceMesh) and the core's `Plan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshlib import Collective, Memory, Mesh, P, Plan, Precision
from meshlib.cost import fsdp2_memory, zero_level, zero_memory

from . import annotate as _annotate
from .call import Call, LossSpec, bind_call
from .localize import SpecialSpec, fold_scalars, localize
from .moe import check_not_moe
from .placements import Layout, Shard, zero1_split
from .propagate import Axes, NodePlan, propagate
from .redistribute import CommSpec, collective_records, data_gathers, insert_comms, partial_grad_params
from .shapes import local_shape
from .split import layer_paths, partition
from .trace import Traced, source_line, trace


@dataclass
class Compiled:
    mesh: Mesh
    axes: Axes
    graph: fx.Graph
    traced: Traced
    comms: list[CommSpec]
    specials: list[SpecialSpec]
    param_specs: dict[str, P]
    param_layouts: dict[str, Layout]
    input_layouts: dict[str, Layout]
    input_names: list[str]
    plan: Plan
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    plans: dict[fx.Node, NodePlan] = field(default_factory=dict, repr=False)
    data_axes: tuple[str, ...] = ()
    options: Options | None = None
    parts: dict[fx.Node, int] = field(default_factory=dict, repr=False)  # node -> pre/layer/post part
    synced_params: set[str] = field(default_factory=set)  # gradients the runtime sums over the data axes

    def rank_indices(self, name: str, rank: int) -> list:
        """Per dim, the global indices of parameter `name` that `rank` holds."""
        from ..runtime.materialize import shard_indices

        coords = self.mesh.coords(rank)
        return shard_indices(
            tuple(self.traced.params[name].shape),
            self.param_layouts[name],
            self.axes.sizes,
            [coords[a] for a in self.axes.names],
        )

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.traced.params[name].shape)
        out = list(shape)
        for p, n in zip(self.param_layouts[name], self.axes.sizes):
            if isinstance(p, Shard):
                out[p.dim] = -(-out[p.dim] // n)
        return tuple(out)


def default_in_spec(mesh: Mesh, replicate_axes: tuple[str, ...] = ()) -> P:
    """Inputs are split on their batch dim over the data-parallel axes: `dp`, and HSDP's replicate axes."""
    data = tuple(a for a in mesh.axis_names if (a == "dp" or a in replicate_axes) and mesh.axis_size(a) > 1)
    return P(data) if data else P()


@contextlib.contextmanager
def _gc_paused():
    """The compiler allocates many small, long-lived objects (graph nodes, fake tensors):
    full collections over them made compile time grow faster than the model."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def compile_model(
    model: torch.nn.Module,
    /,
    *,
    mesh: Mesh,
    rules,
    example_inputs: tuple | dict = (),
    example_kwargs: dict | None = None,
    loss: LossSpec = None,
    in_specs: dict[str, P] | tuple[P, ...] | None = None,
    sequence_parallel: bool = False,
    tp_axis: str = "tp",
    seq_dim: int = 1,
    zero: int | str = 0,
    precision: Precision | str | None = None,
    recompute: str = "none",
    replicate_axes: tuple[str, ...] = (),
    estimate_memory: bool = False,
    count_flops: bool = False,
    allow_data_gather: bool = False,
) -> Compiled:
    """Compile `model` for `mesh`: no processes, no real memory (the model may be on meta).

    The model is called as `model(*example_inputs, **example_kwargs)` (`example_inputs` may
    also be a dict of keyword inputs); its tensors are the compiled model's inputs, by name,
    and its other values are fixed. The compiled model returns the loss: the output itself,
    a dict's or `ModelOutput`'s `"loss"`, or what `loss=` picks (an index, key, attribute
    name or function of the output; see `compiler.call`).
    The data-parallel axes are those the inputs' batch dim is split over.
    Gradients are summed over them once per step by the runtime, by `zero`
    level: 0 all-reduces them, 1 reduce-scatters them into a sharded optimizer,
    2 and 3 hand the axes to FSDP2 (`replicate_axes` makes that HSDP).
    `precision` is a `Precision` or its text (`"bf16"`, `"param=bf16,reduce=fp32"`).
    `count_flops` notes each op's forward FLOPs on its node (`meta["flops"]`, the pipeline's stage
    cost); `example_inputs` may also be an already bound `Call`.
    """
    if isinstance(precision, str):
        precision = Precision.parse(precision)
    elif precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"precision={precision!r}: pass a meshlib.Precision, or text such as 'bf16' or 'param=bf16,reduce=fp32'"
        )
    if precision is None:  # compute, reduce and output in the model's own dtype
        own = str(next(model.parameters()).dtype).removeprefix("torch.")
        precision = Precision(own, own, own)
    options = Options(zero_level(zero), precision, _recompute(recompute), tuple(replicate_axes), allow_data_gather)
    if isinstance(example_inputs, Call):
        call = example_inputs
    else:
        call = bind_call(model, example_inputs, example_kwargs, loss=loss)
    check_not_moe(model)
    with _gc_paused():
        compiled = _compile(
            model, mesh, rules, call, in_specs, sequence_parallel, tp_axis, seq_dim, options, count_flops
        )
    memory = model_state(compiled)
    if estimate_memory:
        from ..runtime.dryrun import dry_peak

        dry = dry_peak(compiled, model, batch=list(call.tensors.values()))
        memory = dataclasses.replace(memory, activations=dry["step"], peak=dry["peak"])
    compiled.plan = compiled.plan.replace(memory=memory)
    return compiled


@dataclass(frozen=True)
class Options:
    zero: int
    precision: Precision
    recompute: str
    replicate_axes: tuple[str, ...]
    allow_data_gather: bool = False


def _refuse_data_gathers(comms: list[CommSpec], plans, axes: Axes, data: tuple[str, ...]) -> None:
    """Raise where an activation would be gathered over a data axis (see `redistribute.data_gathers`)."""
    found = data_gathers(comms, plans, axes, data) if data else []
    if not found:
        return
    lines = []
    for spec, axis, no_rule in found[:5]:
        why = "it has no rule, so it runs whole on every rank" if no_rule else "its rules need that input whole"
        lines.append(
            f"{spec.op} (node {spec.consumer}, at {spec.source or 'an unknown line'}) needs {spec.producer} "
            f"{list(spec.shape)} whole over data axis {axis!r}: {why}"
        )
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    raise ValueError(
        "data parallelism would collapse: " + "; ".join(lines) + more + ". Gathering an activation over a "
        "data-parallel axis makes every rank of it compute the whole batch from there on. Fix: write that part of "
        "the forward with ops meshlib can split, or pass allow_data_gather=True to accept the gather"
    )


RECOMPUTE = ("none", "block", "selective")


def _recompute(value: str) -> str:
    if value not in RECOMPUTE:
        raise ValueError(f"recompute={value!r}: choose one of {RECOMPUTE}")
    return value


def _compile(model, mesh, rules, call: Call, in_specs, sp, tp_axis, seq_dim, options, count_flops) -> Compiled:
    traced = trace(model, call, count_flops=count_flops)
    gm = traced.gm
    fold_scalars(gm)
    specs = _annotate.param_specs(traced.params, rules, mesh, traced.aliases)
    groups = _annotate.fuse_groups(gm)
    layouts = {n: _annotate.spec_to_layout(s, mesh) for n, s in specs.items()}
    layouts = {n: _annotate.with_groups(lay, groups[n]) if n in groups else lay for n, lay in layouts.items()}
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    in_layouts = input_layouts(call.tensors, in_specs, mesh, options.replicate_axes)
    axes = _axes(mesh, sp, tp_axis, seq_dim, call)
    data = data_axes(in_layouts, mesh)
    bad = [a for a in options.replicate_axes if a not in data]
    if bad:
        raise ValueError(
            f"replicate_axes {bad} are not data-parallel axes of this plan ({data}); "
            "HSDP replicates over some of those"
        )
    plans = propagate(gm, axes, params=layouts, inputs=in_layouts)
    synced = partial_grad_params(plans, axes, data)
    trainable = {n for n, p in traced.params.items() if p.requires_grad}
    if options.zero >= 1 and data and synced != trainable:
        raise ValueError(
            f"zero={options.zero} needs every parameter's gradient to be a partial sum over {data}, but "
            f"{sorted(trainable - synced)} compute on activations gathered whole over those axes. "
            "Fix: use zero=0, or keep those activations split over the batch"
        )
    comms = insert_comms(gm, plans, axes, deferred=data)
    if not options.allow_data_gather:
        _refuse_data_gathers(comms, plans, axes, data)
    specials = localize(gm, plans, axes, set(traced.params))
    gm.graph.lint()
    plan = _plan(mesh, specs, comms, specials, axes, traced, groups, plans, sp, layouts)
    plan = _with_data_parallel(plan, traced, layouts, axes, data, options, synced)
    buffers = {n: b for n, b in gm.named_buffers()}
    compiled = Compiled(
        mesh, axes, gm.graph, traced, comms, specials, specs, layouts, in_layouts, names, plan, buffers, plans
    )
    compiled.data_axes, compiled.options, compiled.synced_params = data, options, synced
    compiled.parts = partition(gm.graph, layer_paths(model))
    return compiled


def data_axes(in_layouts: dict[str, Layout], mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes that split the batch dim of every input (in mesh order)."""
    layouts = list(in_layouts.values())
    return tuple(
        a for i, a in enumerate(mesh.axis_names)
        if layouts and mesh.axis_size(a) > 1 and all(lay[i] == Shard(0) for lay in layouts)
    )  # fmt: skip


def _with_data_parallel(
    plan: Plan, traced: Traced, layouts, axes: Axes, data: tuple[str, ...], options: Options, synced
) -> Plan:
    """The plan's gradient sync over the data axes, and its zero level, precision and recompute."""
    records = []
    sizes = dict(zip(axes.names, axes.sizes))
    shard = tuple(a for a in data if a not in options.replicate_axes)
    n_shard = math.prod(sizes[a] for a in shard)
    param_b, reduce_b = (
        torch.empty((), dtype=getattr(torch, d)).element_size()
        for d in (options.precision.param, options.precision.reduce)
    )
    for name, p in traced.params.items():
        if name not in synced:
            continue  # its gradient is already whole (computed on activations gathered over the data axes)
        local = local_shape(tuple(p.shape), layouts[name], axes.sizes)
        zero, numel = options.zero, math.prod(local)
        if zero == 1 and n_shard > 1:
            split = zero1_split(local, n_shard, layouts[name])
            if split is None:
                zero = 0  # kept whole: its gradient is all-reduced
            else:
                numel = split[1]  # an uneven split moves its padding too
        for kind, phase, nbytes, over, count in dp_sync_steps(
            zero, numel, param_b, reduce_b, shard, options.replicate_axes, n_shard
        ):
            group = math.prod(sizes[a] for a in over)
            if group > 1:
                records.append(
                    Collective(
                        kind, over, nbytes, name, "grad sync", "", f"zero-{options.zero}", phase, count, group, name
                    )
                )
    notes = dict(plan.notes) | {"data-parallel axes": ",".join(data) or "-"}
    if options.replicate_axes:
        notes["hsdp replicate axes"] = ",".join(options.replicate_axes)
    return plan.replace(
        collectives=plan.collectives + tuple(records), zero=options.zero, precision=options.precision,
        recompute=options.recompute, notes=tuple(notes.items()),
    )  # fmt: skip


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


def _axes(mesh: Mesh, sp: bool, tp_axis: str, seq_dim: int, call: Call) -> Axes:
    slice_dims = ()
    if sp and tp_axis in mesh:
        seq = tuple(next(iter(call.tensors.values())).shape)[seq_dim]
        slice_dims = ((tp_axis, seq_dim, seq),)
    return Axes(mesh.axis_names, mesh.axis_sizes, slice_dims)


def input_layouts(tensors: dict[str, torch.Tensor], in_specs, mesh: Mesh, replicate_axes=()) -> dict[str, Layout]:
    """Each input's layout: its spec from `in_specs` (by name, or in order), else the batch split over dp."""
    from meshlib import NamedSharding

    names = list(tensors)
    if in_specs is None:
        in_specs = {n: default_in_spec(mesh, replicate_axes) for n in names}
    elif not isinstance(in_specs, dict):
        in_specs = dict(zip(names, in_specs))
    unknown = sorted(set(in_specs) - set(names))
    if unknown:
        raise ValueError(f"in_specs names {unknown}, which are not tensor inputs of the call ({names})")
    out = {}
    for name, x in tensors.items():
        spec = in_specs.get(name, P())
        NamedSharding(mesh, spec).check(tuple(x.shape), path=f"input {name!r}")
        out[name] = _annotate.spec_to_layout(spec, mesh)
    return out


def _plan(mesh, specs, comms, specials, axes, traced, groups, plans, sp, layouts) -> Plan:
    records = collective_records(comms, axes)
    records += _special_records(specials, axes)
    collectives = [
        Collective(
            r["kind"], r["axes"], r["bytes"], r["node"], r["op"], r["source"], r["reason"], r["phase"],
            group=r["group"], consumer=r.get("consumer", ""),
        )
        for r in records
    ]  # fmt: skip
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
    return Plan(
        mesh, specs=specs, collectives=collectives, notes=notes,
        placements=placements,
    )  # fmt: skip


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
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    module = {"torch._C._special": "torch.special", "torch._C._nn": "torch.nn.functional"}.get(module, module)
    return f"{module}.{getattr(target, '__name__', target)}".lstrip(".")


def model_state(compiled: Compiled) -> Memory:
    """Bytes per rank of parameters, gradients and optimizer state, as the runtime stores them.

    ZeRO-0/1 keep DESIGN.md's layout: parameters and gradients in the compute
    dtype, fp32 masters (mixed precision) and two moments in the optimizer,
    sharded over the data axes from ZeRO-1. ZeRO-2/3 are FSDP2's storage:
    full-precision shards of parameters and gradients, and the moments.
    """
    opts = compiled.options
    full = next(iter(compiled.traced.params.values())).dtype
    compute = getattr(torch, opts.precision.param)
    mixed = compute in (torch.bfloat16, torch.float16)
    psi = sum(math.prod(compiled.local_param_shape(n)) for n in compiled.traced.params)
    n = math.prod(compiled.mesh.axis_size(a) for a in compiled.data_axes if a not in opts.replicate_axes) or 1
    if opts.zero >= 2:
        state = fsdp2_memory(psi, n, itemsize=full.itemsize)
        return Memory(params=int(state.params), grads=int(state.grads), optimizer=int(state.optimizer))
    if opts.zero != 1 or n == 1:
        state = zero_memory(psi, n, zero=opts.zero, mixed=mixed, itemsize=full.itemsize)
        return Memory(params=int(state.params), grads=int(state.grads), optimizer=int(state.optimizer))
    pieces = zero1_pieces(compiled)
    state = zero_memory(psi, n, zero=1, mixed=mixed, itemsize=full.itemsize)
    per = zero_memory(1, 1, zero=1, mixed=mixed, itemsize=full.itemsize).optimizer  # bytes per element
    whole = sum(math.prod(compiled.local_param_shape(name)) for name, kept in pieces.items() if kept is None)
    kept = sum(k for k in pieces.values() if k is not None)
    # a piece holds its share of the moments (and of the fp32 master, if separate); a whole tensor
    # holds all of them, and always a full-precision master copy of its own
    return Memory(
        params=int(state.params),
        grads=int(state.grads),
        optimizer=round(per * kept + 3 * full.itemsize * whole),
    )


def zero1_pieces(compiled: Compiled) -> dict[str, int | None]:
    """Under ZeRO-1, the elements of each parameter's largest piece (rank 0's), or None where
    every rank keeps it whole (`placements.zero1_split`). Empty unless zero=1 over >1 ranks."""
    opts = compiled.options
    n = math.prod(compiled.mesh.axis_size(a) for a in compiled.data_axes)
    if opts.zero != 1 or n <= 1:
        return {}
    out = {}
    for name in compiled.traced.params:
        split = zero1_split(compiled.local_param_shape(name), n, compiled.param_layouts[name])
        out[name] = None if split is None else split[0]
    return out


def _special_records(specials: list[SpecialSpec], axes: Axes) -> list[dict]:
    """Collectives inside the rank-dependent ops (loss-parallel cross-entropy)."""
    out = []
    sizes = dict(zip(axes.names, axes.sizes))
    for spec in specials:
        if spec.kind != "cross_entropy":
            continue
        rows = spec.args.get("rows_local", 0)
        if spec.args["vocab_axis"]:
            axis = spec.args["vocab_axis"]
            for what in ("max", "sum-exp and target logit"):
                n_val = 1 if what == "max" else 2
                out.append(
                    dict(
                        kind="all_reduce", axes=(axis,), bytes=rows * spec.args["itemsize"] * n_val, node=spec.name,
                        op="cross_entropy", source="", reason=f"loss-parallel {what}", phase="forward",
                        group=sizes[axis], bus=0,
                    )
                )  # fmt: skip
        for axis in spec.args["rows_axes"]:
            if spec.args["reduction"] == "mean":
                out.append(
                    dict(
                        kind="all_reduce", axes=(axis,), bytes=8, node=spec.name, op="cross_entropy", source="",
                        reason="global count of targets", phase="forward", group=sizes[axis], bus=0,
                    )
                )  # fmt: skip
    return out


__all__ = ["Compiled", "compile_model", "default_in_spec", "input_layouts"]
