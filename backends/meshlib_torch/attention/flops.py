"""The attention scores each rank computes: the closed form, and a counter of what the code computed.

Unit: a (query chunk, key chunk) pair, the chunks of the layout (`zigzag.Shards`): S/cp tokens for
`"contiguous"`, S/(2*cp) for `"zigzag"`. A pair whose every score a causal mask hides is skipped; the
others are computed whole (the diagonal pairs too, masked elementwise). With C the chunk length, each
pair costs 4*heads*C²*head_dim FLOPs per sequence: 2 for a multiply-add of Q Kᵀ, 2 of P V.

Per rank i (0-based along cp), per sequence, the pairs computed are:

    not causal            every layout      cp pairs of (S/cp)²      = S²/cp scores
    causal, contiguous    rank i            i+1 pairs of (S/cp)²     (its shard sees i+1 shards of keys)
    causal, zigzag        every rank        2*cp+1 pairs of (S/2cp)²

Zigzag: rank i's query chunks are i and 2cp-1-i; chunk a sees the key chunks b <= a, so i+1 of them for the
head chunk and 2cp-i for the tail one. Contiguous, the last rank computes cp blocks and the first one: the
spread max-min is (cp-1) blocks, 2(cp-1)/(cp+1) of the mean; zigzag's is 0.

`SCORES` counts what `ring_attention` and `allgather_attention` (and, without skipping, `ulysses_attention`)
computed on this rank, forward, since `reset()`: `pairs` (in the unit above, summed over calls) and `flops`
(4 * batch * query heads * rows * columns * head_dim of each block). Meta and fake tensors (a dry run, the
vma check) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..torch_private import is_fake
from .zigzag import LAYOUTS, Shards

__all__ = ["SCORES", "ScoreCounter", "attention_flops_per_rank"]


def attention_flops_per_rank(
    seq_len: int, cp: int, heads: int, head_dim: int, *, causal: bool, layout: str
) -> list[int]:
    """The forward attention FLOPs of each rank along `cp` (index i at position i), per sequence of
    `seq_len` tokens split over `cp` ranks, with `heads` query heads of `head_dim`: the blocks of the
    table in the module docstring, fully masked causal blocks not counted."""
    if layout not in LAYOUTS:
        raise ValueError(f"attention_flops_per_rank: layout={layout!r} must be one of {LAYOUTS}")
    if seq_len % cp:
        raise ValueError(f"attention_flops_per_rank: seq_len={seq_len} must be a multiple of cp={cp}")
    shards = Shards(layout, cp, seq_len // cp)
    per_pair = 4 * heads * head_dim * shards.chunk**2
    return [per_pair * _pairs(shards, i, causal) for i in range(cp)]


def _pairs(shards: Shards, rank: int, causal: bool) -> int:
    parts = len(shards.starts(rank))
    if not causal:
        return parts * parts * shards.cp  # its `parts` query chunks see every rank's `parts` key chunks
    if shards.layout == "contiguous":
        return rank + 1
    return 2 * shards.cp + 1


@dataclass
class ScoreCounter:
    """The score blocks computed on this rank since `reset()` (see the module docstring)."""

    pairs: int = 0
    flops: int = 0

    def note(self, q: torch.Tensor, heads: int, rows: int, cols: int, pairs: int) -> None:
        if q.is_meta or is_fake(q):
            return
        self.pairs += pairs
        self.flops += 4 * q.shape[0] * heads * rows * cols * q.shape[-1]

    def reset(self) -> None:
        self.pairs = self.flops = 0


SCORES = ScoreCounter()
