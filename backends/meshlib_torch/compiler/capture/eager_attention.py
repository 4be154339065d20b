"""Attention written out as ops, found in a traced graph: softmax(Q Kᵀ · scale + mask) V.

transformers' "eager" attention (and many hand-written models) compute attention without SDPA:

    w = matmul(q, k.transpose(2, 3)) * scale      (or / sqrt(d); scale 1 without either)
    w = w + mask                                   (optional: an additive mask; or w.masked_fill(hidden, -inf))
    w = softmax(w, dim=-1, dtype=float32).to(q.dtype)
    w = dropout(w, p=0.0)                          (optional, p must be 0)
    y = matmul(w, v)

On a sequence split over `cp`, `Q Kᵀ` would need every key on every rank. `eager_calls` finds the pattern
(by each node's op name, so fx's and torch.export's graphs alike) and puts one `cp_sdpa` call in place of
the last matmul, so it becomes a region like any SDPA call. The region computes in fp32 (fp64 for fp64
inputs), as the softmax's upcast does. q, k and v must be 4-D, (B, H, S, D).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .kv import op_name, shape_of

__all__ = ["eager_calls"]

_CASTS = ("to", "type_as", "float", "_to_copy", "type")


def eager_calls(gm: fx.GraphModule, cp_sdpa, where) -> int:
    """Replace each written-out attention of `gm` by a `cp_sdpa` call (`where(node)`: its source line);
    return how many were found."""
    found = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        q, k, v, mask, scale = match
        with gm.graph.inserting_before(node):
            if isinstance(mask, tuple):  # masked_fill's condition: where a score is hidden
                mask = gm.graph.call_function(torch.logical_not, (mask[1],))
                mask.meta["val"] = torch.empty(shape_of(mask.args[0]), dtype=torch.bool, device="meta")
            kwargs = {"causal": False, "scale": scale, "where": where(node)}
            call = gm.graph.call_function(cp_sdpa, (q, k, v, mask), kwargs)
        call.meta = dict(node.meta)
        chain = node.args[0]
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        while op_name(chain) in _CASTS or op_name(chain) == "dropout":  # a dropout counts as impure for fx's DCE
            if chain.users:
                break
            up = chain.args[0]
            gm.graph.erase_node(chain)
            chain = up
        found += 1
    return found


def _match(node: fx.Node):
    """(q, k, v, mask or None, scale) when `node` is the last matmul of the pattern; else None."""
    if op_name(node) not in ("matmul", "__matmul__") or len(node.args) != 2:
        return None
    w, v = node.args
    while op_name(w) in _CASTS or (op_name(w) == "dropout" and _no_dropout(w)):
        w = w.args[0]
    if op_name(w) not in ("softmax", "_softmax") or not _last_dim(w):
        return None
    x, mask = w.args[0], None
    if op_name(x) in ("add", "__add__", "iadd") and len(x.args) == 2:
        x, mask = _scores_and_other(x)
        if x is None:
            return None
    elif op_name(x) == "masked_fill" and len(x.args) == 3 and _blocks(x.args[2]) and isinstance(x.args[1], fx.Node):
        x, mask = x.args[0], ("not", x.args[1])  # filled where the condition holds: attend where it does not
    scale = 1.0
    if op_name(x) in ("mul", "__mul__", "div", "truediv", "__truediv__") and isinstance(x.args[1], (int, float)):
        scale = float(x.args[1]) if op_name(x) in ("mul", "__mul__") else 1 / float(x.args[1])
        x = x.args[0]
    if op_name(x) not in ("matmul", "__matmul__") or len(x.args) != 2:
        return None
    q, kt = x.args
    k = _untransposed(kt)
    shapes = [shape_of(t) for t in (q, k, v)]
    if k is None or any(s is None or len(s) != 4 for s in shapes) or not math.isfinite(scale):
        return None
    return q, k, v, mask, scale


def _blocks(value) -> bool:
    """A fill no score survives: -inf, or at most -1e30 (a dtype's lowest, as models write it)."""
    return isinstance(value, (int, float)) and value <= -1e30


def _scores_and_other(add: fx.Node):
    a, b = add.args
    for scores, other in ((a, b), (b, a)):
        if op_name(scores) in ("mul", "__mul__", "div", "truediv", "__truediv__", "matmul", "__matmul__"):
            return scores, other if isinstance(other, fx.Node) else None
    return None, None


def _no_dropout(node: fx.Node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", node.kwargs.get("training", True))
    return p == 0 or train is False


def _last_dim(node: fx.Node) -> bool:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    shape = shape_of(node)
    return isinstance(dim, int) and shape is not None and dim % len(shape) == len(shape) - 1


def _untransposed(kt) -> fx.Node | None:
    """k where `kt` is k (B, H, S, D) with its last two dims swapped."""
    if op_name(kt) != "transpose" or not isinstance(kt.args[0], fx.Node):
        return None
    k = kt.args[0]
    shape = shape_of(k)
    if shape is None or len(shape) != 4:
        return None
    dims = {d % 4 for d in kt.args[1:3]} if len(kt.args) >= 3 else set()
    return k if dims == {2, 3} else None

