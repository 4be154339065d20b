"""The compiler's orchestrator: trace -> annotate -> propagate -> redistribute -> localize.

`compile_model(model, mesh=..., rules=..., example_inputs=...)` needs no
processes and no real memory: the model may live on the meta device and the
mesh is the core's abstract `Mesh`. It returns a `Compiled` holding the local
graph (run later by the runtime, on a real DeviceMesh) and the core's `Plan`.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshlib import Collective, Memory, Mesh, P, Plan

from . import annotate as _annotate
from .localize import SpecialSpec, fold_scalars, localize
from .placements import Layout, Shard
from .propagate import Axes, NodePlan, propagate
from .redistribute import CommSpec, collective_records, insert_comms
from .shapes import local_shape
from .trace import Traced, trace


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

    def rank_indices(self, name: str, rank: int) -> list:
        """Per dim, the global indices of parameter `name` that `rank` holds."""
        from ..runtime.materialize import shard_indices

        coords = self.mesh.coords(rank)
        return shard_indices(tuple(self.traced.params[name].shape), self.param_layouts[name], self.axes.sizes, [coords[a] for a in self.axes.names])

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.traced.params[name].shape)
        out = list(shape)
        for p, n in zip(self.param_layouts[name], self.axes.sizes):
            if isinstance(p, Shard):
                out[p.dim] = -(-out[p.dim] // n)
        return tuple(out)


def default_in_spec(mesh: Mesh) -> P:
    """Inputs are split on their batch dim over the data-parallel axes the mesh has."""
    data = tuple(a for a in ("dp",) if a in mesh and mesh.axis_size(a) > 1)
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
    example_inputs: tuple,
    in_specs: dict[str, P] | tuple[P, ...] | None = None,
    sequence_parallel: bool = False,
    tp_axis: str = "tp",
    seq_dim: int = 1,
) -> Compiled:
    """Compile `model` for `mesh`: no processes, no real memory (the model may be on meta)."""
    with _gc_paused():
        return _compile(model, mesh, rules, example_inputs, in_specs, sequence_parallel, tp_axis, seq_dim)


def _compile(model, mesh, rules, example_inputs, in_specs, sequence_parallel, tp_axis, seq_dim) -> Compiled:
    traced = trace(model, example_inputs)
    gm = traced.gm
    fold_scalars(gm)
    specs = _annotate.param_specs(traced.params, rules, mesh)
    groups = _annotate.fuse_groups(gm)
    layouts = {n: _annotate.spec_to_layout(s, mesh) for n, s in specs.items()}
    layouts = {n: _annotate.with_groups(lay, groups[n]) if n in groups else lay for n, lay in layouts.items()}
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    in_layouts = _input_layouts(names, in_specs, mesh, example_inputs)
    axes = _axes(mesh, sequence_parallel, tp_axis, seq_dim, example_inputs)
    plans = propagate(gm, axes, params=layouts, inputs=in_layouts)
    comms = insert_comms(gm, plans, axes)
    specials = localize(gm, plans, axes, set(traced.params))
    gm.graph.lint()
    plan = _plan(mesh, specs, comms, specials, axes, traced, groups, plans, sequence_parallel, layouts)
    buffers = {n: b for n, b in gm.named_buffers()}
    return Compiled(mesh, axes, gm.graph, traced, comms, specials, specs, layouts, in_layouts, names, plan, buffers, plans)


def _axes(mesh: Mesh, sp: bool, tp_axis: str, seq_dim: int, example_inputs: tuple) -> Axes:
    slice_dims = ()
    if sp and tp_axis in mesh:
        seq = tuple(example_inputs[0].shape)[seq_dim]
        slice_dims = ((tp_axis, seq_dim, seq),)
    return Axes(mesh.axis_names, mesh.axis_sizes, slice_dims)


def _input_layouts(names, in_specs, mesh: Mesh, example_inputs) -> dict[str, Layout]:
    if in_specs is None:
        in_specs = {n: default_in_spec(mesh) for n in names}
    elif not isinstance(in_specs, dict):
        in_specs = dict(zip(names, in_specs))
    out = {}
    for name, x in zip(names, example_inputs):
        spec = in_specs.get(name, P())
        from meshlib import NamedSharding

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
    if traced.reason:
        notes["trace fallback reason"] = traced.reason
    if groups:
        notes["fused projections"] = ", ".join(f"{n} ({k} parts)" for n, k in sorted(groups.items()))
    fallback = sorted({str(p.view.node.target) for p in plans.values() if p.replicated_fallback})
    if fallback:
        notes["ops run replicated (no rule)"] = ", ".join(fallback)
    notes["sequence parallel"] = "on" if sp else "off"
    placements = {n: tuple(repr(p) for p in layouts[n]) for n in specs}
    return Plan(
        mesh, specs=specs, collectives=collectives, notes=notes, memory=_memory(traced, layouts, plans, axes),
        placements=placements,
    )  # fmt: skip


_ALIASES = {"view", "transpose", "permute", "expand", "item", "index", "slice", "select", "split", "scalar", "drop"}


def _memory(traced: Traced, layouts: dict[str, Layout], plans: dict, axes: Axes) -> Memory:
    """Bytes per rank: parameters and gradients in their shards, AdamW's two moments,
    and the activations the forward keeps (every op output that is not a view)."""
    params = 0
    for name, p in traced.params.items():
        params += math.prod(local_shape(tuple(p.shape), layouts[name], axes.sizes)) * p.element_size()
    acts = 0
    for node, plan in plans.items():
        val = node.meta.get("val")
        if node.op in ("call_function", "call_method") and plan.view.kind not in _ALIASES and torch.is_tensor(val):
            acts += math.prod(local_shape(tuple(val.shape), plan.out, axes.sizes)) * val.element_size()
    return Memory(params=params, grads=params, optimizer=2 * params, activations=acts, peak=4 * params + acts)


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
                        kind="all_reduce", axes=(axis,), bytes=rows * spec.args["itemsize"] * n_val, node=spec.name, op="cross_entropy",
                        source="", reason=f"loss-parallel {what}", phase="forward", group=sizes[axis], bus=0,
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


__all__ = ["Compiled", "compile_model", "default_in_spec"]
