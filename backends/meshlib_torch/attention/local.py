"""One rank's share of the attention: blocks of queries against blocks of keys, merged by log-sum-exp.

A block of queries Q against keys K and values V gives its normalized output and its log-sum-exp

    s = Q Kᵀ * scale + bias  (masked scores: -inf),   m = max_j s_j,
    lse = m + log Σ_j exp(s_j - m),                    out = Σ_j exp(s_j - lse) V_j.

Two blocks of keys A and B of the same queries merge exactly (Liu et al., "Ring Attention", 2023; the
online softmax of flash attention):

    lse = log(exp(lse_A) + exp(lse_B)),   out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B,

computed with their max subtracted first. The max is a constant of the arithmetic (`detach`: the result does
not depend on it), so autograd differentiates the exact formulas. A query that sees no key in a block has
lse = -inf and adds nothing; one that sees none anywhere gets zeros.

GQA: queries are held as (B, Hkv, G, rows, D), so a group's G query heads meet their key/value head in one
matmul of (G*rows, D) by (D, cols): the key/value heads are never repeated.

`attend_shard` is the step every ring and all-gather variant repeats: this rank's query chunks against the
key chunks of one source shard, skipping each (query chunk, key chunk) pair a causal mask hides entirely
(decided from positions on the host), and counting what it computes in `flops.SCORES`; `shard_grads` is its
backward, from the rows' final out and lse.

Kernels: a block whose key chunks are each all visible or the query chunk itself under a causal mask (its
`Parts`, decided on the host) runs torch's fused attention kernel once per part, forward and backward (the
backward given the whole row's out and lse computes this block's share exactly); documents and the caller's
masks run the eager tiles, which take any mask. CPU has the kernel (and the meta device, for dry runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..modules.recompute import blocks_recomputed
from ..modules.repeat import standing_for
from ..torch_private import flash_attention, flash_attention_grads, has_flash_attention
from .flops import SCORES
from .inputs import Problem, split_heads

__all__ = [
    "Mask", "Parts", "Piece", "attend", "attend_shard", "block", "block_mask", "finish", "grads", "merge", "pieces",
    "parts_mask", "shard_grads", "backward_inputs",
]  # fmt: skip

_NEG = float("-inf")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask | None = None,
           parts: Parts | None = None) -> tuple:  # fmt: skip
    """(out, lse) of queries q (B, Hkv, G, rows, D) over keys k and values v (B, Hkv, cols, D), in q's
    dtype, the scores hidden or shifted as `mask` says. out is (B, Hkv, G, rows, D), lse (B, Hkv, G, rows, 1).

    `parts`, where the block is unmasked or causal in aligned pieces (`Parts`, which then says all that
    `mask` does), runs torch's fused kernel per part on the devices that have it (`torch_private.
    flash_attention`), merged by `merge`. Otherwise, and for documents and the caller's masks: scores, and
    the boolean masks that hide them, exist only for a tile of query rows at a time (`_tiles`), forward and
    backward; backward computes them again from q, k, v, the block's out and lse and `mask`'s positions and
    documents (`_Block`, flash attention's recomputation), so what a rank keeps for backward grows with its
    tokens, not with (S/cp) x S."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if parts is not None and not has_flash_attention(q.device):
        mask, parts = _tiles_mask(mask, parts, q), None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Block.apply(q, k, v, scale, mask, parts)
    return _forward(q, k, v, scale, mask, parts)


Parts = tuple  # ((c0, m, causal), ...): key columns [c0, c0 + m) of a block, all visible or causal (key j of
# the part hidden from query row i when j > i); together the block's columns a mask may show


def _tiles_mask(mask: Mask | None, parts: Parts | None, q: torch.Tensor) -> Mask | None:
    """The mask the eager tiles take for a block of queries `q`: the caller's, else what `parts` say, if any."""
    return parts_mask(parts, q.shape[3], q.device) if mask is None and parts is not None else mask


def parts_mask(parts: Parts, rows: int, device) -> Mask:
    """The `Mask` that says what `parts` do, for the tiles: query i at position i, a causal part's key j at j
    (hidden when j > i), every other key at -1 (seen by all)."""
    k_pos = [torch.arange(m, device=device) if causal else torch.full((m,), -1, device=device)
             for _, m, causal in parts]  # fmt: skip
    return Mask(q_pos=torch.arange(rows, device=device), k_pos=torch.cat(k_pos))


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, rows, D) -> (B, Hq, rows, D), a view: query head j*G + g reads key/value head j."""
    b, kv_heads, group, rows, d = x.shape
    return x.reshape(b, kv_heads * group, rows, d)


def _fused_forward(q, k, v, scale: float, parts: Parts) -> tuple:
    """(out, lse) of one block, a fused kernel call per part, merged."""
    acc = None
    for c0, m, causal in parts:
        out, lse = flash_attention(_heads(q), k[:, :, c0 : c0 + m], v[:, :, c0 : c0 + m], causal, scale)
        piece = out.view(q.shape[:-1] + (v.shape[-1],)), lse.to(q.dtype).contiguous().view(q.shape[:-1] + (1,))
        acc = piece if acc is None else merge(acc, piece)
    return acc


def _fused_grads(q, k, v, out, lse, grad_out, scale: float, parts: Parts) -> tuple:
    """`grads` (no gradient of lse) by the fused kernel's backward, a call per part."""
    grad_q, grad_k, grad_v = None, torch.zeros_like(k), torch.zeros_like(v)
    q4, out4, go4 = _heads(q), _heads(out), _heads(grad_out.to(q.dtype))
    lse3 = _heads(lse).squeeze(-1)
    for c0, m, causal in parts:
        cols = slice(c0, c0 + m)
        dq, dk, dv = flash_attention_grads(go4, q4, k[:, :, cols], v[:, :, cols], out4, lse3, causal, scale)
        grad_q = dq if grad_q is None else grad_q + dq
        grad_k[:, :, cols] += dk
        grad_v[:, :, cols] += dv
    return grad_q.view(q.shape), grad_k, grad_v


@dataclass(frozen=True)
class Mask:
    """What hides or shifts one block's scores, built a tile of query rows at a time: a causal mask from the
    positions of the rows and of the columns (`q_pos` (rows,), `k_pos` (cols,)), documents (`doc_q` (B, rows),
    `doc_k` (B, cols): a query sees only keys of its own), and the caller's mask (`user`, this block's rows
    and columns, (Bm, Hkv or 1, G or 1, rows, cols): boolean, True where allowed, or floating, added)."""

    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    doc_q: torch.Tensor | None = None
    doc_k: torch.Tensor | None = None
    user: torch.Tensor | None = None

    def tile(self, r0: int, r1: int) -> tuple:
        """(bias, allowed) of query rows [r0, r1): each None, or broadcastable to (B, Hkv, G, r1 - r0, cols)."""
        allowed = None if self.q_pos is None else self.k_pos[None, :] <= self.q_pos[r0:r1, None]
        if self.doc_q is not None:
            same = (self.doc_q[:, r0:r1, None] == self.doc_k[:, None, :])[:, None, None]
            allowed = same if allowed is None else allowed & same
        cut = None if self.user is None else self.user if self.user.shape[-2] == 1 else self.user[..., r0:r1, :]
        if cut is not None and cut.dtype == torch.bool:
            return None, cut if allowed is None else allowed & cut
        return cut, allowed


TILE = 1 << 18  # scores (elements) one tile of query rows may have: 1 MiB in fp32...
MIN_ROWS = 64  # ...but at least this many rows (a tile of one row a thousand times over is slower than it saves)


def _tiles(q: torch.Tensor, cols: int):
    """Row ranges [r0, r1) of q (B, Hkv, G, rows, D) whose scores hold about `TILE` elements."""
    b, kv_heads, group, rows, _ = q.shape
    step = max(MIN_ROWS, TILE // max(1, b * kv_heads * group * cols))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _stepped(q: torch.Tensor, cols: int) -> list[tuple[int, int, int]]:
    """`(r0, r1, n)`: the tiles to run, each standing for `n` alike. Every tile once (n = 1), except in a dry
    run (meta tensors: no value is read), where the second tile stands for every later tile of its size: its
    ops are counted for all of them (`modules.repeat`), and its temporaries, beside the first tile's results,
    are each one's (the dry run's peak)."""
    tiles = _tiles(q, cols)
    if not q.is_meta or len(tiles) < 4:
        return [(r0, r1, 1) for r0, r1 in tiles]
    size = tiles[0][1] - tiles[0][0]
    alike = sum(r1 - r0 == size for r0, r1 in tiles)  # the first tiles (all but perhaps the last)
    # two run: the second's temporaries meet the first's results, as every later tile's do
    return [(*tiles[0], 1), (*tiles[1], alike - 1)] + [(r0, r1, 1) for r0, r1 in tiles[alike:]]


def _scores(q, k, scale: float, mask: Mask | None, r0: int, r1: int) -> torch.Tensor:
    """Scores of query rows [r0, r1), (B, Hkv, G, r1 - r0, cols): shifted by the mask's bias, -inf where hidden."""
    q = q[:, :, :, r0:r1]
    b, kv_heads, group, rows, d = q.shape
    s = (q.reshape(b, kv_heads, group * rows, d) @ k.transpose(-1, -2)).view(b, kv_heads, group, rows, -1) * scale
    bias, allowed = (None, None) if mask is None else mask.tile(r0, r1)
    if bias is not None:
        s = s + bias
    return s if allowed is None else s.masked_fill(~allowed, _NEG)


def _forward(q, k, v, scale: float, mask: Mask | None, parts: Parts | None = None) -> tuple:
    """(out, lse) of one block: by the fused kernel (`parts`), or tile by tile of query rows, each from its
    scores with their row max subtracted."""
    if parts is not None:
        return _fused_forward(q, k, v, scale, parts)
    outs, lses = [], []
    for r0, r1, n in _stepped(q, k.shape[-2]):
        with standing_for(n):
            s = _scores(q, k, scale, mask, r0, r1)
            b, kv_heads, group, rows, _ = s.shape
            top = s.amax(-1, keepdim=True)
            top = torch.where(top.isfinite(), top, 0)  # a row that sees no key: its exponentials are all 0
            e = torch.exp(s - top)
            total = e.sum(-1, keepdim=True)
            safe = torch.where(total > 0, total, 1)
            out = (e.view(b, kv_heads, group * rows, -1) @ v).view(b, kv_heads, group, rows, v.shape[-1]) / safe
            outs.append(out)
            lses.append(torch.where(total > 0, top + torch.log(safe), _NEG))
        with standing_for(0):  # the alike tiles' results (a dry run): held as the loop holds them, not counted
            outs += [torch.empty_like(out) for _ in range(n - 1)]
            lses += [torch.empty_like(lses[-1]) for _ in range(n - 1)]
    return torch.cat(outs, 3), torch.cat(lses, 3)


class _Block(torch.autograd.Function):
    """One block's (out, lse), keeping q, k, v, out, lse and the `Mask` (positions, documents, a view of the
    caller's mask) for backward, and not the scores nor a boolean mask of the block.

    With P = exp(S - lse) the block's probabilities, dO and dlse the gradients of out and lse (the merge uses
    both): dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ out) + dlse), dQ = dS K · scale, dK = dSᵀ Q · scale;
    tile by tile of query rows (dK and dV summed over the tiles)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, parts):
        out, lse = _forward(q, k, v, scale, mask, parts)
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None (the fused backward takes none)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mask, ctx.parts = scale, mask, parts
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        return (*grads(q, k, v, out, lse, grad_out, grad_lse, ctx.scale, ctx.mask, ctx.parts), None, None, None)


def grads(q, k, v, out, lse, grad_out, grad_lse, scale: float, mask: Mask | None, parts: Parts | None = None) -> tuple:
    """(dQ, dK, dV) of a block of queries q (B, Hkv, G, rows, D) over keys k and values v (B, Hkv, cols, D),
    given `out` and `lse` (the block's, or the whole row's: then the probabilities are the row's share of
    this block, and `grad_lse` is None), the gradient `grad_out` of out, and `grad_lse` of lse (or None).
    By the fused kernel's backward where `parts` says the block's masking (and no gradient of lse comes),
    else with scores computed again a tile of query rows at a time (`_Block`'s formulas)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if parts is not None and grad_lse is None and has_flash_attention(q.device):
        return _fused_grads(q, k, v, out, lse, grad_out, scale, parts)
    mask = _tiles_mask(mask, parts, q)
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r0, r1, n in _stepped(q, k.shape[-2]):
        with standing_for(n):
            _tile_grads(q, k, v, out, lse, grad_out, grad_lse, scale, mask, r0, r1, grad_q, grad_k, grad_v)
    return grad_q, grad_k, grad_v


def _tile_grads(q, k, v, out, lse, grad_out, grad_lse, scale, mask, r0, r1, grad_q, grad_k, grad_v) -> None:
    """`grads` for the query rows [r0, r1): their dQ written, their share of dK and dV added."""
    qt, ot, lt, go = q[:, :, :, r0:r1], out[:, :, :, r0:r1], lse[:, :, :, r0:r1], grad_out[:, :, :, r0:r1]
    b, kv_heads, group, rows, d = qt.shape
    s = _scores(q, k, scale, mask, r0, r1)
    p = torch.where(lt.isfinite(), torch.exp(s - torch.where(lt.isfinite(), lt, 0)), 0)
    flat_p, flat_go = p.view(b, kv_heads, group * rows, -1), go.reshape(b, kv_heads, group * rows, -1)
    grad_v += flat_p.transpose(-1, -2) @ flat_go
    dp = (flat_go @ v.transpose(-1, -2)).view_as(p)
    shift = (go * ot).sum(-1, keepdim=True)
    if grad_lse is not None:
        shift = shift - grad_lse[:, :, :, r0:r1]
    ds = (p * (dp - shift)).view(b, kv_heads, group * rows, -1)
    grad_q[:, :, :, r0:r1] = (ds @ k).view_as(qt) * scale
    grad_k += ds.transpose(-1, -2) @ qt.reshape(b, kv_heads, group * rows, d) * scale


def merge(a: tuple, b: tuple) -> tuple:
    """The (out, lse) of the queries over the keys of two blocks, from each block's (out, lse)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = torch.maximum(lse_a, lse_b).detach()
    top = torch.where(top.isfinite(), top, 0)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    safe = torch.where(total > 0, total, 1)
    return (out_a * w_a + out_b * w_b) / safe, torch.where(total > 0, top + torch.log(safe), _NEG)


def block_mask(p: Problem, rows: tuple[int, int], cols: tuple[int, int], positions) -> Mask | None:
    """What hides or shifts the block of query rows [r0, r0 + n) of `p` and key columns [c0, c0 + m) of the
    masks; `positions` (query positions, key positions) when a causal mask cuts this block, else None."""
    (r0, n), (c0, m) = rows, cols
    q_pos, k_pos = positions if positions is not None else (None, None)
    docs = (None, None) if p.doc_q is None else (p.doc_q[:, r0 : r0 + n], p.doc_k[:, c0 : c0 + m])
    user = None if p.mask is None else p.mask[..., r0 : r0 + n, c0 : c0 + m]
    if positions is None and p.doc_q is None and user is None:
        return None
    return Mask(q_pos, k_pos, *docs, user)


def block(p: Problem, rows: tuple[int, int], k, v, cols: tuple[int, int], positions, *, pairs: int,
          parts: Parts | None = None) -> tuple:  # fmt: skip
    """(out, lse) of the query rows [r0, r0 + n) of `p` over keys k and values v (B, Hkv, m, D), the key
    columns [c0, c0 + m) of the masks (`block_mask`; `parts` where they are unmasked or causal in aligned
    parts, `attend`). `pairs`: the (query chunk, key chunk) pairs it is, for `SCORES`."""
    r0, n = rows
    SCORES.note(p.q, p.heads, n, cols[1], pairs)
    return attend(p.q[:, :, :, r0 : r0 + n], k, v, p.scale, block_mask(p, rows, cols, positions), parts)


@dataclass(frozen=True, slots=True)
class Piece:
    """One block of `attend_shard`: query chunk `chunk` of this rank (rows [r0, r0 + n) of its queries)
    against the first `keys` tokens of the source shard, key columns [c0, c0 + keys) of the masks;
    `positions` when a causal mask cuts it; `pairs` (query chunk, key chunk) pairs, for `SCORES`; `parts`
    when no documents nor caller's mask apply and each key chunk is all visible or the query chunk itself
    (`attend`'s fused kernel), else None."""

    chunk: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    positions: tuple | None
    pairs: int
    parts: Parts | None


def pieces(p: Problem, src: int) -> list[Piece]:
    """The blocks this rank computes against source rank `src`'s keys, one per query chunk that sees any.

    Chunks are stored in ascending position, so the key chunks a query chunk can see under a causal mask
    are a prefix of `src`'s: the first `n`, those that begin before the query chunk ends."""
    sh, out, row = p.shards, [], 0
    k_starts = sh.starts(src)
    for a, q0 in enumerate(sh.starts(p.rank)):
        rows = sh.chunk_len(q0)
        n = sum(s <= q0 + rows - 1 for s in k_starts) if p.causal else len(k_starts)
        if n:  # else every key of src is later than every query of this chunk
            last = k_starts[n - 1]
            cuts = p.causal and last + sh.chunk_len(last) - 1 > q0  # some key later than some query
            device = p.q.device
            positions = (sh.positions([q0], device), sh.positions(k_starts[:n], device)) if cuts else None
            cols = sum(sh.chunk_len(s) for s in k_starts[:n])
            parts = _parts(sh, q0, k_starts[:n], p.causal) if p.doc_q is None and p.mask is None else None
            out.append(Piece(a, (row, rows), (src * sh.local, cols), positions, n, parts))
        row += rows
    return out


def _parts(sh, q0: int, k_starts, causal: bool) -> Parts | None:
    """The `Parts` of query chunk `q0` against key chunks `k_starts` (ascending): each all visible (it ends
    by the query chunk's start) or the query chunk itself (causal, aligned); None if one is neither."""
    parts, col = [], 0
    for s in k_starts:
        m = sh.chunk_len(s)
        hidden_some = causal and s + m - 1 > q0
        if hidden_some and s != q0:
            return None
        if parts and not hidden_some and not parts[-1][2]:
            parts[-1] = (parts[-1][0], parts[-1][1] + m, False)  # visible chunks side by side: one call
        else:
            parts.append((col, m, hidden_some))
        col += m
    return tuple(parts)


def attend_shard(p: Problem, acc: list, kv: torch.Tensor, src: int) -> bool:
    """Merge into `acc` (per query chunk of this rank: (out, lse), or None before its first block) the
    attention of this rank's query chunks over source rank `src`'s keys and values, kv (2, B, Hkv, L, D).
    Returns whether any block was computed (False: every key of `src` is hidden from every query here)."""
    blocks = pieces(p, src)
    for b in blocks:
        m = b.cols[1]
        with blocks_recomputed():
            piece = block(p, b.rows, kv[0, :, :, :m], kv[1, :, :, :m], b.cols, b.positions, pairs=b.pairs,
                          parts=b.parts)  # fmt: skip
        acc[b.chunk] = piece if acc[b.chunk] is None else merge(acc[b.chunk], piece)
    return bool(blocks)


def shard_grads(p: Problem, kv, src: int, out, lse, grad_out, grad_q, grad_kv) -> None:
    """Backward of `attend_shard` for source rank `src`'s keys and values kv (2, B, Hkv, L, D), from the
    rows' final out and lse (B, Hkv, G, rows, D / 1) and the gradient of out: each block's share of dQ added
    to `grad_q` (like p.q), of dK and dV to `grad_kv` (like kv, in the compute dtype)."""
    for b in pieces(p, src):
        (r0, rows), m = b.rows, b.cols[1]
        t = slice(r0, r0 + rows)
        mask = block_mask(p, b.rows, b.cols, b.positions)
        dq, dk, dv = grads(p.q[:, :, :, t], kv[0, :, :, :m], kv[1, :, :, :m], out[:, :, :, t], lse[:, :, :, t],
                           grad_out[:, :, :, t], None, p.scale, mask, b.parts)  # fmt: skip
        grad_q[:, :, :, t] += dq
        grad_kv[0, :, :, :m] += dk
        grad_kv[1, :, :, :m] += dv


def backward_inputs(p: Problem, q, kv_heads: int, out, grad_out, dtype: torch.dtype) -> tuple:
    """What the ring's and the all-gather's backward start from: the Problem with the saved queries (B, Hq, L, D)
    as (B, Hkv, G, L, D) in the compute `dtype`, the rows' out and its gradient so too, and dQ's zeros."""
    p = replace(p, q=split_heads(q, kv_heads).to(dtype))
    heads = (split_heads(t, kv_heads).to(dtype) for t in (out, grad_out))
    return p, *heads, torch.zeros_like(p.q)


def finish(p: Problem, acc: list, dtype: torch.dtype) -> torch.Tensor:
    """The query chunks' outputs side by side as (B, Hq, L, D) in `dtype`. Every chunk has one: at least
    its own shard's diagonal block is visible to it."""
    out = torch.cat([o for o, _ in acc], dim=3)
    b, kv_heads, group, length, d = out.shape
    return out.reshape(b, kv_heads * group, length, d).to(dtype)
