"""Ops whose local form depends on the rank: a vocab-parallel embedding, a sharded cross-entropy, and a
region of per-shard code (`meshlib_torch.shard_map` inside a compiled model).

Both follow Megatron-LM's vocab-parallel formulas. The cross-entropy also
takes rows split over data-parallel axes: it returns this rank's share of the
global mean, a partial sum over those axes. Its sums over ranks go through a
`reduce(tensor, "max" | "sum", axis)` it is given: the runtime's all-reduce on
that axis's process group, nothing in a dry run, simulated ranks in the rule
checks.
"""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch
import torch.nn.functional as F
from torch import nn

from ..compiler.placement.placements import chunk_rows

# in place, over the named mesh axis; with wait=False it may return a handle whose wait() finishes it
Reduce = Callable[..., object]


def no_reduce(x: torch.Tensor, op: str, axis: str, wait: bool = True) -> None:
    """A dry run's reduce: shapes and memory only, no communication."""


class VocabEmbedding(nn.Module):
    """Rank r holds the vocabulary's r-th torch.chunk piece of rows (`[r*V/n, (r+1)*V/n)` when n divides
    V): look up the ids in range, zero the rest (output: partial). A padding row (`padding_idx`, the
    global row) gets no gradient: the rank that holds it says so to its lookup, the others hold none."""

    def __init__(self, *, vocab: int, ways: int, rank: int, padding_idx: int | None = None, **_):
        super().__init__()
        self.start, self.local_vocab = chunk_rows(vocab, ways, rank)
        local = None if padding_idx is None else padding_idx - self.start
        self.padding_idx = local if local is not None and 0 <= local < self.local_vocab else None

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), weight, padding_idx=self.padding_idx)
        return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabParallelCE(torch.autograd.Function):
    """Per-row losses of logits split over classes: max, log-sum-exp and target logit all-reduced."""

    @staticmethod
    def forward(ctx, logits, target, start, reduce: Reduce, ignore_index: int, axis: str):
        with torch.no_grad():
            x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            row_max = x.max(dim=-1).values
            reduce(row_max, "max", axis)
            shifted = x - row_max.unsqueeze(-1)
            local_t = target - start
            inside = (local_t >= 0) & (local_t < x.shape[-1])
            picked = shifted.gather(-1, local_t.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            exp = shifted.exp()
            both = torch.stack([exp.sum(-1), picked * inside])
            reduce(both, "sum", axis)
            sum_exp, target_logit = both[0], both[1]
            loss = sum_exp.log() - target_logit
            valid = target != ignore_index
            loss = loss * valid
            ctx.save_for_backward(exp, sum_exp, local_t, inside, valid)
            return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, local_t, inside, valid = ctx.saved_tensors
        probs = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(probs)
        onehot.scatter_(-1, local_t.clamp(0, probs.shape[-1] - 1).unsqueeze(-1), inside.unsqueeze(-1).to(probs.dtype))
        g = (probs - onehot) * (grad * valid).unsqueeze(-1).to(probs.dtype)
        return g.to(grad.dtype), None, None, None, None, None


class CrossEntropy(nn.Module):
    """F.cross_entropy on logits split over classes (`vocab_axis`) and/or rows (`rows_axes`); `rank` is
    this rank's coordinate on the vocab axis."""

    def __init__(
        self, *, vocab_axis, rows_axes, classes, vocab_ways, reduction, ignore_index, rank: int = 0,
        reduce: Reduce = no_reduce, **_,
    ):  # fmt: skip
        super().__init__()
        self.vocab_axis, self.rows_axes, self.reduce = vocab_axis, tuple(rows_axes), reduce
        self.start = chunk_rows(classes, vocab_ways, rank)[0] if vocab_axis else 0  # torch.chunk's pieces
        self.reduction, self.ignore_index = reduction, ignore_index
        self.counts: list[torch.Tensor] = []  # the global counts of targets of the next microbatches, if known

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        count, pending, axes = None, [], self.rows_axes
        if self.reduction not in ("none", "sum") and self.counts:  # counted from the whole batch: no all-reduce
            count, axes = self.counts.pop(0).to(torch.float64), ()
        elif self.reduction not in ("none", "sum"):  # the global count of targets, summed while the rows compute
            count = (target != self.ignore_index).sum().to(torch.float64)
            pending = [self.reduce(count, "sum", axis, wait=False) for axis in axes[:1]]
        if self.vocab_axis:
            per_row = _VocabParallelCE.apply(
                logits, target, self.start, self.reduce, self.ignore_index, self.vocab_axis
            )
        else:
            per_row = F.cross_entropy(logits, target, reduction="none", ignore_index=self.ignore_index)
        if count is None:
            return per_row if self.reduction == "none" else per_row.sum()
        for handle in pending:
            if handle is not None:
                handle.wait()
        for axis in axes[1:]:
            self.reduce(count, "sum", axis)
        return per_row.sum() / count.to(per_row.dtype)


class RegionModule(nn.Module):
    """A region of per-shard code on this rank: the graph gives its tensor arguments (this rank's shards,
    as the region's in specs place them) and takes its results' shards; its collectives go through
    `backend` (c10d on the mesh's groups, or `MetaBackend` in a dry run)."""

    def __init__(self, *, fn, template: tuple, deferred: tuple, backend, **_):
        super().__init__()
        self.fn, self.template, self.deferred, self.backend = fn, template, frozenset(deferred), backend
        self.owned: list[tuple[int, str, tuple, dict]] = []  # weights it holds itself (`hold`), by argument
        self.weights = nn.Module()

    def hold(self, position: int, name: str, param: nn.Parameter, local_args: tuple = (), local_kwargs=None) -> None:
        """Hold `param` (the model's `name`) as this module's own, and read it as the region's tensor argument
        at `position` (of those the graph gave: it no longer does), through `to_local` with these arguments
        when it is a DTensor. FSDP2 then shards it with this module as its unit: the region is where it is used
        (an expert weight, sharded over fewer data axes than its layer's)."""
        from ..compiler.attrs import set_attr

        set_attr(self.weights, name, param)
        self.owned = sorted([*self.owned, (position, name, tuple(local_args), dict(local_kwargs or {}))])

    def forward(self, *tensors: torch.Tensor):
        from ..compiler.attrs import resolve
        from ..compiler.placement.rank_ops import TENSOR
        from ..spmd.region import Region
        from ..spmd.run import run_region
        from ..spmd.vma import VmaMode

        if self.owned:
            tensors = list(tensors)
            for position, name, args, kwargs in self.owned:  # in order of position: each lands where it was
                t = resolve(self.weights, name)
                tensors.insert(position, t.to_local(*args, **kwargs) if hasattr(t, "to_local") else t)
        fn, given = self.fn, iter(tensors)
        region = Region(fn.mesh, self.backend, check_vma=fn.check_vma, deferred=self.deferred)
        region.mode = VmaMode(region) if fn.check_vma else None
        args = tuple(next(given) if a is TENSOR else a for a in self.template)
        outs, tree = run_region(fn.f, region, args, in_specs=fn.in_specs, out_specs=fn.out_specs)
        return optree.tree_unflatten(tree, [o.value for o in outs])


def special_module(spec, coords: dict[str, int], reduce: Reduce = no_reduce, backend=None) -> nn.Module:
    """The module that runs one rank-dependent op (`rank_ops.SpecialSpec`) on the rank at `coords`; a
    region's collectives go through `backend` (`spmd.MetaBackend()` when None: a dry run)."""
    if spec.kind == "vocab_embedding":
        module = VocabEmbedding(**spec.args, rank=coords.get(spec.args["axis"], 0))
    elif spec.kind == "shard_map":
        from ..spmd.backend import MetaBackend

        module = RegionModule(**spec.args, backend=MetaBackend() if backend is None else backend)
    else:
        module = CrossEntropy(**spec.args, rank=coords.get(spec.args["vocab_axis"], 0), reduce=reduce)
    module.spec = spec
    return module


__all__ = ["CrossEntropy", "Reduce", "RegionModule", "VocabEmbedding", "no_reduce", "special_module"]
