"""`ring_attention`: context-parallel attention whose keys and values travel around the ring of `cp` ranks.

Each rank keeps its queries. Its keys and values (stacked, one buffer: the key/value heads as they are, in
the inputs' dtype) go around the ring with `lax.ppermute`, rank i sending to i+1: after j hops rank i holds
those of rank (i - j) mod cp. Each shard that arrives is attended to (`local.attend_shard`: the chunk pairs a
causal mask hides entirely are skipped) and merged into the running result by the log-sum-exp rule (Liu et
al., "Ring Attention with Blockwise Transformers", 2023).

Bytes per rank (counted in `COUNTER` as kind "send_recv"): forward cp-1 hops of 2*B*Hkv*(S/cp)*D*itemsize,
(cp-1)/cp of the sequence's K and V. Backward sends K and V around again, the other way, with their gradient
(`_Ring`): cp-2 hops of K and V (a rank keeps the last shard that reached it and has its own) and cp-1 hops
of their gradient, summed in the compute dtype (fp32 for bf16 inputs: twice their bytes). `doc_ids` are
gathered once (B*S ints).

Memory: what a rank keeps for backward is its q, k, v, the output, the rows' log-sum-exp and the last shard
that reached it: O(S/cp) per layer, as ring-flash-attention and TransformerEngine keep. Backward computes
the scores again from them (flash attention's recomputation, `local.grads`), a tile of query rows at a time.

Overlap: each hop is asynchronous (`lax.ppermute_start` forward, the backend's `permute_start` backward:
torch.distributed's `all_to_all_single` with `async_op=True`, gloo and NCCL alike). Forward, the next hop is
begun before the current block is computed and waited for after it. Backward, a shard's K/V hop is begun
before its blocks are computed, and its gradient's hop after them, waited for after the next shard's blocks.
Waits are bounded by the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import lax
from ..spmd.records import Call
from ..spmd.region import Axes, current, user_line
from .inputs import Problem, check, compute_dtype, default_scale, mask5, rank_of, split_heads
from .local import attend_shard, backward_inputs, finish, shard_grads
from .zigzag import Shards

__all__ = ["gathered_docs", "ring_attention", "shard_problem"]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /, *, axis: str = "cp", causal: bool = False, mask=None,
    doc_ids=None, scale=None, layout: str = "contiguous", seq_len: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """softmax(Q Kᵀ * scale + mask) V for this rank's queries over the whole sequence, (B, Hq, S/cp, D).

    Call it inside `shard_map` with q, k, v (and `doc_ids`) split along the sequence over `axis`, e.g.
    `in_specs=(P(None, None, "cp"),) * 3, out_specs=P(None, None, "cp")` (batch over "dp": `P("dp", None,
    "cp")`). `layout`: the order the shards are in, "contiguous" or "zigzag" (`to_zigzag`); `mask` holds
    this rank's query rows and all key columns (see `inputs`); `scale` defaults to 1/sqrt(D). `seq_len`: the
    whole sequence's length where cp does not divide it: each rank then holds torch.chunk's piece (contiguous
    layout), and the hops carry the largest piece, the shorter ones padded."""
    shards = check("ring_attention", q, k, v, axis=axis, causal=causal, mask=mask, doc_ids=doc_ids, scale=scale,
                   layout=layout, seq_len=seq_len)  # fmt: skip
    rank = rank_of(shards, axis, "ring_attention", q.shape[2])
    region = current("ring_attention")
    back = _Back(region.backend, region.axes(axis, "ppermute"), Call("ppermute", user_line()))
    return _Ring.apply(q, k, v, _Call(axis, shards, rank, causal, mask, doc_ids, scale, back))


@dataclass(frozen=True)
class _Call:
    axis: str
    shards: Shards
    rank: int
    causal: bool
    mask: torch.Tensor | None
    doc_ids: torch.Tensor | None
    scale: float | None
    back: _Back


@dataclass(frozen=True)
class _Back:
    """How the backward sends along the ring: autograd runs it after `shard_map` has returned, so it goes
    to the region's backend itself (as `lax`'s own backward rules do), counted under the user's call."""

    backend: object
    axes: Axes
    call: Call

    def start(self, x: torch.Tensor):
        """`x` sent to the previous rank along the ring, under way (`wait()` gives what the next one sent)."""
        return self.backend.permute_start(x, self.axes, tuple(_hops(self.axes.size, -1)), self.call)


class _Ring(torch.autograd.Function):
    """The ring, forward and backward, keeping O(S/cp) per rank: its q, k, v, the last shard to arrive,
    the output and the log-sum-exp of every query row.

    Forward: after `step` hops rank r holds the keys and values of rank r - step; the last to arrive is
    rank r+1's. Backward runs the ring the other way round: at step s rank r holds those of rank r+1+s
    (first the one it kept, last its own), together with the gradient of that shard summed over the ranks
    that held it before; it adds its blocks' share (`local.grads`, from the rows' final out and lse) and
    passes both to rank r-1. The shard's gradient is complete when the shard is back home, at the last
    step. Hops: keys and values cp-2 times, their gradient (in the compute dtype) cp-1 times. Each is
    asynchronous: the next K/V hop travels while a shard's blocks are computed, and a gradient hop while
    the next shard's are."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        p = shard_problem(q, k, call.shards, call.rank, call.causal, call.mask, call.doc_ids, call.scale, call.axis)
        n = call.shards.cp
        kv = padded(torch.stack([k, v]), call.shards.local)
        acc = [None] * len(call.shards.starts(p.rank))
        for step in range(n):
            arriving = lax.ppermute_start(kv, call.axis, _hops(n, +1)) if step + 1 < n else None
            attend_shard(p, acc, kv, (p.rank - step) % n)  # computed while the next hop travels
            kv = arriving.wait() if arriving is not None else kv
        out = finish(p, acc, q.dtype)
        ctx.save_for_backward(q, k, v, kv, out, torch.cat([lse for _, lse in acc], dim=3))
        ctx.p, ctx.back = replace(p, q=None), call.back
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, last, out, lse = ctx.saved_tensors
        dtype = lse.dtype
        p, out5, grad5, grad_q = backward_inputs(ctx.p, q, k.shape[1], out, grad_out, dtype)
        n, own = p.shards.cp, padded(torch.stack([k, v]), p.shards.local)
        kv, kv_hop, grad_hop = last, None, None
        for step in range(n):
            if step:
                kv = own if step == n - 1 else kv_hop.wait()
            if step < n - 2:
                kv_hop = ctx.back.start(kv)  # rank r-1 attends to it next
            part = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
            shard_grads(p, kv, (p.rank + 1 + step) % n, out5, lse, grad5, grad_q, part)
            if step:
                part += grad_hop.wait()
            if step < n - 1:
                grad_hop = ctx.back.start(part)
        grad_kv = part[:, :, :, : k.shape[2]]  # this rank's own tokens (the rest padded its piece to move)
        return grad_q.view(q.shape).to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


def padded(x: torch.Tensor, length: int, dim: int = -2) -> torch.Tensor:
    """`x` with its sequence dim `dim` zero-padded to `length` tokens: what moves when the ranks hold torch.chunk's
    pieces (every hop and gather carries the largest; the blocks read only a piece's own tokens)."""
    short = length - x.shape[dim]
    if not short:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, short]
    return torch.nn.functional.pad(x, pad)


def _hops(n: int, direction: int) -> list[tuple[int, int]]:
    """Every rank along the ring sends to its neighbour `direction` away (+1: the next, -1: the previous)."""
    return [(j, (j + direction) % n) for j in range(n)]


def shard_problem(q, k, shards, rank: int, causal: bool, mask, doc_ids, scale, axis: str) -> Problem:
    """The state of a call that keeps this rank's queries (ring, all-gather): its mask as it came, its
    documents and every key's (one all-gather: the only collective here)."""
    dtype, hkv = compute_dtype(q.dtype), k.shape[1]
    return Problem(
        shards, rank, split_heads(q, hkv).to(dtype), q.shape[1], default_scale(scale, q), causal,
        mask5(mask, q.shape[1], hkv, dtype), doc_ids, gathered_docs(doc_ids, axis, shards.local),
    )  # fmt: skip


def gathered_docs(doc_ids, axis: str, local: int | None = None):
    """Every token's document, (B, cp * local) in the layout's order (each rank's piece padded to `local`, the
    largest, so rank r's tokens begin at r * local), or None."""
    if doc_ids is None:
        return None
    return lax.all_gather(padded(doc_ids, local or doc_ids.shape[1], dim=1), axis, axis=1, tiled=True)
