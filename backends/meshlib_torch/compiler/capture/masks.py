"""An attention mask that is a constant of the model, recognised by its value.

transformers builds the causal mask from the positions (`masking_utils.sdpa_mask`) whenever it is traced,
where an eager run would pass `is_causal=True` instead: it cannot tell that no padding mask will come. Such a
mask depends on no input (the folded shapes aside), so it can be computed once while compiling, on the CPU,
and compared with the causal pattern. Recognised, the call runs as causal attention: context parallelism
then moves and stores no mask and skips the blocks a causal mask hides entirely.

`causal_calls(gm)` does the same without context parallelism: each attention call given such a mask runs
with `is_causal=True` (or no mask) instead, so the kernel keeps no (batch, heads, S, S) mask for backward, as
the eager model would run it; the plan says how many.

`constant_mask(gm, node)` is "causal" (True on and below the diagonal, or 0 there and a value that no score
survives above it: -inf, or at most half the dtype's lowest), "none" (every key allowed everywhere),
or None (it reads an input or a parameter, is larger than `LIMIT` elements, or is any other mask).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..attrs import has_attr, resolve

__all__ = ["LIMIT", "causal_calls", "constant_mask"]

LIMIT = 1 << 26  # elements a mask (or any value it is computed from) may have to be evaluated while compiling


def constant_mask(gm: fx.GraphModule, node: fx.Node) -> str | None:
    value = _evaluate(gm, node)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return None
    s = value.shape[-1]
    lower = torch.ones(s, s, dtype=torch.bool).tril().expand(value.shape)
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        low = torch.finfo(value.dtype).min / 2
        blocked = (value == float("-inf")) | (value <= low)
        if not bool(((value == 0) | blocked).all()):
            return None
        allowed = value == 0
    else:
        return None
    if bool(allowed.all()):
        return "none"
    return "causal" if bool((allowed == lower).all()) else None


_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_MASK, _CAUSAL = 3, 5  # the positions of attn_mask and is_causal in the call's signature


def causal_calls(gm: fx.GraphModule) -> int:
    """Each `scaled_dot_product_attention` call of `gm` given a mask that `constant_mask` finds causal (or
    allowing every key) runs with `is_causal=True` (or no mask) instead. Returns how many calls changed."""
    from .effects import eliminate_dead_code

    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        mask = args[_MASK] if len(args) > _MASK else kwargs.get("attn_mask")
        causal = args[_CAUSAL] if len(args) > _CAUSAL else kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or causal is not False or (kind := constant_mask(gm, mask)) is None:
            continue
        for index, name, value in ((_MASK, "attn_mask", None), (_CAUSAL, "is_causal", kind == "causal")):
            if len(args) > index:
                args[index] = value
            else:
                kwargs[name] = value
        node.args, node.kwargs = tuple(args), kwargs
        changed += 1
    if changed:
        eliminate_dead_code(gm.graph)
        gm.recompile()
    return changed


def _evaluate(gm: fx.GraphModule, node: fx.Node):
    """The value of `node` computed on the CPU from its ancestors, or None where one of them is an input, a
    parameter or buffer that holds no values (meta), a region, or too large."""
    needed, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        val = n.meta.get("val")
        if n.op in ("placeholder", "call_module", "output") or (isinstance(val, torch.Tensor) and val.numel() > LIMIT):
            return None
        if n.op == "get_attr":
            attr = resolve(gm, n.target) if has_attr(gm, n.target) else None
            if not isinstance(attr, torch.Tensor) or attr.is_meta or attr.requires_grad:
                return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
            env[n].args = fx.node.map_aggregate(env[n].args, _on_cpu)
            env[n].kwargs = fx.node.map_aggregate(env[n].kwargs, _on_cpu)
    graph.output(env[node])
    try:
        with torch.no_grad():
            return fx.GraphModule(gm, graph)()
    except Exception:  # an op that cannot run here: the mask is then not recognised, and kept as it is
        return None


def _on_cpu(a):
    return torch.device("cpu") if isinstance(a, torch.device) else a
