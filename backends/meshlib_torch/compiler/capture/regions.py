"""Grad-mode and autocast regions: torch.export's higher-order ops, inlined with their mode kept.

torch.export turns `with torch.no_grad():` (a rotary embedding's tables, say)
into `wrap_with_set_grad_enabled(False, submod, *inputs)` and `with
torch.autocast(...)` into `wrap_with_autocast(...)`, each calling a
subgraph. `inline_regions` copies every subgraph's nodes into the graph in
its place, so the compiler places and localizes them like any other op, and
records the mode on each copied node (`meta["region"]`, outermost first).

Both modes act op by op (grad mode decides whether each op is recorded for
backward; autocast picks each op's dtype when it runs), so running each
copied op under its region's modes (`in_region`) is the region itself.
`apply_regions` does that to an executable copy of a graph, once every pass
that reads the ops' targets is done. torch.fx's tracer records no modes at
all: it notes on each node the modes in force when the node was made, where
they differ from those the trace began with (`current_modes`).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx as fx

from ...torch_private import HigherOrderOperator
from .effects import eliminate_dead_code
from .source import source_line

_HOPS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}  # name -> index of the subgraph argument


def _hop_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, HigherOrderOperator):
        return target.name()
    return None


def _mode(name: str, args: tuple) -> tuple:
    if name == "wrap_with_set_grad_enabled":
        return ("grad", bool(args[0]))
    device, dtype, enabled, cache = args[:4]
    return ("autocast", device, dtype, bool(enabled), cache)


def inline_regions(gm: fx.GraphModule) -> None:
    """Replace every grad-mode and autocast higher-order op by its subgraph's nodes (nested ones too).

    Any other higher-order op raises, naming it and where the model uses it."""
    graph = gm.graph
    while True:
        hops = [n for n in graph.nodes if _hop_name(n) is not None]
        if not hops:
            break
        for node in hops:
            name = _hop_name(node)
            if name not in _HOPS:
                raise NotImplementedError(
                    f"the model uses torch's higher-order op {name!r} (node {node.name}, at "
                    f"{source_line(node) or 'an unknown line'}), which the compiler cannot place yet; it inlines "
                    f"{' and '.join(_HOPS)}. Fix: write that part of the forward without it"
                )
            _inline(gm, node, name)
    eliminate_dead_code(graph)
    for name, mod in list(gm.named_children()):
        if isinstance(mod, fx.GraphModule) and not any(
            n.op == "get_attr" and n.target == name for n in graph.nodes
        ):
            delattr(gm, name)


def _inline(gm: fx.GraphModule, node: fx.Node, name: str) -> None:
    graph = gm.graph
    k = _HOPS[name]
    sub_attr, inputs = node.args[k], node.args[k + 1 :]
    sub = getattr(gm, sub_attr.target)
    mode = _mode(name, node.args)
    outer = node.meta.get("region", ())
    env: dict[fx.Node, Any] = {}
    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for holder, value in zip(holders, inputs, strict=True):
        env[holder] = value
    result = None
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.node.map_arg(inner.args[0], lambda a: env[a])
                continue
            if inner.op == "get_attr":  # a nested subgraph: lift it onto the outer module
                target = f"{sub_attr.target}_{inner.target}"
                gm.add_submodule(target, getattr(sub, inner.target))
                copy = graph.get_attr(target)
            else:
                copy = graph.node_copy(inner, lambda a: env[a])
            copy.meta = dict(inner.meta)
            copy.meta["region"] = outer + (mode,) + tuple(inner.meta.get("region", ()))
            if "stack_trace" not in copy.meta and "stack_trace" in node.meta:
                copy.meta["stack_trace"] = node.meta["stack_trace"]
            env[inner] = copy
    outs = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        node.replace_all_uses_with(result)
    graph.erase_node(node)


def current_modes() -> tuple:
    """The grad mode and autocast states in force now, as region modes (what torch.fx's tracer sees
    while a `with torch.no_grad():` or `with torch.autocast(...)` block of the forward runs)."""
    out: list[tuple] = []
    if not torch.is_grad_enabled():
        out.append(("grad", False))
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            out.append(("autocast", device, torch.get_autocast_dtype(device), True, torch.is_autocast_cache_enabled()))
    return tuple(out)


def _context(mode: tuple):
    if mode[0] == "grad":
        return torch.set_grad_enabled(mode[1])
    _, device, dtype, enabled, cache = mode
    return torch.autocast(device, dtype, enabled, cache)


def in_region(modes: tuple, fn):
    """`fn` run under `modes` (a region's grad mode and autocast), as one callable for an fx node."""

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(_context(mode))
            return fn(*args, **kwargs)

    run.__name__ = f"in_region_{getattr(fn, '__name__', 'op')}".replace(".", "_")
    return run


def run_node_in_region(node: fx.Node, run):
    """`run()` under the node's region modes (for interpreters that run the graph node by node)."""
    modes = node.meta.get("region", ())
    if not modes:
        return run()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(_context(mode))
        return run()


def apply_regions(graph: fx.Graph) -> None:
    """Make each node of a region run under its modes (in place; the graph is an executable copy)."""
    for node in graph.nodes:
        modes = node.meta.get("region")
        if modes and node.op == "call_function":
            node.target = in_region(modes, node.target)


__all__ = ["apply_regions", "current_modes", "in_region", "inline_regions", "run_node_in_region"]
