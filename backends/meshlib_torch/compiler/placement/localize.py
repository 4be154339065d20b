"""Localize: make every node compute on the shard its rank holds.

- Shape arithmetic is folded to the global constants it had when traced.
- Views, expands and splits get the local shapes of their chosen layouts.
- A mean over a sharded dim becomes that shard's share of the global mean.
- A slice that takes one part of a dim held in parts (a fused qkv's q) takes that part's block.
- A parameter is read through `to_local()` (its gradient flows back to the DTensor).
- Ops whose local form depends on the rank become `call_module op<i>` nodes:
  a vocab-parallel embedding and a sharded cross-entropy.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .bind import aten, bind, dims_arg
from .parts import local_part_bounds, part_cut
from .placements import Partial, Pending, Shard
from .propagate import Axes, NodePlan
from .shapes import local_shape, ragged_dims


@dataclass(frozen=True)
class SpecialSpec:
    """A rank-dependent op, built with the process groups at run time."""

    name: str
    kind: str  # "vocab_embedding" | "cross_entropy"
    args: dict = field(default_factory=dict)


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
    gm.graph.eliminate_dead_code()


def localize(gm: fx.GraphModule, plans: dict[fx.Node, NodePlan], axes: Axes, params: set[str]) -> list[SpecialSpec]:
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
        elif kind == "embedding" and any(w == Shard(0) and not isinstance(i, Shard) for i, w in zip(*plan.need)):
            _special(gm, node, specials, "vocab_embedding", _vocab_args(plan, axes), plan.view.tensors)
        elif kind == "cross_entropy" and any(isinstance(p, Shard) for p in plan.need[0]):
            _special(gm, node, specials, "cross_entropy", _ce_args(plan, axes), plan.view.tensors)
    gm.graph.eliminate_dead_code()
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
        if ragged:  # a dim whose size differs by rank keeps the input's size, read when it runs
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


def _vocab_args(plan: NodePlan, axes: Axes) -> dict:
    axis = next(a for a, i, w in zip(axes.names, *plan.need) if w == Shard(0) and not isinstance(i, Shard))
    vocab = plan.view.shape(plan.view.tensors[1])[0]
    return {"axis": axis, "vocab": vocab, "ways": _sizes(axes)[axis], "padding_idx": padding_row(plan.view, vocab)}


def padding_row(view, vocab: int) -> int | None:
    """The row an embedding's `padding_idx` names (its gradient stays zero), or None. `F.embedding` counts
    a negative one from the end, as `nn.Embedding` does; ATen's `embedding` takes -1 for none (F.embedding
    normalises before calling it) and never matches another negative one."""
    pad = view.p.get("padding_idx")
    if pad is None or pad < 0 and view.p.get("_target") is aten.embedding.default:
        return None
    return pad + vocab if pad < 0 else pad


def _ce_args(plan: NodePlan, axes: Axes) -> dict:
    logits = plan.need[0]
    reduction = plan.view.p.get("reduction", "mean")
    reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    vocab = [a for a, p in zip(axes.names, logits) if p == Shard(1)]
    rows = [a for a, p in zip(axes.names, logits) if isinstance(p, Shard) and p.dim == 0]
    n_classes = plan.view.shape(plan.view.tensors[0])[1]
    vocab_size = math.prod(_sizes(axes)[a] for a in vocab)
    local = local_shape(plan.view.shape(plan.view.tensors[0]), logits, axes.sizes)
    val = plan.view.tensors[0].meta["val"]
    return {
        "rows_local": local[0],
        "itemsize": 4 if val.dtype in (torch.float16, torch.bfloat16) else val.element_size(),
        "vocab_axis": vocab[0] if vocab else None,
        "rows_axes": tuple(rows),
        "classes": n_classes,
        "vocab_ways": vocab_size,
        "reduction": reduction,
        "ignore_index": plan.view.p.get("ignore_index", -100),
        "output_partial": tuple(a for a, p in zip(axes.names, plan.out) if isinstance(p, Partial)),
        "count_from": count_recipe(plan.view.tensors[1]) if reduction == "mean" and rows else None,
    }


def count_recipe(target: fx.Node) -> dict | None:
    """How the loss's targets come from an input, when only views, casts, pads and slices of other dims
    than the batch's stand between: `{"input": name, "steps": [...]}`. Every rank holds the whole
    batch, so it counts the targets of every rank itself, with no all-reduce; None otherwise."""
    steps = []
    node = target
    while node.op != "placeholder":
        if node.op == "call_module" and node.meta.get("comm") is not None:  # moves rows, not their values
            node = node.args[0]
            continue
        view = bind(node)
        if view.kind == "pad" and len(view.p["pad"]) // 2 < len(view.shape(view.tensors[0])):
            steps.append(("pad", tuple(view.p["pad"]), view.p.get("value", 0)))
        elif view.kind == "slice" and view.p.get("_target") is aten.slice.Tensor and view.p.get("dim", 0) % len(
            view.out_shape
        ):
            p = view.p
            steps.append(("slice", p.get("dim", 0), p.get("start"), p.get("end"), p.get("step", 1)))
        elif view.kind not in ("view", "linear_unary") or not _integral(node):
            return None
        if not view.tensors:
            return None
        node = view.tensors[0]
    return {"input": node.target, "steps": tuple(reversed(steps))}


def _integral(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return torch.is_tensor(val) and not val.is_floating_point()


def _special(gm: fx.GraphModule, node: fx.Node, specials: list, kind: str, args: dict, inputs: list) -> None:
    name = f"op{len(specials)}"
    specials.append(SpecialSpec(name, kind, args))
    with gm.graph.inserting_before(node):
        gm.add_submodule(name, Pending(specials[-1]))
        new = gm.graph.create_node("call_module", name, tuple(inputs))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
