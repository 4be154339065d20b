"""Where each token of the sequence is held when it is split over the `cp` ranks: the two layouts.

- `"contiguous"`: rank i holds tokens [i*L, (i+1)*L), L = S/cp: what `P(..., "cp", ...)` gives a sequence
  that was not reordered. Under a causal mask rank i's queries see i+1 of the cp shards of keys, so the
  last rank computes cp times the scores of the first.
- `"zigzag"` (head-tail): the sequence is cut in 2*cp chunks of C = S/(2*cp) tokens and rank i holds
  chunks i and 2*cp-1-i, one from the head and one from the tail. Under a causal mask every rank then
  sees the same number of (query chunk, key chunk) pairs, 2*cp+1 (see `flops`). The idea is that of
  ring-flash-attention's zigzag ring and Megatron-LM's context parallelism (load balancing by pairing
  chunks from both ends).

`to_zigzag(x, cp, dim)` reorders a whole sequence so that `P("cp")` on `dim` hands each rank its two
chunks; `from_zigzag` undoes it. Both are `index_select`s (differentiable). `Shards` is the layout as a
value: each rank's chunks and the token positions they hold, which the attention functions mask with.

Example (S = 8, cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2):

    >>> zigzag_indices(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "Shards", "from_zigzag", "to_zigzag", "zigzag_indices"]

LAYOUTS = ("contiguous", "zigzag")


def _check(seq_len: int, cp: int, what: str) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"{what}: cp={cp!r} must be a positive int (the size of the axis the sequence is split over)")
    if seq_len % (2 * cp):
        raise ValueError(
            f"{what}: the zigzag layout cuts the sequence in 2*cp = {2 * cp} chunks (two per rank), so its length "
            f"must be a multiple of {2 * cp}; got {seq_len}. Fix: pad the sequence to "
            f"{-(-seq_len // (2 * cp)) * 2 * cp} tokens, or use layout='contiguous'"
        )


def zigzag_indices(seq_len: int, cp: int) -> torch.Tensor:
    """The order of the zigzag layout, (seq_len,) int64: position `j` of the reordered sequence holds token
    `zigzag_indices(...)[j]`; rank i's block holds chunks i and 2*cp-1-i, in that order."""
    _check(seq_len, cp, "zigzag_indices")
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return chunks[order].reshape(-1)


def to_zigzag(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """`x` with its sequence dim `dim` in the zigzag order (split it over `cp` with `P("cp")` on that dim)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp).to(x.device))


def from_zigzag(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The inverse of `to_zigzag`: a sequence in the zigzag order back in token order."""
    return x.index_select(dim, torch.argsort(zigzag_indices(x.shape[dim], cp)).to(x.device))


@dataclass(frozen=True, slots=True)
class Shards:
    """A sequence of `seq` tokens split over `cp` ranks in `layout`: each rank holds `len(starts(r))` chunks,
    stored in the order of their first positions. `local` is the tokens of the largest rank (rank 0's).
    Equal pieces (`seq` = cp * local, the default), or, contiguous only, torch.chunk's pieces of a sequence cp
    does not divide (`seq` given: pieces of ceil(seq/cp), the last ones shorter; uneven='chunk')."""

    layout: str
    cp: int
    local: int  # tokens per rank (the largest piece)
    seq: int = 0  # tokens in the sequence (0: cp * local)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if not self.seq:
            object.__setattr__(self, "seq", self.cp * self.local)
        if self.ragged and (self.layout != "contiguous" or self.local != -(-self.seq // self.cp)
                            or (self.cp - 1) * self.local >= self.seq):  # fmt: skip
            raise ValueError(
                f"a sequence of {self.seq} tokens over cp={self.cp} in {self.layout!r} pieces of at most {self.local}: "
                "torch.chunk's pieces (each rank non-empty) are taken in the contiguous layout only"
            )
        if self.layout == "zigzag":
            _check(self.seq, self.cp, "layout='zigzag'")

    @property
    def ragged(self) -> bool:
        """The ranks hold pieces of different lengths (torch.chunk's)."""
        return self.seq != self.cp * self.local

    @property
    def chunk(self) -> int:
        return self.local // 2 if self.layout == "zigzag" else self.local

    def starts(self, rank: int) -> tuple[int, ...]:
        """The first position of each chunk rank `rank` holds, ascending."""
        if self.layout == "zigzag":
            return (rank * self.chunk, (2 * self.cp - 1 - rank) * self.chunk)
        return (rank * self.local,)

    def chunk_len(self, start: int) -> int:
        """The tokens of the chunk that begins at `start` (shorter only for torch.chunk's last pieces)."""
        return min(self.chunk, self.seq - start)

    def length(self, rank: int) -> int:
        """The tokens rank `rank` holds."""
        return sum(self.chunk_len(s) for s in self.starts(rank))

    def positions(self, starts, device) -> torch.Tensor:
        """The positions of the tokens of the chunks that begin at `starts`, in that order."""
        return torch.cat([torch.arange(self.chunk_len(s), device=device) + s for s in starts])

    def everyone(self, device) -> torch.Tensor:
        """The position of every token of the sequence as the ranks hold it (rank 0's block first)."""
        return self.positions([s for r in range(self.cp) for s in self.starts(r)], device)
