"""ZeRO-1's buckets on the ranks: `compiler.zero1_buckets.Zero1Buckets` with gloo's or NCCL's
reduce-scatter and all-gather (torch's public `_single` collectives, asynchronous), each counted as the
plan lists it (`estimates.records.dp_collectives`: one of each per bucket, reason "zero-1"; a
reduce-scatter in the phase it ran in, backward or the optimizer step)."""

from __future__ import annotations

import torch

from ..compiler.zero1_buckets import Zero1Bucket, Zero1Buckets
from .comm import CommCounter, all_gather_single, reduce_scatter_single


class Zero1Sync(Zero1Buckets):
    """`Zero1Buckets` whose collectives run over each bucket's process group, counted by `counter`."""

    def __init__(self, shapes, dims, groups, reduce_dtype: torch.dtype, counter: CommCounter):
        super().__init__(shapes, dims, groups, reduce_dtype)
        self.counter = counter

    def scatter(self, mine: torch.Tensor, buf: torch.Tensor, bucket: Zero1Bucket, phase: str):
        work = reduce_scatter_single(mine, buf, group=bucket.group.group, async_op=True)
        self.counter.record(phase, "reduce_scatter", bucket.group.axis, buf.numel() * buf.element_size(), "zero-1")
        return work

    def gather(self, full: torch.Tensor, mine: torch.Tensor, bucket: Zero1Bucket):
        work = all_gather_single(full, mine, group=bucket.group.group, async_op=True)
        self.counter.record("optimizer", "all_gather", bucket.group.axis, full.numel() * full.element_size(), "zero-1")
        return work


__all__ = ["Zero1Sync"]
