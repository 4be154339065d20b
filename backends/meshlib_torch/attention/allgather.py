"""`allgather_attention`: context-parallel attention over keys and values gathered once.

Each rank gathers the whole sequence's keys and values (stacked, one `lax.all_gather` over `axis`, key/value
heads as they are), then attends its own queries to them shard by shard in the ring's order, with the
positions of the layout (`local.attend_shard`: the same blocks, skips and merges as `ring_attention`, so the
same FLOPs and the same result). It moves the same bytes as the ring in one collective, not cp-1, and holds
the whole K and V at once: for short sequences or few ranks. Bytes per rank (`COUNTER`): forward an
all-gather of 2*B*Hkv*S*D*itemsize (its output); backward a reduce-scatter of the same (the gathered
gradients summed and scattered back to their owners, `all_gather`'s transpose).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import lax
from .inputs import check, rank_of
from .local import attend_shard, backward_inputs, finish, shard_grads
from .ring import padded, shard_problem

__all__ = ["allgather_attention"]


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /, *, axis: str = "cp", causal: bool = False, mask=None,
    doc_ids=None, scale=None, layout: str = "contiguous", seq_len: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`ring_attention`'s result (same arguments and specs), from keys and values gathered in one collective
    (torch.chunk's pieces, under `seq_len`, each padded to the largest to move)."""
    shards = check("allgather_attention", q, k, v, axis=axis, causal=causal, mask=mask, doc_ids=doc_ids,
                   scale=scale, layout=layout, seq_len=seq_len)  # fmt: skip
    rank = rank_of(shards, axis, "allgather_attention", q.shape[2])
    p = shard_problem(q, k, shards, rank, causal, mask, doc_ids, scale, axis)
    kv = padded(torch.stack([k, v]), shards.local)
    kv = lax.all_gather(kv, axis, axis=3, tiled=True)  # (2, B, Hkv, cp * local, D), rank 0's block first
    return _Gathered.apply(q, kv, p)


class _Gathered(torch.autograd.Function):
    """This rank's queries over the gathered keys and values, shard by shard in the ring's order, keeping
    q, the gathered kv, the output and the rows' log-sum-exp; backward takes each block's share from the
    rows' final out and lse (`local.shard_grads`, as the ring's backward does), and the gathered gradient
    goes back to its owners through `lax.all_gather`'s transpose."""

    @staticmethod
    def forward(ctx, q, kv, p):
        n, length = p.shards.cp, p.shards.local
        acc = [None] * len(p.shards.starts(p.rank))
        for step in range(n):
            src = (p.rank - step) % n
            attend_shard(p, acc, kv[:, :, :, src * length : (src + 1) * length], src)
        out = finish(p, acc, q.dtype)
        ctx.save_for_backward(q, kv, out, torch.cat([lse for _, lse in acc], dim=3))
        ctx.p = replace(p, q=None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        dtype = lse.dtype
        p, out5, grad5, grad_q = backward_inputs(ctx.p, q, kv.shape[2], out, grad_out, dtype)
        n, length = p.shards.cp, p.shards.local
        grad_kv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        for src in range(n):
            cols = slice(src * length, (src + 1) * length)
            shard_grads(p, kv[:, :, :, cols], src, out5, lse, grad5, grad_q, grad_kv[:, :, :, cols])
        return grad_q.view(q.shape).to(q.dtype), grad_kv.to(kv.dtype), None
