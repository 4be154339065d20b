"""Keys and values repeated to the query heads before attention, found in a traced graph.

Grouped-query attention gives Hkv < Hq key/value heads; query head h reads head h // (Hq/Hkv). Models
that call SDPA without `enable_gqa` repeat the keys and values to Hq heads first, each head r = Hq/Hkv
times in place, in one of two ways:

- `x.repeat_interleave(r, dim=1)` (the bundled Llama);
- transformers' `repeat_kv`: `x[:, :, None, :, :].expand(B, Hkv, r, S, D).reshape(B, Hkv * r, S, D)` (under
  torch.export the index is `aten.unsqueeze(x, 2)`).

Both give head h of the result = head h // r of `x`. `repeated(node)` returns `(x, r)` for either, checked
against every value's shape (`meta["val"]`), so attention over `cp` can move the Hkv heads alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["op_name", "repeated", "shape_of"]

_WHOLE = slice(None, None, None)
_LIFTS = ((_WHOLE, _WHOLE, None), (_WHOLE, _WHOLE, None, _WHOLE, _WHOLE))  # x[:, :, None] and x[:, :, None, :, :]


def repeated(node) -> tuple[fx.Node, int] | None:
    """`(source, repeats)` when `node` (B, H, S, D) is `source` (B, H/r, S, D) with each head repeated r times
    in place by one of the two patterns above; else None."""
    out = shape_of(node)
    if out is None or len(out) != 4:
        return None
    name = op_name(node)
    if name == "repeat_interleave":
        src = node.args[0]
        reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        fits = isinstance(reps, int) and reps > 0 and out[1] % reps == 0 and dim in (1, -3)
        return (src, reps) if fits and shape_of(src) == (out[0], out[1] // reps, *out[2:]) else None
    if name not in ("reshape", "view") or op_name(node.args[0]) != "expand":
        return None
    lifted = node.args[0].args[0]
    if not isinstance(lifted, fx.Node) or not (lifted.target is operator.getitem or op_name(lifted) == "unsqueeze"):
        return None
    src, index = lifted.args[:2]
    shape = shape_of(src)
    inserted = index == 2 if op_name(lifted) == "unsqueeze" else index in _LIFTS
    if shape is None or len(shape) != 4 or not inserted:
        return None
    b, h, s, d = shape
    r = out[1] // h if out[1] % h == 0 else 0
    return (src, r) if r and shape_of(node.args[0]) == (b, h, r, s, d) and out == (b, h * r, s, d) else None


def op_name(node) -> str:
    """The op a node calls, by name ("matmul", "softmax", ...), for fx's and torch.export's graphs alike; "" for
    anything but a call."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return ""
    if isinstance(node.target, str):
        return node.target
    packet = getattr(node.target, "overloadpacket", None)  # an aten op (torch.export): its name without overload
    return getattr(packet or node.target, "__name__", "")


def shape_of(node) -> tuple[int, ...] | None:
    """A node's tensor shape (its `meta["val"]`), or None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
