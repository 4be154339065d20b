"""Blocks: cut the local graph into the model's blocks, by module FQN.

The blocks are the children of the model's longest `nn.ModuleList` (a
transformer's layers). Each node belongs to the block in its
`nn_module_stack`; nodes the compiler added (collectives, `to_local`, the
rank-dependent ops) belong to their first consumer's block, but a collective
that shrinks its value (a reduce-scatter) belongs to its producer's. Nodes before the
first block form "pre" (embeddings), nodes after the last form "post" (the
final norm, the head, the loss). `split_graph` turns that into one submodule
per part, called in order by a small top-level graph: the unit that FSDP
shards and recompute wraps (`modules.recompute.Recompute`).
"""

from __future__ import annotations

import re

import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from ..attrs import resolve, set_attr
from ..placement.placements import Shard


def layer_paths(model: nn.Module) -> list[str]:
    """FQNs of the children of the model's longest ModuleList (`layers.0`, `layers.1`, ...)."""
    best: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > len(best):
            best = [f"{name}.{i}" if name else str(i) for i in range(len(mod))]
    return best


def _stack_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]


def _own_layer(node: fx.Node, index: dict[str, int]) -> int | None:
    for path in _stack_paths(node):
        m = re.match(r"^(.*?\.\d+)(\.|$)", path)
        if m and m.group(1) in index:
            return index[m.group(1)]
    return None


def partition(graph: fx.Graph, layers: list[str]) -> dict[fx.Node, int]:
    """Node -> part: 0 is "pre", 1..L the layers, L+1 "post"."""
    index = {path: i for i, path in enumerate(layers)}
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    has_stack = {n: any(_stack_paths(n)) for n in nodes}
    own = {n: _own_layer(n, index) for n in nodes if has_stack[n]}
    layered = [i for i, n in enumerate(nodes) if own.get(n) is not None]
    first, last = (layered[0], layered[-1]) if layered else (len(nodes), -1)
    parts: dict[fx.Node, int] = {}
    current = 0
    for i, node in enumerate(nodes):
        if not has_stack[node]:
            continue
        if own[node] is not None:
            current = max(current, own[node] + 1)
            parts[node] = current
        else:
            parts[node] = 0 if i < first else len(layers) + 1 if i > last else current
    for node in reversed(nodes):  # added nodes (collectives, to_local): where their first consumer runs
        if node not in parts:
            users = [parts[u] for u in node.users if u in parts]
            parts[node] = min(users) if users else len(layers) + 1
    for node in nodes:  # ... but a collective that shrinks its value runs where the value is made
        home = [parts[a] for a in node.all_input_nodes if a in parts]
        if _shrinks(node) and home:
            parts[node] = min(parts[node], home[0])
    return parts


def _shrinks(node: fx.Node) -> bool:
    """A collective whose output is a shard of its input (a reduce-scatter, a slice): Megatron's
    sequence-parallel boundary. Run with its producer, a layer hands the next one (and a recomputed
    layer keeps) the shard, not the whole value."""
    spec = node.meta.get("comm")
    if spec is None or spec.src == spec.dst:
        return False
    return all(a == b or (isinstance(b, Shard) and not isinstance(a, Shard)) for a, b in zip(spec.src, spec.dst))


def split_graph(gm: fx.GraphModule, parts: dict[str, int], n_layers: int) -> fx.GraphModule:
    """`gm` as submodules `pre`, `layer_<i>`, `post`, called in order by a top-level graph.

    `parts` maps node names to parts (from `partition`, made on the compiled
    graph; `gm` is a copy of it with the same node names).
    """
    names = {0: "pre", n_layers + 1: "post", **{i + 1: f"layer_{i}" for i in range(n_layers)}}
    # a node the partition never saw (a pipeline stage's own: the gradient-side of a value it
    # received) goes with the latest part it reads from, so that no part reads a later one
    assigned: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.name in parts:
            assigned[node.name] = parts[node.name]
        elif node.op in ("call_function", "call_method", "call_module"):
            ins = [assigned[a.name] for a in node.all_input_nodes if a.name in assigned]
            assigned[node.name] = max(ins) if ins else n_layers + 1

    def where(node: fx.Node) -> int:
        return assigned.get(node.name, n_layers + 1)

    top = split_module(gm, gm, where, keep_original_node_name=True)
    _move_parameters_into_parts(top)
    for name, mod in list(top.named_children()):
        if not re.fullmatch(r"submod_\d+", name):
            continue
        k = int(name.removeprefix("submod_"))
        delattr(top, name)
        top.add_module(names[k], mod)
        for node in top.graph.nodes:
            if node.op == "call_module" and node.target == name:
                node.target = names[k]
    top.recompile()
    return top


def _move_parameters_into_parts(top: fx.GraphModule) -> None:
    """split_module passes parameters to the parts as arguments and keeps them on the top module.
    Move each one used by a single part into that part (same dotted name), so that the part owns
    it: FSDP2 shards per part, and recompute sees it as the part's own."""
    graph = top.graph
    changed = {}
    for node in list(graph.nodes):
        if node.op != "get_attr" or not isinstance(resolve(top, node.target), nn.Parameter):
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_module" or list(users[0].args).count(node) != 1:
            continue  # shared (a tied weight): it stays with the top module
        call = users[0]
        part = top.get_submodule(call.target)
        i = list(call.args).index(node)
        holder = [n for n in part.graph.nodes if n.op == "placeholder"][i]
        set_attr(part, node.target, resolve(top, node.target))
        with part.graph.inserting_before(holder):
            attr = part.graph.get_attr(node.target)
        attr.meta = dict(holder.meta)
        holder.replace_all_uses_with(attr)
        part.graph.erase_node(holder)
        changed[call.target] = part
        call.args = tuple(a for j, a in enumerate(call.args) if j != i)
        graph.erase_node(node)
        _del_attr(top, node.target)
    for part in changed.values():  # once per part: generating a part's code is the slow step
        part.recompile()
    graph.lint()


def _del_attr(root: nn.Module, target: str) -> None:
    *parents, last = target.split(".")
    mod = root
    for part in parents:
        mod = getattr(mod, part)
    delattr(mod, last)
