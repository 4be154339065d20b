"""Localize: make every node compute on the shard its rank holds.

- Shape arithmetic is folded to the global constants it had when traced.
- Views, expands and splits get the local shapes of their chosen layouts.
- A mean over a sharded dim becomes that shard's share of the global mean.
- A slice that takes one part of a dim held in parts (a fused qkv's q) takes that part's block.
- A parameter is read through `to_local()` (its gradient flows back to the DTensor).
- Ops whose local form depends on the rank become `call_module op<i>` nodes, one kind per entry of
  `rank_ops.RANK_OPS`: a vocab-parallel embedding, a sharded cross-entropy, a region of per-shard code.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..capture.effects import as_buffer_writes, eliminate_dead_code
from .bind import bind, dims_arg
from .parts import local_part_bounds, part_cut
from .placements import Pending, Shard
from .propagate import Axes, NodePlan
from .rank_ops import RANK_OPS, SpecialSpec, rank_op
from .shapes import local_shape, ragged_dims


def _sizes(axes: Axes) -> dict[str, int]:
    return dict(zip(axes.names, axes.sizes))


def fold_scalars(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        kind = bind(node).kind
        if kind == "drop":
            gm.graph.erase_node(node)
        elif kind == "scalar" and node.op != "placeholder":
            value = node.meta["val"]
            value = tuple(value) if isinstance(value, torch.Size) else value
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a, value=value, node=node: value if a is node else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, value=value, node=node: value if a is node else a)
    eliminate_dead_code(gm.graph)


def localize(
    gm: fx.GraphModule, plans: dict[fx.Node, NodePlan], axes: Axes, params: set[str], data: tuple[str, ...] = ()
) -> list[SpecialSpec]:
    """Rewrite `gm` in place to compute on one rank's shards (`data`: the data-parallel axes, which a
    region of per-shard code leaves to the runtime); return the rank-dependent ops it made."""
    specials: list[SpecialSpec] = []
    for node in list(gm.graph.nodes):
        plan = plans.get(node)
        if plan is None:
            continue
        kind = plan.view.kind
        plan.view.tensors = bind(node).tensors if kind not in ("get_attr", "placeholder", "output") else []
        if kind == "get_attr" and node.target in params:
            _to_local(gm, node)
        elif kind in ("view", "expand"):
            _reshape(gm, node, plan, axes, "reshape" if kind == "view" else "expand")
        elif kind == "split":
            _split(gm, node, plan, axes)
        elif kind == "mean":
            _rescale_mean(gm, node, plan, axes)
        elif kind in ("slice", "index") and part_cut(plan.view, plan.need[0]) is not None:
            local_part_bounds(node, plan.view, plan.need[0], axes.sizes)
        elif (op := rank_op(plan)) is not None:
            _special(gm, node, specials, op, RANK_OPS[op].args(plan, axes, data), plan.view.tensors)
    as_buffer_writes(gm.graph)
    eliminate_dead_code(gm.graph)
    return specials


def _to_local(gm: fx.GraphModule, node: fx.Node) -> None:
    with gm.graph.inserting_after(node):
        local = gm.graph.call_method("to_local", (node,))
    local.meta = dict(node.meta)
    node.replace_all_uses_with(local, delete_user_cb=lambda u: u is not local)


def _local_out(plan: NodePlan, axes: Axes) -> tuple[int, ...]:
    return local_shape(plan.view.out_shape, plan.out, axes.sizes)


def _reshape(gm: fx.GraphModule, node: fx.Node, plan: NodePlan, axes: Axes, method: str) -> None:
    shape = _local_out(plan, axes)
    ragged = ragged_dims(plan.view.out_shape, plan.out, axes.sizes)
    with gm.graph.inserting_before(node):
        if ragged and method == "reshape" and len(ragged) == 1:  # the one dim whose size differs by rank: -1
            sizes = (-1 if d in ragged else n for d, n in enumerate(shape))
            new = gm.graph.call_method(method, (plan.view.tensors[0], *sizes))
        elif ragged:  # a dim whose size differs by rank keeps the input's size, read when it runs
            src = {o.dim: i.dim for i, o in zip(plan.need[0], plan.out) if isinstance(o, Shard) and o.dim in ragged}
            template = tuple(("dim", src[d]) if d in ragged else size for d, size in enumerate(shape))
            new = gm.graph.call_function(sized, (plan.view.tensors[0], method, template))
        else:
            new = gm.graph.call_method(method, (plan.view.tensors[0], *shape))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def sized(x: torch.Tensor, method: str, template: tuple) -> torch.Tensor:
    """`x.reshape(*shape)` or `x.expand(*shape)`, where an entry `("dim", d)` is `x`'s own size of dim d
    (a dim cut unevenly, whose size is this rank's)."""
    return getattr(x, method)(*(x.shape[t[1]] if isinstance(t, tuple) else t for t in template))


def share_of_mean(mean: torch.Tensor, x: torch.Tensor, dims: tuple[int, ...], total: int) -> torch.Tensor:
    """The mean of this rank's piece of `x` over `dims`, as its share of the mean over the whole (`total`
    elements): times the piece's count over the total; an empty piece adds nothing."""
    local = math.prod(x.shape[d] for d in dims)
    return mean * (local / total) if local else torch.zeros_like(mean)


def _split(gm: fx.GraphModule, node: fx.Node, plan: NodePlan, axes: Axes) -> None:
    nd = len(plan.view.shape(plan.view.tensors[0]))
    dim = (plan.view.p.get("dim") or 0) % nd
    sizes = [local_shape(tuple(t.shape), lay, axes.sizes)[dim] for t, lay in zip(plan.view.out, plan.out)]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.split, (plan.view.tensors[0], sizes), {"dim": dim})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _rescale_mean(gm: fx.GraphModule, node: fx.Node, plan: NodePlan, axes: Axes) -> None:
    """mean over a sharded dim: the local mean times local/global count (`share_of_mean` where the
    pieces differ by rank)."""
    x_layout = plan.need[0]
    nd = len(plan.view.shape(plan.view.tensors[0]))
    dims = dims_arg(plan.view.p, nd) or tuple(range(nd))
    ways = math.prod(n for p, n in zip(x_layout, axes.sizes) if isinstance(p, Shard) and p.dim in dims)
    if ways == 1:
        return
    shape = plan.view.shape(plan.view.tensors[0])
    with gm.graph.inserting_after(node):
        if ragged_dims(shape, x_layout, axes.sizes) & set(dims):
            total = math.prod(shape[d] for d in dims)
            scaled = gm.graph.call_function(share_of_mean, (node, plan.view.tensors[0], tuple(dims), total))
        else:
            scaled = gm.graph.call_function(operator.mul, (node, 1.0 / ways))
    scaled.meta = dict(node.meta)
    node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)


def _special(gm: fx.GraphModule, node: fx.Node, specials: list, kind: str, args: dict, inputs: list) -> None:
    name = f"op{len(specials)}"
    specials.append(SpecialSpec(name, kind, args))
    with gm.graph.inserting_before(node):
        gm.add_submodule(name, Pending(specials[-1]))
        new = gm.graph.create_node("call_module", name, tuple(inputs))
    new.meta = dict(node.meta)
    fn = args.get("fn")  # a region: named by its per-shard function in the plan's tables
    new.meta["op_name"] = getattr(fn, "__name__", None) or kind
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
