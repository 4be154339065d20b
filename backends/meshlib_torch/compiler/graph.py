"""One graph's passes, in order: trace -> annotate -> propagate -> redistribute -> localize -> records.

`compile_graph(model, call, mesh=..., rules=..., options=...)` needs no
processes and no real memory: the model may live on the meta device and the
mesh is the core's abstract `Mesh`. It returns a `Compiled` holding the local
graph (run later by the runtime, on a real DeviceMesh) and the core's `Plan`.
`compile.compile_model` is the entry for any mesh; a pipeline compiles one
microbatch's graph here and cuts it into stages (`pipeline.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch

from meshlib import Mesh
from meshlib.options import Parallelism

from ..modules.recompute import Remat, gathers
from .capture.attention import CP_AXIS, attention_as_regions, attention_regions
from .capture.blocks import layer_paths, partition
from .capture.call import Call
from .capture.masks import causal_calls
from .capture.moe import balancing_routers, check_moe, expert_weight_specs, experts_as_regions, full_buffers
from .capture.trace import trace
from .capture.values import annotate_run_dtypes
from .estimates.dryrun import dry_peak, local_input
from .estimates.records import plan_of, with_data_parallel
from .estimates.saved import Census, census, kept_layers, remat_notes, remat_of
from .placement import annotate as _annotate
from .placement.localize import fold_scalars, localize
from .placement.placements import Shard, sync_axes, zigzag
from .placement.propagate import Axes, propagate
from .placement.rank_ops import check_regions
from .placement.redistribute import CommSpec, data_gathers, insert_comms, partial_grad_params
from .placement.shapes import ragged_dims
from .program import Compiled, OneGraph, check_zero, data_axes, input_layouts, model_state, persistent_buffers


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


def compile_graph(
    model: torch.nn.Module, call: Call, /, *, mesh: Mesh, rules, options: Parallelism, estimate_memory: bool = False,
    count_flops: bool = False, estimate_kept: bool = False,
) -> Compiled:  # fmt: skip
    """One graph for `mesh`, called as `call`: its plan, and its model state per rank (with
    `estimate_memory`, the dry run's activations and peak too, and what each layer keeps for
    backward; `estimate_kept` the latter alone). `count_flops` notes each op's forward FLOPs on
    its node (`meta["flops"]`, a pipeline's stage cost)."""
    check_moe(model)
    with _gc_paused():
        compiled = _compile(model, mesh, rules, call, options, count_flops)
    estimate_kept = (estimate_memory or estimate_kept) and compiled.layers > 0
    found = _census(compiled, call, estimate_kept)
    compiled = dataclasses.replace(compiled, remat=remat_of(compiled, found) if found is not None else Remat())
    memory, compute = model_state(compiled), ()
    if estimate_memory:
        dry = dry_peak(compiled, model, batch=list(call.tensors.values()))
        memory = dataclasses.replace(memory, activations=dry["step"], peak=dry["peak"])
        compute = (dry["compute"],)
    kept = kept_layers(compiled, _local_inputs(compiled, call), found) if estimate_kept else ()
    notes = dict(compiled.plan.notes) | remat_notes(compiled)
    plan = compiled.plan.replace(memory=memory, kept=kept, notes=tuple(notes.items()), compute=compute)
    return dataclasses.replace(compiled, plan=plan)


def _census(compiled: Compiled, call: Call, estimate_memory: bool) -> Census | None:
    """What each op keeps for backward (`saved.census`: one forward on meta), where the plan needs it:
    to count what recompute runs again and what backward gathers again, and with `estimate_memory`
    to say what each layer keeps."""
    if not estimate_memory and compiled.options.recompute == "none" and not any(gathers(c) for c in compiled.comms):
        return None
    return census(compiled, _local_inputs(compiled, call))


def _local_inputs(compiled: Compiled, call: Call) -> list[torch.Tensor]:
    return [local_input(compiled, name, x) for name, x in call.tensors.items()]


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
    if axes.uneven and any(0 in ragged_dims(spec.shape, spec.src, axes.sizes) for spec, _, _ in found):
        more += (
            ". The batch is cut unevenly over the data axes (uneven='chunk'): an op that merges or splits the "
            "batch dim (a view) cannot take torch.chunk's pieces, and a batch that would leave a rank no row is "
            "not cut. Fix first: make the batch a multiple of the data-parallel size"
        )
    raise ValueError(
        "data parallelism would collapse: " + "; ".join(lines) + more + ". Gathering an activation over a "
        "data-parallel axis makes every rank of it compute the whole batch from there on. Fix: write that part of "
        "the forward with ops meshlib can split, or pass allow_data_gather=True to accept the gather"
    )


def _compile(model, mesh, rules, call: Call, options: Parallelism, count_flops: bool) -> Compiled:
    compute = getattr(torch, options.precision.param)
    in_layouts = input_layouts(
        call.tensors, options.in_specs, mesh, options.replicate_axes, options.uneven, options.cp_layout
    )
    data = data_axes(in_layouts, mesh)
    with (
        experts_as_regions(model, mesh, data, options.capacity_factor) as experts,
        attention_as_regions(mesh, data, options.cp_method, options.cp_layout) as attention,
    ):
        traced = trace(model, call, count_flops=count_flops, compute=compute)
    if options.capacity_factor is not None and not experts:
        raise ValueError(
            f"capacity_factor={options.capacity_factor} caps the tokens each expert takes, but this model has no "
            "experts module meshlib recognises (see compiler/capture/moe.py). Fix: drop capacity_factor"
        )
    gm = traced.gm
    fold_scalars(gm)  # first: export's dtype asserts name the traced dtypes, not the compute dtype's
    regions = attention_regions(gm, attention)
    causal = causal_calls(gm) if not regions["calls"] else 0
    kept = full_buffers(model)
    annotate_run_dtypes(gm, call, compute, keep=kept)
    specs = _annotate.param_specs(traced.params, rules, mesh, traced.aliases, options.uneven)
    specs = expert_weight_specs(specs, experts, mesh)
    if experts and options.replicate_axes and "ep" in data:
        raise NotImplementedError(
            f"replicate_axes={list(options.replicate_axes)} (HSDP) with expert parallelism: the experts' FSDP2 "
            "units would shard over the data axes besides ep and the replicate axes, which meshlib does not build. "
            "Fix: drop replicate_axes (ZeRO-2/3 then shards the experts over the data axes besides ep)"
        )
    groups = _annotate.fuse_groups(gm)
    layouts = {n: _annotate.spec_to_layout(s, mesh) for n, s in specs.items()}
    declared = layouts
    layouts = {n: _annotate.with_groups(lay, groups[n], mesh, traced.params[n].shape) if n in groups else lay
               for n, lay in layouts.items()}  # fmt: skip
    plain = sorted(n for n in groups if layouts[n] == declared[n] and Shard(groups[n][0]) in declared[n])
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    axes = _axes(mesh, options, call, data)
    check_zero(options.zero, data, mesh)
    bad = [a for a in options.replicate_axes if a not in data]
    if bad:
        raise ValueError(
            f"replicate_axes {bad} are not data-parallel axes of this plan ({data}); "
            "HSDP replicates over some of those"
        )
    check_regions(gm, axes)
    plans = propagate(gm, axes, params=layouts, inputs=in_layouts)
    synced = partial_grad_params(plans, axes, data)
    # a parameter split over every data axis it could be summed on (an expert weight on a mesh whose only
    # data axis is ep) has a whole gradient on each rank, and nothing to shard its state over
    trainable = {n for n, p in traced.params.items() if p.requires_grad and sync_axes(layouts[n], axes.names, data)}
    if options.zero >= 1 and data and not trainable <= synced:
        raise ValueError(
            f"zero={options.zero} needs every parameter's gradient to be a partial sum over {data}, but "
            f"{sorted(trainable - synced)} compute on activations gathered whole over those axes. "
            "Fix: use zero=0, or keep those activations split over the batch"
        )
    comms = insert_comms(gm, plans, axes, deferred=data)
    if not options.allow_data_gather:
        _refuse_data_gathers(comms, plans, axes, data)
    specials = localize(gm, plans, axes, set(traced.params), data)
    gm.graph.lint()
    plan = plan_of(mesh, specs, comms, specials, axes, traced, groups, plans, options.sequence_parallel, layouts)
    plan = with_data_parallel(plan, data, options)
    if regions["calls"]:
        note = _cp_note(regions, mesh, options.cp_method, options.cp_layout)
        plan = plan.replace(notes=(*plan.notes, ("context parallelism", note)))
    if causal:
        note = (f"{causal} attention calls given a causal mask built from the positions (as transformers builds "
                "it while traced) run with is_causal=True instead: the kernel keeps no mask for backward")
        plan = plan.replace(notes=(*plan.notes, ("causal masks", note)))
    if plain:
        note = ", ".join(plain) + ": the parts do not divide over the axes, so the split reads the output gathered"
        plan = plan.replace(notes=(*plan.notes, ("fused projections split as declared", note)))
    unequal = sorted(n for n, lay in layouts.items() if any(isinstance(p, Shard) and p.parts for p in lay))
    if unequal:
        note = ", ".join(unequal) + ": DTensor has no placement for unequal parts, so each is a DTensor of its "
        note += "rows in rank order; Parallel.whole, export and checkpoints give the model's order, a bare "
        note += "full_tensor() does not"
        plan = plan.replace(notes=(*plan.notes, ("parameters in rank order", note)))
    paths = tuple(layer_paths(model))
    return Compiled(
        mesh=mesh, axes=axes, program=OneGraph(gm.graph), traced=traced, comms=comms, specials=specials,
        param_specs=specs, param_layouts=layouts, input_layouts=in_layouts, input_names=names, plan=plan,
        options=options, buffers=dict(gm.named_buffers()), plans=plans, data_axes=data, synced_params=frozenset(synced),
        parts=partition(gm.graph, list(paths)), layers=len(paths), layer_paths=paths,
        routers=balancing_routers(model), persistent=persistent_buffers(model), full_buffers=kept,
    )  # fmt: skip


def _cp_note(regions: dict[str, int], mesh: Mesh, method: str, layout: str) -> str:
    n = mesh.axis_size(CP_AXIS)
    how = {
        "ring": "ring_attention over cp={n} (keys and values around the ring)",
        "all-gather": "allgather_attention over cp={n} (keys and values gathered once)",
        "all-to-all": "ulysses_attention over cp={n} (sequence shards swapped for head shards)",
    }[method].format(n=n)
    where = {
        "zigzag": f"in the head-tail layout (rank i holds chunks i and {2 * n - 1}-i of {2 * n}: causal work balanced)",
        "contiguous": "in the contiguous layout (causal work unbalanced: the last rank's is cp times the first's)",
    }[layout]
    said = [f"{regions['calls']} attention calls run as {how}, {where}"]
    if regions["written out"]:
        said.append(f"{regions['written out']} of them written out as softmax(Q Kᵀ·scale + mask)·V, found and run so")
    if regions["unrepeated"]:
        said.append(f"{regions['unrepeated']} with their key/value heads unrepeated (GQA: kv heads travel alone)")
    if regions["causal masks"]:
        said.append(f"{regions['causal masks']} causal masks recognised and run as is_causal (no mask moved)")
    if regions["masks"]:
        said.append(f"{regions['masks']} with their mask split by query rows (every key column on each rank)")
    return "; ".join(said)


def _axes(mesh: Mesh, options: Parallelism, call: Call, data: tuple[str, ...] = ()) -> Axes:
    """The mesh as propagation sees it. Where new activation shards may start: on the sequence dim over
    `tp` (sequence parallelism), and over `cp` when it splits the inputs' sequence (context parallelism:
    a whole value of the sequence's length, learned positions say, is sliced to this rank's tokens)."""
    slice_dims = ()
    first = tuple(next(iter(call.tensors.values())).shape) if call.tensors else ()
    if options.sequence_parallel and options.tp_axis in mesh:
        slice_dims = ((options.tp_axis, Shard(options.seq_dim), first[options.seq_dim]),)
    if CP_AXIS in data and len(first) >= 2:
        slice_dims += ((CP_AXIS, zigzag(1) if options.cp_layout == "zigzag" else Shard(1), first[1]),)
        if options.sequence_parallel and options.tp_axis in mesh:
            _check_sp_cp(first[1], mesh.axis_size(CP_AXIS), mesh.axis_size(options.tp_axis), options.tp_axis)
    return Axes(mesh.axis_names, mesh.axis_sizes, slice_dims, options.uneven == "chunk")



def _check_sp_cp(seq: int, cp: int, tp: int, tp_axis: str) -> None:
    """Sequence parallelism cuts each cp rank's tokens over tp again: they must divide, since a dim cut in
    torch.chunk's pieces is cut no further (Megatron asks the sequence to be a multiple of tp x cp too)."""
    if seq % (cp * tp):
        raise ValueError(
            f"sequence_parallel=True splits each cp rank's tokens over {tp_axis}={tp}, but the sequence of {seq} "
            f"tokens does not cut into cp x {tp_axis} = {cp * tp} equal pieces (a piece torch.chunk cut unevenly is "
            f"not cut again). Fix: pad the sequence to {-(-seq // (cp * tp)) * cp * tp} tokens (the padding's labels "
            "ignored), or drop sequence_parallel"
        )


__all__ = ["compile_graph"]
