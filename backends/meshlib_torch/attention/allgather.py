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

import torch

from .. import lax
from .inputs import check, rank_of
from .local import attend_shard, finish
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
    n, length = shards.cp, shards.local
    acc = [None] * len(shards.starts(p.rank))
    for step in range(n):
        src = (p.rank - step) % n
        attend_shard(p, acc, kv[:, :, :, src * length : (src + 1) * length], src)
    return finish(p, acc, q.dtype)
