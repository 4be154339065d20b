"""Routing arithmetic of expert parallelism, on device: rows per expert, each (token, slot) pair's place
among its expert's pairs, the capacity rule, router statistics, and the one read of counts to the host.

A pair is one entry of `top_k_index` (T, k), taken in (token, slot) order: pair `p` is token `p // k`,
slot `p % k`. Nothing here reads a value to the host except `read_counts`, which `SYNCS` counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from .. import lax
from ..spmd.backend import phase
from ..spmd.records import Call
from ..spmd.region import current, user_line

__all__ = [
    "DROPPED", "DropCounter", "SYNCS", "SyncCounter", "capacity", "capacity_dropped", "expert_counts", "positions",
    "read_counts", "tokens_per_expert",
]  # fmt: skip


@dataclass
class SyncCounter:
    """Reads of device values to the host by the expert layers since `reset()`, by phase: a dropless
    layer's forward makes exactly one (`read_counts`), its backward none, capacity mode none."""

    by_phase: dict = field(default_factory=lambda: defaultdict(int))

    @property
    def count(self) -> int:
        return sum(self.by_phase.values())

    def record(self, when: str) -> None:
        self.by_phase[when] += 1

    def reset(self) -> None:
        self.by_phase.clear()


SYNCS = SyncCounter()


class DropCounter:
    """The (token, expert) pairs capacity mode dropped on this rank since `take()`: a device tensor the layers
    add to as they run (no host read); a block recompute replays does not count again, and a dry run's
    meta tensors are not counted."""

    def __init__(self):
        self.total: torch.Tensor | None = None

    def note(self, dropped: torch.Tensor) -> None:
        from ..modules.recompute import replaying
        from ..torch_private import is_fake

        if dropped.is_meta or is_fake(dropped) or replaying():
            return
        d = dropped.detach().to(torch.int64)
        self.total = d if self.total is None else self.total + d

    def take(self) -> torch.Tensor:
        """The count so far (0 if none), and start again."""
        out = torch.zeros((), dtype=torch.int64) if self.total is None else self.total
        self.total = None
        return out


DROPPED = DropCounter()


def read_counts(*counts: torch.Tensor) -> list[list[int]] | None:
    """The values of integer tensors as Python lists, in one device-to-host read (counted in `SYNCS`),
    through the region's backend, which counts it in the plan (kind "host_sync"); None in a dry run,
    which records the read but has no values."""
    region = current("read_counts")
    call = Call("host_read", user_line())
    if region.backend.abstract:  # a dry run: the read is recorded, there are no values
        region.backend.host_read(list(counts), call)
        return None
    if any(c.is_meta for c in counts):  # meta tensors on a real backend (the vma check): nothing to read
        return None
    SYNCS.record(phase())
    return region.backend.host_read(list(counts), call)


def expert_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many pairs each expert gets: (num_experts,) int64 (a scatter-add: bincount has no meta kernel)."""
    flat = top_k_index.reshape(-1).long()
    zeros = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return zeros.scatter_add(0, flat, torch.ones_like(flat))


def positions(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each pair's place among the pairs of its expert, counted in (token, slot) order: (T*k,) int64."""
    flat = top_k_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    placed = torch.arange(flat.shape[0], device=flat.device) - starts.index_select(0, flat.index_select(0, order))
    return torch.empty_like(placed).index_copy(0, order, placed)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor) -> int:
    """C = ceil(capacity_factor * tokens * top_k / num_experts): the rows each expert takes from each source
    rank (`tokens` is that rank's). The factor is read as the decimal it is written as (1.1 is 11/10), so
    C is exact: 1.1 * 10 * 2 / 2 is 11, not 12."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a positive number (e.g. 1.25); None: dropless")
    return math.ceil(Fraction(repr(capacity_factor)) * tokens * top_k / num_experts)


def capacity_dropped(top_k_index: torch.Tensor, *, num_experts: int, capacity_factor) -> torch.Tensor:
    """Which pairs capacity mode drops on this rank: (T, k) bool. The rule (per source rank, no communication,
    deterministic): each expert keeps the first C pairs this rank routes to it, in (token, slot) order, C =
    `capacity(T, k, num_experts, capacity_factor)`; the rest are dropped and add nothing to the output.
    `.sum()` is the count to report (a tensor: reading it is the caller's one sync, if it wants one)."""
    tokens, top_k = top_k_index.shape
    c = capacity(tokens, top_k, num_experts, capacity_factor)
    return (positions(top_k_index, num_experts) >= c).reshape(tokens, top_k)


def tokens_per_expert(top_k_index: torch.Tensor, num_experts: int, *, axis_name=None) -> torch.Tensor:
    """Router statistics for logging: the pairs (tokens, once per expert they chose) each expert gets,
    (num_experts,) int64, not differentiable. Inside shard_map give the data axes (e.g. ("dp", "ep")) as
    `axis_name`: the counts are summed over them (one psum; invariant over them, out spec P()). No host read."""
    counts = expert_counts(top_k_index.detach(), num_experts)
    return counts if axis_name is None else lax.psum(counts, axis_name)
