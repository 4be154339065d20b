"""Stages: cut the local graph into pipeline stages over the model's layers.

The layers are grouped into `p * v` contiguous stages (`costs.stage_ranges`).
Each stage becomes its own graph. A value made in one stage and used in a
later one crosses every boundary in between (pipeline stages talk only to
their neighbours), so each boundary lists the values live across it, with
their shapes and bytes per microbatch; the plan records them. A parameter
used by two stages (tied embeddings) is materialized in both, and the
runtime sums its gradient between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshlib import Boundary

from ..capture.values import run_dtype
from ..placement.placements import kind
from ..placement.shapes import local_shape


@dataclass
class StageGraphs:
    graphs: list[fx.Graph]
    layers: list[tuple[int, int]]  # layer range [start, stop) of each stage
    inputs: list[list[str]]  # value names each stage receives (stage 0: the model's inputs)
    outputs: list[list[str]]  # value names each stage sends on (last: the model's output)
    sends: list[tuple[Boundary, ...]] = field(default_factory=list)
    params: list[set[str]] = field(default_factory=list)  # parameter FQNs each stage holds
    costs: list[float] = field(default_factory=list)
    balance: str = "flops"
    layouts: dict[str, tuple] = field(default_factory=dict)  # boundary values with no plan of their own


def _stage_of_part(ranges: list[tuple[int, int]], n_layers: int):
    def stage(part: int) -> int:
        if part == 0:
            return 0
        if part == n_layers + 1:
            return len(ranges) - 1
        layer = part - 1
        return next(i for i, (a, b) in enumerate(ranges) if a <= layer < b)

    return stage


def build_stages(
    graph: fx.Graph, parts: dict[fx.Node, int], ranges: list[tuple[int, int]], n_layers: int, axes, plans,
    comms: list | None = None, input_layouts: dict | None = None,
) -> StageGraphs:
    """One graph per stage, values threaded through the boundaries in between. With `comms` (the
    compiled model's, appended to), a partial sum reduce-scattered in a later stage crosses as its
    shard instead (`_send_shards`)."""
    stage_of = _stage_of_part(ranges, n_layers)
    where: dict[str, int] = {}
    for node, part in parts.items():
        where[node.name] = stage_of(part)
    n = len(ranges)
    for node in graph.nodes:  # parameters and buffers go where they are read
        if node.op == "get_attr":
            users = sorted({where[u.name] for u in node.users if u.name in where})
            where[node.name] = users[0] if users else 0
    layouts = _send_shards(graph, where, comms) if comms is not None else {}
    by_name = {n.name: n for n in graph.nodes}
    params = [set() for _ in range(n)]
    for node in graph.nodes:
        if node.op == "get_attr" and node.meta.get("param"):
            for u in node.users:
                readers = [u] if not _is_read(u) else list(u.users)
                for r in readers:
                    params[where.get(r.name, where.get(u.name, 0))].add(node.target)
    first_use = {}
    last_use = {}
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    out_node = next(n for n in graph.nodes if n.op == "output")
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        s = where[node.name]
        for a in node.all_input_nodes:
            if a.op == "get_attr" or _is_read(a) or _from_buffers(a):
                continue  # parameters are read, and buffer-only values remade, where they are used
            src = 0 if a.op == "placeholder" else where[a.name]
            if s > src:
                last_use[a.name] = max(last_use.get(a.name, src), s)
            first_use.setdefault(a.name, src)
    for a in out_node.all_input_nodes:
        src = 0 if a.op == "placeholder" else where[a.name]
        if src < n - 1:
            last_use[a.name] = max(last_use.get(a.name, src), n - 1)
    live = [[] for _ in range(n - 1)]  # values crossing boundary b (between stage b and b+1)
    for name, until in sorted(last_use.items(), key=lambda kv: order[kv[0]]):
        node = by_name[name]
        src = 0 if node.op == "placeholder" else where[name]
        for b in range(src, until):
            live[b].append(name)
    model_inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    inputs = [model_inputs] + live
    outputs = live + [None]
    graphs = [_stage_graph(graph, where, s, inputs[s], outputs[s]) for s in range(n)]
    sends = [tuple(_boundary(by_name[v], axes, plans, layouts, input_layouts) for v in live[b]) for b in range(n - 1)]
    sends.append(())
    return StageGraphs(
        graphs, list(ranges), inputs, [o if o is not None else ["output"] for o in outputs], sends, params,
        layouts=layouts,
    )


def _send_shards(graph: fx.Graph, where: dict[str, int], comms: list) -> dict[str, tuple]:
    """Megatron's scatter/gather at stage boundaries, for sequence parallelism.

    There the residual stream is a partial sum over tp (full size on every rank), reduce-scattered
    to a sequence shard only where a norm reads it. When that reduce-scatter is in a later stage,
    move it into the value's own stage and send the shard (1 / tp of the bytes); the later stages
    turn the shard back into a partial sum locally (its block in place, zeros around it) for the
    value's other users. The sum over ranks is the same value. Returns the moved collectives'
    output layouts (for the boundary's local shape)."""
    from ..placement.placements import Partial, Shard, natural_grad
    from ..placement.redistribute import CommSpec

    specs = {c.name: c for c in comms}
    moved: dict[str, tuple] = {}
    for node in list(graph.nodes):
        spec = specs.get(node.target) if node.op == "call_module" else None
        if spec is None or not node.args or node.args[0].name not in where:
            continue
        value, home = node.args[0], where[node.args[0].name]
        scatter = spec.src != spec.dst and all(
            a == b or (isinstance(a, Partial) and isinstance(b, Shard)) for a, b in zip(spec.src, spec.dst)
        )
        if not scatter or where.get(node.name, home) <= home:
            continue
        later = [u for u in value.users if u is not node and where.get(u.name, home) > home]
        where[node.name] = home
        moved[node.name] = spec.dst
        if not later:
            continue
        back = CommSpec(
            f"{spec.name}_partial", spec.dst, spec.src, tuple(natural_grad(p) for p in spec.src), spec.shape,
            spec.dtype, spec.requires_grad, node.name, spec.consumer, "pipeline boundary", spec.source,
        )  # fmt: skip
        comms.append(back)
        with graph.inserting_after(node):
            rebuilt = graph.create_node("call_module", back.name, (node,))  # bound by the runtime, by name
        rebuilt.meta = dict(value.meta)
        where[rebuilt.name] = min(where[u.name] for u in later)
        for u in later:
            u.replace_input_with(value, rebuilt)
    return moved


def rank_params(stages, placement) -> list[set[str]]:
    """The parameter names the stages at each pp coordinate hold (`placement`: stage -> pp rank)."""
    out: list[set[str]] = [set() for _ in range(max(placement) + 1)]
    for s, names in enumerate(stages.params):
        out[placement[s]] |= names
    return out


def param_holders(stages, placement) -> dict[str, set[int]]:
    """Each parameter's pp coordinates: those whose stages hold it (more than one: a tied parameter)."""
    out: dict[str, set[int]] = {}
    for r, names in enumerate(rank_params(stages, placement)):
        for name in names:
            out.setdefault(name, set()).add(r)
    return out


def boundary_values(compiled, names: list[str], device, layouts: dict | None = None, coords=None) -> tuple:
    """Zeros shaped like these values for one microbatch on one rank (`output`: the loss), each in
    the dtype it has as the model runs (bf16 under bf16 compute, unless the model casts it).
    `layouts`: those of values the compiler's plans do not cover (collectives moved to a boundary).
    A pipeline stage is built with them (torch checks each send against them), and the dry run
    feeds them to a stage. `coords` (axis -> coordinate): the rank's, whose pieces of a dim cut
    unevenly are its own (default: the first rank's, the largest)."""
    at = [coords[a] for a in compiled.axes.names] if coords else None
    by_name = {n.name: n for n in compiled.graph.nodes}
    out = []
    for name in names:
        if name == "output":
            out.append(torch.zeros((), device=device))
            continue
        node = by_name[name]
        val = node.meta["val"]
        layout = value_layout(node, compiled.plans, compiled.input_layouts, layouts)
        shape = local_shape(tuple(val.shape), layout, compiled.axes.sizes, at) if layout is not None else val.shape
        out.append(torch.zeros(shape, dtype=run_dtype(node), device=device, requires_grad=bool(val.requires_grad)))
    return tuple(out)


def value_layout(node: fx.Node, plans, input_layouts: dict, moved: dict | None = None):
    """The layout a value crossing a boundary has on its rank: a collective moved to a boundary's
    (`moved`), an inserted collective's output, the op's planned output, or an input's."""
    if moved and node.name in moved:
        return moved[node.name]
    if "comm" in node.meta:
        return node.meta["comm"].dst
    plan = plans.get(node)
    if plan is not None and isinstance(plan.out, tuple) and plan.out and not isinstance(plan.out[0], tuple):
        return plan.out
    return input_layouts.get(node.name)


def _boundary(node: fx.Node, axes, plans, layouts: dict | None = None, input_layouts: dict | None = None) -> Boundary:
    val = node.meta["val"]
    layout = value_layout(node, plans, input_layouts or {}, layouts)
    shape = local_shape(tuple(val.shape), layout, axes.sizes) if layout is not None else tuple(val.shape)
    name = f"{node.args[0].name} (scattered)" if layouts and node.name in layouts else node.name
    dtype = run_dtype(node)  # as it runs: under bf16 compute most activations cross in bf16
    return Boundary(
        name, tuple(shape), str(dtype).removeprefix("torch."), math.prod(shape) * dtype.itemsize,
        bool(val.requires_grad),
    )


def _stage_graph(
    graph: fx.Graph, where: dict[str, int], s: int, inputs: list[str], outputs: list[str] | None
) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in graph.nodes}
    for name in inputs:
        old = by_name[name]
        env[old] = new.placeholder(name)
        env[old].meta = dict(old.meta)
    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter (or its local shard) read in another stage too: read it here
            if a.op == "get_attr":
                env[a] = new.get_attr(a.target)
            elif _is_read(a) or _from_buffers(a):
                env[a] = new.node_copy(a, arg)
            env[a].meta = dict(a.meta)
        return env[a]

    for node in graph.nodes:
        if node.op in ("placeholder", "output") or where.get(node.name) != s or (node.op == "get_attr"):
            continue
        if _is_read(node) or _from_buffers(node):
            continue  # made on first use, in each stage that reads it
        env[node] = new.node_copy(node, arg)
    if outputs is None:
        out = next(n for n in graph.nodes if n.op == "output")
        new.output(fx.node.map_arg(out.args[0], arg))
    else:
        new.output(tuple(env[by_name[name]] for name in outputs))
    return new


def _is_read(node: fx.Node) -> bool:
    """`param.to_local()`: a parameter's local shard, read afresh in every stage that uses it."""
    return node.op == "call_method" and node.target == "to_local" and node.args[0].op == "get_attr"


def _from_buffers(node: fx.Node, _memo: dict | None = None) -> bool:
    """A value made from buffers and constants alone (rotary tables sliced to the sequence, a causal
    mask built from positions), or this rank's slice of one: cheaper to remake in each stage than
    to send through every boundary. Random values are never remade."""
    if node.op == "get_attr":
        return not node.meta.get("param")
    if node.op in ("placeholder", "output") or _is_read(node):
        return False
    if node.op == "call_module":  # a collective: only a local slice (no communication) is remade
        spec = node.meta.get("comm")
        local = spec is not None and all(kind(a, b) is None for a, b in zip(spec.src, spec.dst))
        return local and all(_from_buffers(a) for a in node.all_input_nodes)
    inputs = node.all_input_nodes
    if not inputs:  # arange, zeros, full: made from the graph's constants
        return "rand" not in str(node.target) and torch.is_tensor(node.meta.get("val"))
    return all(_from_buffers(a) for a in inputs)
