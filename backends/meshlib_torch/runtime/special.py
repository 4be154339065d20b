"""Ops whose local form depends on the rank: a vocab-parallel embedding and a sharded cross-entropy.

Both follow Megatron-LM's vocab-parallel formulas. The cross-entropy also
takes rows split over data-parallel axes: it returns this rank's share of the
global mean, a partial sum over those axes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm import COUNTER, CommCounter


class VocabEmbedding(nn.Module):
    """Rows `[r*V/n, (r+1)*V/n)` live on rank r: look up the ids in range, zero the rest (output: partial)."""

    def __init__(self, *, local_vocab: int, rank: int, **_):
        super().__init__()
        self.start = rank * local_vocab
        self.local_vocab = local_vocab

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), weight)
        return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabParallelCE(torch.autograd.Function):
    """Per-row losses of logits split over classes: max, log-sum-exp and target logit all-reduced."""

    @staticmethod
    def forward(ctx, logits, target, start, group, counter: CommCounter, ignore_index: int, axis: str):
        with torch.no_grad():
            x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            row_max = x.max(dim=-1).values
            _all_reduce(row_max, group, dist.ReduceOp.MAX, counter, axis)
            shifted = x - row_max.unsqueeze(-1)
            local_t = target - start
            inside = (local_t >= 0) & (local_t < x.shape[-1])
            picked = shifted.gather(-1, local_t.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            exp = shifted.exp()
            both = torch.stack([exp.sum(-1), picked * inside])
            _all_reduce(both, group, dist.ReduceOp.SUM, counter, axis)
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
        return g.to(grad.dtype), None, None, None, None, None, None


DRY = object()  # the process group of a dry run: shapes and memory only, no communication


def _all_reduce(x: torch.Tensor, group, op, counter: CommCounter, axis: str) -> None:
    if group is DRY:
        return
    simulated = getattr(group, "simulated_all_reduce", None)  # ranks simulated in one process (rule checks)
    if simulated is not None:
        simulated(x, op)
        return
    dist.all_reduce(x, op=op, group=group)
    counter.record("forward", "all_reduce", axis, x.numel() * x.element_size(), "cross_entropy")


class CrossEntropy(nn.Module):
    """F.cross_entropy on logits split over classes (`vocab_axis`) and/or rows (`rows_axes`)."""

    def __init__(
        self, *, vocab_axis, rows_axes, local_classes, reduction, ignore_index, groups, ranks, counter=COUNTER, **_
    ):
        super().__init__()
        self.vocab_axis = vocab_axis
        self.vocab_group = groups.get(vocab_axis) if vocab_axis else None
        self.start = ranks.get(vocab_axis, 0) * local_classes if vocab_axis else 0
        self.row_groups = [(a, groups[a]) for a in rows_axes]
        self.reduction, self.ignore_index, self.counter = reduction, ignore_index, counter

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.vocab_group is not None:
            per_row = _VocabParallelCE.apply(
                logits, target, self.start, self.vocab_group, self.counter, self.ignore_index, self.vocab_axis
            )
        else:
            per_row = F.cross_entropy(logits, target, reduction="none", ignore_index=self.ignore_index)
        if self.reduction == "none":
            return per_row
        if self.reduction == "sum":
            return per_row.sum()
        count = (target != self.ignore_index).sum().to(torch.float64)
        for axis, group in self.row_groups:
            _all_reduce(count, group, dist.ReduceOp.SUM, self.counter, axis)
        return per_row.sum() / count.to(per_row.dtype)
