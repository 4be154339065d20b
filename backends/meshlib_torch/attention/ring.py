"""`ring_attention`: context-parallel attention whose keys and values travel around the ring of `cp` ranks.

Each rank keeps its queries. Its keys and values (stacked, one buffer: the key/value heads as they are, in
the inputs' dtype) go around the ring with `lax.ppermute`, rank i sending to i+1: after j hops rank i holds
those of rank (i - j) mod cp. Each shard that arrives is attended to (`local.attend_shard`: the chunk pairs a
causal mask hides entirely are skipped) and merged into the running result by the log-sum-exp rule (Liu et
al., "Ring Attention with Blockwise Transformers", 2023).

Bytes per rank (counted in `COUNTER` as kind "send_recv"): forward cp-1 hops of 2*B*Hkv*(S/cp)*D*itemsize,
(cp-1)/cp of the sequence's K and V; backward the same again, since autograd transposes each hop
(`lax.ppermute`'s backward is the inverse permutation), so the gradients of K and V travel back around the
ring, each rank adding its blocks' contribution as they pass. `doc_ids` are gathered once (B*S ints).

Overlap: each hop is asynchronous (`lax.ppermute_start`: torch.distributed's `all_to_all_single` with
`async_op=True`, gloo and NCCL alike). The next hop is begun before the current block is computed and waited
for after it, so the transfer runs while the block does. In backward the hop's wait begins sending the
gradient of the shard that arrived back around the ring, and its start waits for it; autograd runs the nodes
recorded later first, so the block computed between them (its backward) runs while that gradient travels.
Waits are bounded by the process group's timeout. Memory: a block keeps its output and log-sum-exp for the
backward, not its scores (`local._Block` computes them again there, a tile of query rows at a time); what
stays is every K/V shard that arrived, 2*B*Hkv*S*D per rank and layer (the whole sequence's keys and values
at the key/value width), since backward reads them where they are rather than sending them around again.
"""

from __future__ import annotations

import torch

from .. import lax
from .inputs import Problem, check, compute_dtype, default_scale, host_index, mask5, split_heads
from .local import attend_shard, finish

__all__ = ["gathered_docs", "ring_attention", "shard_problem"]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /, *, axis: str = "cp", causal: bool = False, mask=None,
    doc_ids=None, scale=None, layout: str = "contiguous",
) -> torch.Tensor:  # fmt: skip
    """softmax(Q Kᵀ * scale + mask) V for this rank's queries over the whole sequence, (B, Hq, S/cp, D).

    Call it inside `shard_map` with q, k, v (and `doc_ids`) split along the sequence over `axis`, e.g.
    `in_specs=(P(None, None, "cp"),) * 3, out_specs=P(None, None, "cp")` (batch over "dp": `P("dp", None,
    "cp")`). `layout`: the order the shards are in, "contiguous" or "zigzag" (`to_zigzag`); `mask` holds
    this rank's query rows and all key columns (see `inputs`); `scale` defaults to 1/sqrt(D)."""
    shards = check("ring_attention", q, k, v, axis=axis, causal=causal, mask=mask, doc_ids=doc_ids, scale=scale,
                   layout=layout)  # fmt: skip
    p = shard_problem(q, k, shards, host_index(axis, "ring_attention"), causal, mask, doc_ids, scale, axis)
    n = shards.cp
    ring = [(j, (j + 1) % n) for j in range(n)]
    kv = torch.stack([k, v])
    acc = [None] * len(shards.starts(p.rank))
    for step in range(n):
        arriving = lax.ppermute_start(kv, axis, ring) if step + 1 < n else None  # the next hop, under way...
        used = attend_shard(p, acc, kv, (p.rank - step) % n)  # ...while this block is computed
        last, kv = kv, arriving.wait() if arriving is not None else None
    out = finish(p, acc, q.dtype)
    return out if used or n == 1 else _Tie.apply(out, last)


class _Tie(torch.autograd.Function):
    """`out` as it is, with a zero gradient for `last`, the last shard to arrive, which this rank did not need.

    Every rank must run the backward of every hop (each is a collective: a rank with nothing to return still
    sends zeros and receives its neighbour's gradient). Autograd runs a hop's backward only if its output
    reaches the loss. Each earlier shard reaches it through the next hop, so tying the last one to the result
    is enough (under a causal contiguous layout, rank i < cp-1 needs none of the shards after its own)."""

    @staticmethod
    def forward(ctx, out, last):
        ctx.last = (last.shape, last.dtype, last.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.last
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def shard_problem(q, k, shards, rank: int, causal: bool, mask, doc_ids, scale, axis: str) -> Problem:
    """The state of a call that keeps this rank's queries (ring, all-gather): its mask as it came, its
    documents and every key's (one all-gather: the only collective here)."""
    dtype, hkv = compute_dtype(q.dtype), k.shape[1]
    return Problem(
        shards, rank, split_heads(q, hkv).to(dtype), q.shape[1], default_scale(scale, q), causal,
        mask5(mask, q.shape[1], hkv, dtype), doc_ids, gathered_docs(doc_ids, axis),
    )  # fmt: skip


def gathered_docs(doc_ids, axis: str):
    """Every token's document, (B, S) in the layout's order, or None."""
    return None if doc_ids is None else lax.all_gather(doc_ids, axis, axis=1, tiled=True)
