"""Every op rule checked against the op itself, on simulated ranks (as DTensor's strategy validation does).

An `OpCase` is one op called on whole example inputs. `strategies(case, cur, n)`
lists what the op's rule (`compiler/placement/ops.py`) offers when its tensor inputs have
the placements `cur` on one mesh axis of `n` ranks (every output shard tried
as a hint too). `check(case, strategy, n)` then runs the op the way the
compiler localizes it (`localize`: local shapes, rescaled means, the
rank-dependent vocab-parallel ops) on `n` simulated ranks, each a thread fed
its local inputs: a shard of each split input, the whole of each replicated
one, and for each partial one a summand: 60% of the value on rank 0, the rest
spread over the others, plus zero-sum noise, so that an op that is not
linear cannot pass as one by symmetry. The ranks' outputs are reassembled by
the strategy's output placement (shards joined, replicas checked equal,
partial sums added) and compared with the op on the whole inputs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ..compiler.capture.values import annotate_values
from ..compiler.placement.bind import bind
from ..compiler.placement.localize import localize
from ..compiler.placement.ops import RULES, Strategy
from ..compiler.placement.placements import Partial, Replicate, Shard
from ..compiler.placement.propagate import Axes, NodePlan, fits
from ..modules.special import special_module
from ..runtime.comm import local_slice, unblocks

AXIS = "x"


@dataclass
class OpCase:
    """`target(*args, **kwargs)`: `args` may hold `In(i)` for the i-th of `inputs` (a method name is a call_method)."""

    target: object
    inputs: list[torch.Tensor]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class In:
    index: int


def _graph(case: OpCase) -> tuple[fx.GraphModule, fx.Node]:
    g = fx.Graph()
    holders = [g.placeholder(f"in{i}") for i in range(len(case.inputs))]
    put = lambda a: holders[a.index] if isinstance(a, In) else a  # noqa: E731
    args = tuple(put(a) if not isinstance(a, (list, tuple)) else type(a)(put(b) for b in a) for a in case.args)
    kwargs = {k: put(v) for k, v in case.kwargs.items()}
    if isinstance(case.target, str):
        node = g.call_method(case.target, args, kwargs)
    else:
        node = g.call_function(case.target, args, kwargs)
    g.output(node)
    gm = fx.GraphModule(nn.Module(), g)
    from ..compiler.capture.call import Call

    annotate_values(gm, Call({f"in{i}": x for i, x in enumerate(case.inputs)}))
    return gm, node


def kind(case: OpCase) -> str:
    return bind(_graph(case)[1]).kind


def strategies(case: OpCase, cur: list, n: int, *, uneven: bool = False) -> list[Strategy]:
    """The rule's strategies for these input placements (in the rule's tensor order) that fit `n` ranks
    (with `uneven`, also in torch.chunk's sizes where a dim does not divide)."""
    _, node = _graph(case)
    view = bind(node)
    out = view.out if isinstance(view.out, (list, tuple)) else [view.out]
    hint = [Shard(d) for d in range(max(t.dim() for t in out))]
    shapes = [tuple(x.meta["val"].shape) for x in view.tensors]
    found = RULES.get(view.kind, RULES["unknown"])(view, list(cur), hint)
    return [s for s in found if fits(view, s, n, shapes, uneven)]


def tensor_order(case: OpCase) -> list[int]:
    """For each tensor the rule sees (in its order), the index of that input in `case.inputs`."""
    _, node = _graph(case)
    return [int(x.target.removeprefix("in")) for x in bind(node).tensors]


class _SimGroup:
    """One mesh axis of simulated ranks (threads): an all-reduce that waits for every rank."""

    def __init__(self, n: int):
        self.n, self.barrier, self.parts = n, threading.Barrier(n), [None] * n
        self.local = threading.local()

    def reduce(self, x: torch.Tensor, op: str, axis: str, wait: bool = True) -> None:
        r = self.local.rank
        self.parts[r] = x.clone()
        self.barrier.wait()
        stacked = torch.stack(self.parts)
        total = stacked.amax(0) if op == "max" else stacked.sum(0)
        self.barrier.wait()
        x.copy_(total)


def _local(x: torch.Tensor, p, rank: int, n: int, noise: torch.Tensor | None) -> torch.Tensor:
    if isinstance(p, Shard):
        return local_slice(x, p, rank, n)  # torch.chunk's piece where the dim does not divide
    if isinstance(p, Partial):
        weight = 0.6 if rank == 0 else 0.4 / (n - 1)
        return x * weight + noise[rank]
    return x.clone()


def _join(parts: list[torch.Tensor], p) -> torch.Tensor:
    if isinstance(p, Shard) and len({t.shape for t in parts}) > 1:  # uneven pieces, in rank order
        if p.groups == 1:
            return torch.cat(parts, p.dim)
        # a grouped shard: each rank holds its piece of every group, group after group
        blocks = [t.chunk(p.groups, p.dim) for t in parts]
        return torch.cat([b[g] for g in range(p.groups) for b in blocks], p.dim)
    if isinstance(p, Shard):
        return unblocks(torch.stack(parts), p)
    if isinstance(p, Partial):
        return torch.stack(parts).sum(0)
    for other in parts[1:]:
        torch.testing.assert_close(other, parts[0], rtol=0, atol=0, msg="a replicated output differs between ranks")
    return parts[0]


def check(
    case: OpCase, strategy: Strategy, n: int, *, seed: int = 0, rtol: float = 1e-9, atol: float = 1e-9,
    uneven: bool = False,
) -> None:  # fmt: skip
    """Raise AssertionError unless the op, localized for `strategy` on `n` ranks, equals the whole op
    (`uneven`: shards of dims that do not divide are torch.chunk's pieces)."""
    gm, node = _graph(case)
    expected = gm(*(x.clone() for x in case.inputs))  # an in-place op must not write into the inputs
    view = bind(node)
    order = [int(x.target.removeprefix("in")) for x in view.tensors]
    need = {i: p for i, p in zip(order, strategy.inputs)}
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    plans = {}
    for holder in (x for x in gm.graph.nodes if x.op == "placeholder"):
        i = int(holder.target.removeprefix("in"))
        plans[holder] = NodePlan(bind(holder), (need.get(i, Replicate()),), [])
    multi = isinstance(view.out, (list, tuple))
    plans[node] = NodePlan(view, tuple((o,) for o in outs) if multi else (outs[0],), [(p,) for p in strategy.inputs])
    axes = Axes((AXIS,), (n,), uneven=uneven)
    specials = localize(gm, plans, axes, params=set())
    gm.recompile()
    gen = torch.Generator().manual_seed(seed)
    noise = {
        i: _zero_sum(x, n, gen) for i, x in enumerate(case.inputs) if isinstance(need.get(i), Partial)
    }
    group = _SimGroup(n)

    def run(rank: int):
        group.local.rank = rank
        root = nn.Module()
        for spec in specials:
            root.add_module(spec.name, special_module(spec, {AXIS: rank}, group.reduce))
        local_gm = fx.GraphModule(root, gm.graph)
        local = [_local(x, need.get(i, Replicate()), rank, n, noise.get(i)) for i, x in enumerate(case.inputs)]
        return local_gm(*local)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(run, range(n)))
    got = [_join([r[k] for r in results], p) for k, p in enumerate(outs)] if multi else _join(results, outs[0])
    want = list(expected) if multi else expected
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _zero_sum(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn((n, *x.shape), generator=gen, dtype=x.dtype)
    return noise - noise.mean(0, keepdim=True)


Generator = Callable[..., OpCase]

__all__ = ["In", "OpCase", "check", "kind", "strategies", "tensor_order"]
