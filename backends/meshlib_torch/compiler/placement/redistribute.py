"""Redistribute: insert exactly the collectives the chosen layouts need.

Where a value's layout differs from what a consumer needs, one `comm` node
changes it; consumers that need the same layout share it. Each comm node also
says what its backward does. A gradient arrives in the layout its consumers
leave it in: whole (`natural_grad`), or partial where a replicated input fed an
op whose output is sharded or partial (a column-parallel matmul, or any op on
a batch-sharded activation for a dp-replicated parameter). Those partial
gradients are summed by an all-reduce in backward: Megatron's `f` operator, and
plain data parallelism's gradient sync, from the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture.source import source_line
from ..capture.values import run_dtype
from .placements import CP_AXIS, PARTIAL, Layout, Partial, Pending, R, Replicate, Shard, bus_bytes, kind, natural_grad
from .propagate import Axes, NodePlan
from .shapes import moved_size


@dataclass(frozen=True)
class CommSpec:
    """One redistribution: `src` -> `dst` forward, `grad_dst` -> natural(src) backward."""

    name: str
    src: Layout
    dst: Layout
    grad_dst: Layout
    shape: tuple[int, ...]  # global shape of the value
    dtype: torch.dtype
    requires_grad: bool
    producer: str
    consumer: str
    op: str
    source: str
    grad_out: Layout = ()  # what backward makes of the gradient, where not `natural_grad(src)` (`grad_target`)

    def grad_target(self) -> Layout:
        """The layout backward leaves the gradient in: the natural one, but partial where a slice of a value
        computed from parameters alone was taken on a data axis (its gradient padded with zeros: the runtime
        sums it with the parameters' gradients, `insert_comms`)."""
        return self.grad_out or tuple(natural_grad(p) for p in self.src)

    def steps(self, axes: Axes, phase: str) -> list[tuple[str, str, object, object]]:
        """`(kind, axis, from, to)` per axis that communicates, in `phase` ("forward"/"backward")."""
        out = []
        for name, s, d, g, t in zip(axes.names, self.src, self.dst, self.grad_dst, self.grad_target()):
            a, b = (s, d) if phase == "forward" else (g, t)
            if phase == "backward" and not self.requires_grad:
                continue
            k = kind(a, b)
            if k is not None:
                out.append((k, name, a, b))
        return out


def _is_partial_grad(need: Layout, out, requires_grad: bool, i: int) -> bool:
    if not requires_grad or not isinstance(need[i], Replicate):
        return False
    outs = out if isinstance(out, tuple) and out and isinstance(out[0], tuple) else (out,)
    return any(o is not None and not isinstance(o[i], Replicate) for o in outs)


def _region_partial_grad(plan: NodePlan, need: Layout, requires_grad: bool, i: int) -> bool:
    """A region of per-shard code gives its inputs' gradients summed over the axes their specs leave out
    when typed (JAX's check_vma); untyped, partial there, for the caller to sum (JAX's transpose). Over
    the deferred axes it leaves them partial, as any op does (the rule above)."""
    return requires_grad and not plan.view.p["fn"].check_vma and isinstance(need[i], Replicate)


def batch_dependence(plans: dict[fx.Node, NodePlan], axes: Axes) -> dict[fx.Node, tuple[bool, ...]]:
    """Per value and axis: does it depend on an input split over that axis (the batch)?"""
    out: dict[fx.Node, tuple[bool, ...]] = {}
    none = (False,) * len(axes.names)
    for node, plan in plans.items():
        if plan.view.kind == "placeholder":
            lay = plan.out or ()
            out[node] = tuple(not isinstance(p, Replicate) for p in lay) if lay else none
        else:
            deps = [out.get(x, none) for x in node.all_input_nodes]
            out[node] = tuple(any(d[i] for d in deps) for i in range(len(axes.names)))
    return out


def partial_grad_params(plans: dict[fx.Node, NodePlan], axes: Axes, deferred: tuple[str, ...]) -> set[str]:
    """Parameters whose gradient arrives as a partial sum over a deferred axis (the runtime sums them)."""
    batch = batch_dependence(plans, axes)
    partial: set[fx.Node] = set()
    for _node, plan in plans.items():
        for x, need in zip(plan.view.tensors, plan.need):
            if any(
                axes.names[i] in deferred and not batch[x][i] and _is_partial_grad(need, plan.out, _requires_grad(x), i)
                for i in range(len(axes.names))
            ) or any(_padded_grad(plans[x].out, need, batch[x], _requires_grad(x), axes, deferred)):
                partial.add(x)
    out: set[str] = set()
    stack = list(partial)
    seen: set[fx.Node] = set()
    while stack:  # back through the parameter-only values to the parameters themselves
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "get_attr" and x.meta.get("param"):
            out.add(x.target)
        stack.extend(x.all_input_nodes)
    return out


def _padded_grad(have, need: Layout, batch: tuple[bool, ...], requires_grad: bool, axes: Axes, deferred) -> tuple:
    """Per axis: is this a slice (replicated -> shard) of a value that depends on no input split over that
    data axis (learned positions under context parallelism)? Its gradient then goes back padded with
    zeros, a partial sum the runtime adds up with the parameters' gradients, not all-gathered in the graph
    (which would count it again there)."""
    if not requires_grad or not isinstance(have, tuple) or (have and isinstance(have[0], tuple)):
        return (False,) * len(need)
    return tuple(
        axes.names[i] in deferred and not batch[i] and isinstance(have[i], Replicate) and isinstance(need[i], Shard)
        for i in range(len(need))
    )  # fmt: skip


def _requires_grad(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return bool(torch.is_tensor(val) and val.requires_grad)


def insert_comms(
    gm: fx.GraphModule, plans: dict[fx.Node, NodePlan], axes: Axes, *, deferred: tuple[str, ...] = ()
) -> list[CommSpec]:
    """Rewrite `gm` in place with `call_module comm<i>` nodes; return their specs.

    On `deferred` axes (the data-parallel ones) a partial gradient of a value
    computed from parameters alone is not summed in the graph: it flows on,
    partial, into the parameters' gradients, which the runtime reduces once
    per step (all-reduce, or ZeRO's reduce-scatter). A value that depends on
    the batch keeps its in-graph sum, since its gradient flows back into the
    batch.
    """
    batch = batch_dependence(plans, axes)
    edges: dict[tuple[fx.Node, Layout], list[tuple[fx.Node, tuple[bool, ...]]]] = {}
    for node, plan in plans.items():
        if plan.view.kind == "item":
            continue
        for x, need in zip(plan.view.tensors, plan.need):
            rg = _requires_grad(x)
            pgrad = tuple(
                _region_partial_grad(plan, need, rg, i)
                if plan.view.kind == "shard_map" and axes.names[i] not in deferred
                else _is_partial_grad(need, plan.out, rg, i) and not (axes.names[i] in deferred and not batch[x][i])
                for i in range(len(axes.names))
            )
            edges.setdefault((x, need), []).append((node, pgrad))
    specs: list[CommSpec] = []
    for (x, need), users in edges.items():
        have = plans[x].out
        all_p = tuple(all(pg[i] for _, pg in users) for i in range(len(axes.names)))
        value = x
        if have != need or any(all_p):
            grad_dst = tuple(PARTIAL if all_p[i] else natural_grad(need[i]) for i in range(len(need)))
            pads = _padded_grad(have, need, batch[x], _requires_grad(x), axes, deferred)
            grad_out = tuple(PARTIAL if pad else natural_grad(h) for pad, h in zip(pads, have)) if any(pads) else ()
            value = _insert(gm, specs, x, have, need, grad_dst, users[0][0], grad_out=grad_out)
            for user, _ in users:
                user.replace_input_with(x, value)
        extra: dict[tuple[bool, ...], list[fx.Node]] = {}
        for user, pg in users:
            rest = tuple(p and not a for p, a in zip(pg, all_p))
            if any(rest):
                extra.setdefault(rest, []).append(user)
        for rest, group in extra.items():
            grad_dst = tuple(PARTIAL if r else natural_grad(n) for r, n in zip(rest, need))
            f = _insert(gm, specs, value, need, need, grad_dst, group[0], val=x.meta["val"])
            for user in group:
                user.replace_input_with(value, f)
    return specs


def _insert(gm, specs, x, have, need, grad_dst, first_user, val=None, grad_out=()) -> fx.Node:
    """A `comm<i>` node just before `first_user`, the earliest consumer in graph order."""
    name = f"comm{len(specs)}"
    val = x.meta["val"] if val is None else val
    spec = CommSpec(
        name, have, need, grad_dst, tuple(val.shape), run_dtype(x), bool(val.requires_grad),
        x.name, first_user.name, str(getattr(first_user.target, "__name__", first_user.target)),
        source_line(first_user), grad_out,
    )  # fmt: skip
    specs.append(spec)
    with gm.graph.inserting_before(first_user):
        gm.add_submodule(name, Pending(spec))
        node = gm.graph.create_node("call_module", name, (x,))
    node.meta["val"] = val
    node.meta["run_dtype"] = spec.dtype  # what it moves and returns as the model runs (bf16 under bf16 compute)
    node.meta["comm"] = spec
    return node


def data_gathers(specs: list[CommSpec], plans: dict[fx.Node, NodePlan], axes: Axes, data: tuple[str, ...]):
    """The inserted collectives that gather a batch-dependent value over a data axis in forward (an
    all-gather or all-to-all there): from that op on every rank of the axis computes the whole batch.
    A gather into the graph's output (a returned activation) collapses no computation and is left out, and
    so is one over `cp` of integers nothing differentiates (token ids, labels, positions: a model that
    shifts its labels along the sequence, as transformers' loss does, reads the neighbouring rank's first
    label; B·S integers, in the plan). Returns `(spec, axis, no_rule)` for each."""
    batch = batch_dependence(plans, axes)
    by_name = {n.name: n for n in plans}
    out = []
    for spec in specs:
        node = by_name.get(spec.producer)
        consumer = by_name.get(spec.consumer)
        if node is None or consumer is None or consumer.op == "output":
            continue
        for k, axis, _a, _b in spec.steps(axes, "forward"):
            i = axes.names.index(axis)
            bookkeeping = axis == CP_AXIS and not spec.dtype.is_floating_point and not spec.requires_grad
            if axis in data and k in ("all_gather", "all_to_all") and batch[node][i] and not bookkeeping:
                out.append((spec, axis, plans[consumer].replicated_fallback))
    return out


REGATHER, RERUN = "again in backward: a saver keeps the shard", "again: the recomputed layer runs it"


def collective_records(specs: list[CommSpec], axes: Axes, remat=None) -> list[dict]:
    """Per-step collectives with bytes per rank (payload: the value on one rank with that axis whole).
    `remat` (a `modules.recompute.Remat`): the forward again under "recompute" for those a recomputed layer
    re-runs, and in backward for the all-gathers whose output backward gathers again."""
    out = []
    for spec in specs:
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        passes = [("forward", "forward", ""), ("backward", "backward", "")]  # (phase, the steps it runs, why)
        if remat is not None and spec.name in remat.rerun:
            passes.append(("recompute", "forward", RERUN))
        if remat is not None and spec.name in remat.regather:
            passes.append(("backward", "forward", REGATHER))
        for phase, step_phase, why in passes:
            moving = {axis: k for k, axis, _, _ in spec.steps(axes, step_phase)}
            frm, to = (spec.src, spec.dst) if step_phase == "forward" else (spec.grad_dst, spec.grad_target())
            lay = list(frm)  # as the runtime steps: each axis moves the value the steps before it left
            for axis, a, b in step_order([(x, a, b) for x, a, b in zip(axes.names, frm, to) if a != b]):
                before, lay[axes.names.index(axis)] = tuple(lay), b
                k = moving.get(axis)
                if k is None:
                    continue
                n = dict(zip(axes.names, axes.sizes))[axis]
                payload = math.prod(_moved_shape(spec.shape, before, axes, axis, a, b)) * itemsize
                reason = f"{a!r}->{b!r}" + (f" ({why})" if why else "")
                out.append(
                    dict(
                        kind=k, axes=(axis,), bytes=int(payload), node=spec.producer, op=spec.op, source=spec.source,
                        reason=reason, phase=phase, group=n, bus=bus_bytes(k, payload, n), consumer=spec.consumer,
                    )
                )  # fmt: skip
    return out


def step_order(pairs: list) -> list:
    """The order a redistribution's `(axis, from, to)` steps run in: reductions first, then gathers from the
    innermost axis out (a dim two axes cut is whole over the inner one first), then slices and swaps."""
    red = [p for p in pairs if isinstance(p[1], Partial)]
    gat = [p for p in pairs if isinstance(p[1], Shard) and not isinstance(p[2], Shard)][::-1]
    rest = [p for p in pairs if p not in red and p not in gat]
    return red + gat + rest


def _moved_shape(shape, layout: Layout, axes: Axes, axis: str, a, b) -> list[int]:
    """The value one step on `axis` moves per rank: the other axes' shards cut (the largest piece), this
    axis whole, a dim it cuts unevenly padded to equal pieces (as `runtime.comm.moved_bytes`)."""
    out = list(shape)
    n = 1
    for name, p, size in zip(axes.names, layout, axes.sizes):
        if name == axis:
            n = size
        elif isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // size)
    for p in (a, b):
        if isinstance(p, Shard):
            out[p.dim] = moved_size(p, out[p.dim], n)
    return out


__all__ = ["CommSpec", "collective_records", "data_gathers", "insert_comms", "R", "step_order"]
