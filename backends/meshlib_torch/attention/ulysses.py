"""`ulysses_attention`: context-parallel attention by swapping sequence shards for head shards (DeepSpeed-
Ulysses, Jacobs et al., 2023).

Each rank holds S/cp tokens of every head. One `lax.all_to_all` over `axis` sends head block j to rank j and
gathers the sequence: rank j then holds all S tokens of heads [j*H/cp, (j+1)*H/cp), for queries (Hq/cp heads)
and for keys and values (Hkv/cp heads, stacked in one exchange). Attention over the whole sequence runs
locally, with the positions of the layout (the gathered sequence is in the shards' order); a second
all-to-all returns the output to sequence shards. A key/value head and the query heads that read it
(GQA: head h reads h // (Hq/Hkv)) land on the same rank, so Hq and Hkv must both be multiples of cp.

Bytes per rank (`COUNTER`, kind "all_to_all", logical bytes: the whole buffer, (cp-1)/cp of it leaves):
forward B*(S/cp)*D*itemsize*(Hq + 2*Hkv + Hq) (q, k and v, the output); backward the same. The mask, whose
rows each rank holds, is gathered whole for the local heads (an all-to-all of a per-head mask, an all-gather
of one shared by the heads): S*S per head or once, so pass `causal` / `doc_ids` instead where they say it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import lax
from .inputs import Problem, check, compute_dtype, default_scale, host_index, mask5, split_heads
from .local import block
from .ring import gathered_docs
from .zigzag import from_zigzag, to_zigzag

__all__ = ["ulysses_attention"]


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /, *, axis: str = "cp", causal: bool = False, mask=None,
    doc_ids=None, scale=None, layout: str = "contiguous",
) -> torch.Tensor:  # fmt: skip
    """`ring_attention`'s result (same arguments and specs) by all-to-alls over heads: needs the query heads
    and the key/value heads to be multiples of the size of `axis`."""
    shards = check("ulysses_attention", q, k, v, axis=axis, causal=causal, mask=mask, doc_ids=doc_ids,
                   scale=scale, layout=layout)  # fmt: skip
    cp, (hq, hkv) = shards.cp, (q.shape[1], k.shape[1])
    if hq % cp or hkv % cp:
        raise ValueError(_heads_error(hq, hkv, cp, axis))
    rank = host_index(axis, "ulysses_attention")
    q_all = lax.all_to_all(q, axis, 1, 2, tiled=True)  # (B, Hq/cp, S, D)
    kv_all = lax.all_to_all(torch.stack([k, v]), axis, 2, 3, tiled=True)  # (2, B, Hkv/cp, S, D)
    dtype, docs = compute_dtype(q.dtype), gathered_docs(doc_ids, axis)
    user = _gathered_mask(mask, axis, hq)
    # one fused kernel call where no documents nor mask of the caller's apply: a head-tail (zigzag) sequence
    # is put in token order first (and its output back), so a causal mask is the kernel's own
    plain = user is None and docs is None
    reorder = plain and causal and layout == "zigzag"
    chunks = cp * len(shards.starts(rank))  # the layout's chunks in the sequence, for SCORES' unit
    if reorder:
        q_all, kv_all = from_zigzag(q_all, cp, 2), from_zigzag(kv_all, cp, 3)
        shards = replace(shards, layout="contiguous")
    p = Problem(
        shards, rank, split_heads(q_all, hkv // cp).to(dtype), hq // cp, default_scale(scale, q), causal,
        mask5(user, hq // cp, hkv // cp, dtype), docs, docs,
    )  # fmt: skip
    seq, pos = cp * shards.local, shards.everyone(q.device)
    out, _ = block(p, (0, seq), kv_all[0], kv_all[1], (0, seq), (pos, pos) if causal else None, pairs=chunks * chunks,
                   parts=((0, seq, causal),) if plain else None)  # fmt: skip
    out = to_zigzag(out, cp, 3) if reorder else out
    b, kv_heads, group, _, d = out.shape
    return lax.all_to_all(out.reshape(b, kv_heads * group, seq, d).to(q.dtype), axis, 2, 1, tiled=True)


def _gathered_mask(mask, axis: str, heads: int):
    """Every row of the mask for this rank's heads: (1 or B, Hq/cp or 1, S, S), or None. A boolean mask
    moves as bytes (uint8)."""
    if mask is None:
        return None
    m = mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape)
    raw = m.view(torch.uint8) if m.dtype == torch.bool else m
    if m.shape[1] == heads and heads > 1:
        raw = lax.all_to_all(raw, axis, 1, 2, tiled=True)
    else:
        raw = lax.all_gather(raw, axis, axis=2, tiled=True)
    return raw.view(torch.bool) if m.dtype == torch.bool else raw


def _heads_error(hq: int, hkv: int, cp: int, axis: str) -> str:
    why = (
        f"ulysses_attention: the all-to-all splits the heads over {axis!r} ({cp} ranks), so the query heads ({hq}) "
        f"and the key/value heads ({hkv}) must both be multiples of {cp}"
    )
    ring = "use ring_attention or allgather_attention, which take any GQA grouping"
    if hq % cp:
        return f"{why}. Fix: {ring}, or a {axis!r} axis whose size divides {hq}"
    r = next(r for r in range(1, hq // hkv + 1) if (hkv * r) % cp == 0 and (hq // hkv) % r == 0)
    return (
        f"{why}; {hkv} key/value heads are not. Fix: {ring}, or repeat each key/value head {r} times "
        f"(k.repeat_interleave({r}, dim=1), the same for v: {hkv * r} heads, {r}x the key/value bytes) before the call"
    )
