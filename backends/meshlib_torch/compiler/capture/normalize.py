"""Normalize: one vocabulary for every later pass, whichever tracer made the graph.

- leaf modules (Linear, Embedding, LayerNorm, RMSNorm, activations, Dropout)
  become functional calls on `get_attr` parameters;
- parameters are named by their canonical FQN (tied weights share one name);
- a Linear's bias becomes its own `add`, and `addmm(bias, x, w)` (Hugging
  Face's Conv1D) `mm(x, w) + bias`, so that a row-parallel product adds its
  bias once, after the sum (under autocast the bias is cast to the autocast
  dtype, as the fused op would);
- `x.view(-1, k) @ w`, viewed back, becomes `x @ w` on `x` as it is, so that a
  sequence shard survives it;
- a move to the tracing device (export's `to.dtype_layout` from `x.to(device)`,
  which also names the dtype `x` had when traced) keeps `x` as it is, and a cast
  that also names a device keeps only its dtype: every rank computes on one
  device, and under bf16 compute such a move must not cast back to fp32;
- a fresh tensor filled by `copy_` into slices of one dim that cover it (DeepSeek's MLA keys) becomes
  the `cat` of what was copied: the passes see values, not writes through views.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..attrs import has_attr, resolve, set_attr


def _get_attr(graph: fx.Graph, node: fx.Node, prefix: str, name: str) -> fx.Node | None:
    with graph.inserting_before(node):
        return graph.get_attr(f"{prefix}.{name}" if prefix else name)


def _module_call(graph: fx.Graph, node: fx.Node, mod: nn.Module) -> tuple | None:
    """(function, args, kwargs) replacing a call to leaf module `mod`, or None to drop it."""
    x, prefix = node.args[0], node.target
    attr = lambda name: _get_attr(graph, node, prefix, name)  # noqa: E731
    if isinstance(mod, nn.Linear):
        return F.linear, (x, attr("weight"), attr("bias") if mod.bias is not None else None), {}
    if isinstance(mod, nn.Embedding):
        return F.embedding, (x, attr("weight")), {"padding_idx": mod.padding_idx}
    if isinstance(mod, nn.LayerNorm):
        w = attr("weight") if mod.weight is not None else None
        b = attr("bias") if mod.bias is not None else None
        return F.layer_norm, (x, tuple(mod.normalized_shape), w, b, mod.eps), {}
    if isinstance(mod, nn.RMSNorm):
        w = attr("weight") if mod.weight is not None else None
        return F.rms_norm, (x, tuple(mod.normalized_shape), w, mod.eps), {}
    if isinstance(mod, nn.Dropout):
        return (F.dropout, (x, mod.p, mod.training), {}) if mod.p > 0 and mod.training else None
    if isinstance(mod, nn.Identity):
        return None
    simple = {nn.GELU: F.gelu, nn.SiLU: F.silu, nn.ReLU: F.relu, nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid}
    for cls, fn in simple.items():
        if type(mod) is cls:
            kwargs = {"approximate": mod.approximate} if cls is nn.GELU else {}
            return fn, (x,), kwargs
    raise NotImplementedError(
        f"module {prefix!r} of type {type(mod).__name__} is a tracing leaf the compiler has no rule for. "
        "Fix: write it with torch functions the compiler knows, or file an issue with the module"
    )


def inline_leaf_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = model.get_submodule(node.target)
        call = _module_call(graph, node, mod)
        if call is None:
            node.replace_all_uses_with(node.args[0])
        else:
            fn, args, kwargs = call
            with graph.inserting_before(node):
                new = graph.call_function(fn, args, kwargs)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
        graph.erase_node(node)
    # get_attr targets on the original model (fx path) must exist on gm
    for node in graph.nodes:
        if node.op == "get_attr" and not has_attr(gm, node.target):
            set_attr(gm, node.target, resolve(model, node.target))


def canonicalize_attrs(gm: fx.GraphModule, aliases: dict[str, str]) -> None:
    """One get_attr node per parameter, named by its canonical FQN."""
    seen: dict[str, fx.Node] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        target = aliases.get(node.target, node.target)
        if target in seen:
            node.replace_all_uses_with(seen[target])
            graph.erase_node(node)
            continue
        if target != node.target:
            if not has_attr(gm, target):
                set_attr(gm, target, resolve(gm, node.target))
            node.target = target
        node.meta["param"] = target in aliases.values()
        seen[target] = node


def split_linear_bias(gm: fx.GraphModule) -> None:
    graph = gm.graph
    linears = {F.linear, torch.ops.aten.linear.default}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in linears:
            args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
            bias = args[2]
            if bias is None:
                continue
            node.args, node.kwargs = (args[0], args[1]), {}
            with graph.inserting_after(node):
                add = graph.call_function(operator.add, (node, _autocast_bias(graph, node, bias)))
            add.meta = {k: v for k, v in node.meta.items() if k != "val"}
            node.replace_all_uses_with(add, delete_user_cb=lambda user, add=add: user is not add)


def _autocast_bias(graph: fx.Graph, op: fx.Node, bias: fx.Node) -> fx.Node:
    """The bias an op split from its bias adds: under autocast the fused op ran in the autocast dtype,
    so the bias is cast to it (else the add would promote the result back to fp32)."""
    dtype = next((m[2] for m in op.meta.get("region", ()) if m[0] == "autocast" and m[3]), None)
    if dtype is None:
        return bias
    with graph.inserting_before(op):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (bias,), {"dtype": dtype})
    cast.meta = {k: v for k, v in op.meta.items() if k != "val"}
    return cast


def split_addmm(gm: fx.GraphModule) -> None:
    """`addmm(bias, x, w)` (Hugging Face's Conv1D) becomes `mm(x, w) + bias`: the bias is added once,
    after a row-parallel product's sum, as with a Linear's."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.addmm, torch.ops.aten.addmm.default):
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            continue
        bias, x, w = node.args
        with graph.inserting_before(node):
            mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
            mm.meta = {k: v for k, v in node.meta.items() if k != "val"}
            add = graph.call_function(torch.ops.aten.add.Tensor, (mm, _autocast_bias(graph, mm, bias)))
        add.meta = dict(mm.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)


def unflatten_matmuls(gm: fx.GraphModule) -> None:
    """`x.view(-1, k) @ w (+ b)`, viewed back to `(*x.shape[:-1], n)` (Hugging Face's Conv1D), becomes
    `x @ w (+ b)` on `x` as it is: flattening batch and sequence into one dim would make a sequence
    shard (sequence parallelism) unsplittable, and gather it for nothing."""
    mms = {torch.ops.aten.mm.default, torch.mm}
    adds = {torch.ops.aten.add.Tensor, operator.add, torch.add}
    graph = gm.graph
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in mms]:
        flat, w = mm.args
        if not (isinstance(flat, fx.Node) and len(flat.users) == 1 and _is_view(flat) and len(mm.users) == 1):
            continue
        x = flat.args[0]
        shape = tuple(x.meta["val"].shape)
        if len(shape) < 3:
            continue
        last, add = next(iter(mm.users)), None
        if last.op == "call_function" and last.target in adds and len(last.users) == 1:
            add, last = last, next(iter(last.users))
        if not (_is_view(last) and tuple(last.meta["val"].shape)[:-1] == shape[:-1]):
            continue
        with graph.inserting_before(last):
            new = graph.call_function(torch.ops.aten.matmul.default, (x, w))
            new.meta = {**mm.meta, "val": last.meta["val"]}
            if add is not None:
                bias = add.args[1] if add.args[0] is mm else add.args[0]
                new = graph.call_function(torch.ops.aten.add.Tensor, (new, bias))
                new.meta = {**add.meta, "val": last.meta["val"]}
        last.replace_all_uses_with(new)
        for old in (last, add, mm, flat):
            if old is not None:
                graph.erase_node(old)
    graph.lint()
    gm.recompile()


def _is_view(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in (
        torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
        "view", "reshape", torch.reshape,
    )  # fmt: skip



def drop_device_moves(gm: fx.GraphModule) -> None:
    """Export's device arguments are the tracing device's; see the module docstring."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        x = node.args[0]
        traced = x.meta.get("val")
        if node.target is aten.to.dtype_layout and "device" in node.kwargs:
            if torch.is_tensor(traced) and node.kwargs.get("dtype") in (None, traced.dtype):
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
                continue
            new = (aten.to.dtype, (x, node.kwargs["dtype"]))
        elif node.target is aten.to.device and len(node.args) > 2:
            new = (aten.to.dtype, (x, node.args[2]))
        elif node.target is aten._to_copy.default and "device" in node.kwargs:
            new = (aten._to_copy.default, node.args, {k: v for k, v in node.kwargs.items() if k != "device"})
        else:
            continue
        with gm.graph.inserting_before(node):
            moved = gm.graph.call_function(*new)
        moved.meta = dict(node.meta)
        node.replace_all_uses_with(moved)
        gm.graph.erase_node(node)


_FRESH = {
    torch.ops.aten.new_empty.default, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
}  # fmt: skip


def cat_filled_buffers(gm: fx.GraphModule) -> None:
    """`k = x.new_empty(...); k[..., :a].copy_(p); k[..., a:].copy_(q)`, then k read (torch.export keeps
    the writes through views as they are), becomes `k = cat([p, q], -1)` where the slices of one dim
    cover k exactly, each copied into once from a value of its shape and dtype, before k is read."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for buf in [n for n in graph.nodes if n.op == "call_function" and n.target in _FRESH]:
        found = _filled(buf, order)
        if found is None:
            continue
        dim, pieces = found
        last = max((copy for _, copy in pieces), key=order.__getitem__)
        with graph.inserting_after(last):
            cat = graph.call_function(torch.ops.aten.cat.default, ([copy.args[1] for _, copy in pieces], dim))
        cat.meta = {k: v for k, v in last.meta.items() if k != "val"}
        views = {view for view, _ in pieces}
        buf.replace_all_uses_with(cat, delete_user_cb=lambda user, views=views: user not in views)
        for view, copy in pieces:
            graph.erase_node(copy)
            graph.erase_node(view)
        graph.erase_node(buf)


def _filled(buf: fx.Node, order: dict) -> tuple[int, list[tuple[fx.Node, fx.Node]]] | None:
    """`(dim, [(slice, copy_)] in order along dim)` when `buf` is filled as `cat_filled_buffers` says."""
    val = buf.meta.get("val")
    if not torch.is_tensor(val) or val.dim() == 0:
        return None
    views = [u for u in buf.users if u.target is torch.ops.aten.slice.Tensor and u.args[0] is buf]
    readers = [u for u in buf.users if u not in views]
    pieces, dims = [], set()
    for view in views:
        copy = next(iter(view.users)) if len(view.users) == 1 else None
        if copy is None or copy.target is not torch.ops.aten.copy_.default or copy.args[0] is not view or copy.users:
            return None
        src = copy.args[1].meta.get("val") if isinstance(copy.args[1], fx.Node) else None
        if not torch.is_tensor(src) or src.shape != view.meta["val"].shape or src.dtype != val.dtype:
            return None
        dim, start, _, step = list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1 :]
        dim %= val.dim()
        start = start or 0
        dims.add(dim)
        pieces.append((start if start >= 0 else max(0, start + val.shape[dim]), step, view, copy))
    if len(dims) != 1 or any(step != 1 for _, step, _, _ in pieces):
        return None
    dim = dims.pop()
    pieces.sort(key=lambda p: p[0])
    at = 0
    for start, _, view, _ in pieces:
        if start != at:
            return None
        at += view.meta["val"].shape[dim]
    last = max(order[copy] for *_, copy in pieces)
    if at != val.shape[dim] or any(order[r] < last for r in readers):
        return None
    return dim, [(view, copy) for _, _, view, copy in pieces]


__all__ = [
    "canonicalize_attrs", "cat_filled_buffers", "drop_device_moves", "inline_leaf_modules", "split_addmm",
    "split_linear_bias", "unflatten_matmuls",
]  # fmt: skip
