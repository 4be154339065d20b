"""What a pipeline balances: a cost per layer, and the stages' layer ranges.

The layers are the model's longest `nn.ModuleList`. Their cost is counted
from shapes alone: forward FLOPs (torch's `FlopCounterMode`, op by op as the
model is traced, `graph_costs`), or parameter bytes. For a model no tracer can
follow, one run of a meta copy counts them (`layer_costs`). The embeddings go
with the first stage, the final norm, head and loss with the last, and the
partition counts their cost there. `stage_ranges` is the exact min-max
partition, unless the user gives split points.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from meshlib.cost import min_max_partition
from meshlib.schedules import even_layers


@dataclass(frozen=True)
class LayerCosts:
    """Cost per layer, and what the first and last stage carry besides their layers (the
    embeddings before the first layer; the final norm, head and loss after the last).

    `before` and `after` name the outermost modules that ran entirely before the first
    layer and entirely after the last one (every call), for the split by module FQN."""

    layers: list[float]
    first: float = 0.0
    last: float = 0.0
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def of(self, ranges: list[tuple[int, int]]) -> list[float]:
        """The cost of each stage."""
        out = [sum(self.layers[a:b]) for a, b in ranges]
        out[0] += self.first
        out[-1] += self.last
        return out


def graph_costs(compiled, model: nn.Module, layers: list[str], by: str = "flops") -> LayerCosts:
    """Cost per layer from the compiled graph, without running anything: the forward FLOPs torch's
    FlopCounterMode counted on each op's shapes when the model was traced (`count_flops`), summed
    per layer, or the bytes of each layer's parameters. What runs before the first layer (the
    embeddings) is the first stage's, what runs after the last (final norm, head, loss) the last's."""
    _check_balance(by)
    n = len(layers)
    if by == "params":
        size = lambda ps: float(sum(q.numel() * q.element_size() for q in ps))  # noqa: E731
        in_layers = {id(p) for path in layers for p in model.get_submodule(path).parameters()}
        ends = {0: {}, n + 1: {}}
        for node, part in compiled.parts.items():
            for a in node.all_input_nodes:
                if a.op == "get_attr" and a.meta.get("param") and part in ends:
                    p = compiled.traced.params[a.target]
                    if id(p) not in in_layers:
                        ends[part][a.target] = p
        per = [size(model.get_submodule(path).parameters()) for path in layers]
        return LayerCosts(per, size(ends[0].values()), size(ends[n + 1].values()))
    per = [0.0] * (n + 2)
    for node, part in compiled.parts.items():
        per[part] += float(node.meta.get("flops", 0))
    return LayerCosts(per[1 : n + 1], per[0], per[n + 1])


def _check_balance(by: str) -> None:
    if by not in ("flops", "params"):
        raise ValueError(f"balance={by!r}: use 'flops' or 'params'")


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every parameter and buffer on meta (ties kept, no data copied)."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def layer_costs(model: nn.Module, layers: list[str], call, by: str = "flops") -> LayerCosts:
    """For a model that cannot be traced: per layer, forward FLOPs (`FlopCounterMode`) or parameter
    bytes, from one run of a meta copy of the model (shapes only: no values are read); and the
    outermost modules that run before the first layer and after the last (`LayerCosts.before/after`)."""
    _check_balance(by)
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_copy(model)
    mods = [model.get_submodule(path) for path in layers]
    in_layers = {id(p) for m in mods for p in m.parameters()}
    args, kwargs = call.arguments({n: torch.empty_like(x, device="meta") for n, x in call.tensors.items()})
    counter = FlopCounterMode(display=False, depth=None)
    marks: dict[str, float] = {}
    seen: dict[str, dict[int, torch.nn.Parameter]] = {"first": {}, "last": {}}
    when: dict[str, set[str]] = {}  # module FQN -> when its calls began and ended: "before", "during", "after"

    def now() -> str:
        return "after" if "end" in marks else "during" if "start" in marks else "before"

    def outside(name: str):
        def enter(mod, args) -> None:
            when.setdefault(name, set()).add(now())

        def leave(mod, args, out) -> None:  # a module outside the layers ran: charge its own parameters
            when[name].add(now())
            where = "last" if "end" in marks else "first"
            for q in mod.parameters(recurse=False):
                if id(q) not in in_layers:
                    seen[where][id(q)] = q

        return enter, leave

    def start(mod, args) -> None:
        marks.setdefault("start", counter.get_total_flops())

    def end(mod, args, out) -> None:
        marks["end"] = counter.get_total_flops()

    inner = {id(m) for layer in mods for m in layer.modules()}
    hooks = []
    for name, m in model.named_modules():
        if id(m) not in inner:
            enter, leave = outside(name)
            hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    hooks += [mods[0].register_forward_pre_hook(start), mods[-1].register_forward_hook(end)]
    try:
        with counter, torch.no_grad():
            model(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as err:
        raise ValueError(
            f"the model cannot run on the meta device to find its stages' costs and boundaries ({err}). "
            "Fix: make the forward run on shapes alone (no .item() or data-dependent Python branches)"
        ) from err
    finally:
        for h in hooks:
            h.remove()
    before, after = _outermost(when, "before"), _outermost(when, "after")
    if by == "params":
        size = lambda ps: float(sum(q.numel() * q.element_size() for q in ps))  # noqa: E731
        firsts, lasts = size(seen["first"].values()), size(seen["last"].values())
        return LayerCosts([size(m.parameters()) for m in mods], firsts, lasts, before, after)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    per_layer = [float(sum(counts.get(f"{root}.{path}", {}).values())) for path in layers]
    total = float(counter.get_total_flops())
    return LayerCosts(per_layer, float(marks.get("start", 0)), total - float(marks.get("end", total)), before, after)


def _outermost(when: dict[str, set[str]], phase: str) -> tuple[str, ...]:
    """FQNs of the modules whose every call began and ended in `phase`, without their submodules."""
    names = [n for n, phases in when.items() if n and phases == {phase}]
    return tuple(n for n in names if not any(n.startswith(f"{o}.") for o in names))


def stage_ranges(
    costs: LayerCosts, n_stages: int, *, split_points: list[int] | None = None, even: bool = False
) -> list[tuple[int, int]]:
    """`[(start, stop), ...]` layer ranges: the user's split points, else (`even`) as many layers a stage
    (`meshlib.schedules.even_layers`; with up to two stages more than layers, the first and the last hold only
    the embedding and the head, as Llama 3 405B's 126 layers fill 128 stages), else the min-max partition (the
    first and last stage's extra cost included)."""
    n = len(costs.layers)
    if n_stages > n + (2 if even else 0):
        fix = f"{n + 2} with balance='layers', whose first and last stages may hold only the embedding and the head"
        raise ValueError(
            f"{n_stages} pipeline stages but the model has {n} layers; "
            + (f"at most the first and the last stage can be without one. Fix: use at most {n + 2} stages"
               if even else f"each stage needs at least one. Fix: use at most {n} stages, or {fix}")
            + " (pp x chunks per rank), or a deeper model"
        )  # fmt: skip
    if split_points is not None:
        points = sorted(split_points)
        if len(points) != n_stages - 1 or points[0] <= 0 or points[-1] >= n or len(set(points)) != len(points):
            raise ValueError(
                f"split points {list(split_points)} must be {n_stages - 1} distinct layer indices in 1..{n - 1}, "
                f"where stages 2..{n_stages} begin"
            )
        edges = [0, *points, n]
        return list(zip(edges, edges[1:]))
    if even:
        edges = [0, *itertools.accumulate(even_layers(n, n_stages))]
        return list(zip(edges, edges[1:]))
    return min_max_partition(costs.layers, n_stages, first=costs.first, last=costs.last)

