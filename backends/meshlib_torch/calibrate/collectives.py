"""Micro-benchmark of gloo's collectives between the ranks of one host, run on every rank of a pool.

Each collective is called as meshlib's runtime calls it (`runtime/comm.py`, `spmd/eager.py`): the
tensor-in, tensor-out c10d calls on fp32 tensors. Gloo has no reduce-scatter of its own: c10d's gloo
group runs `reduce_scatter_single` as an all-reduce of the whole input, then keeps this rank's block,
and that is what is timed. Message sizes are the payload per rank as a plan counts it (`Collective.bytes`,
`Comm.bytes`): the tensor all-reduced, the gathered result, the input reduce-scattered, the input of an
all-to-all, the tensor one rank sends to another.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..runtime.comm import all_gather_single, reduce_scatter_single

__all__ = ["KINDS", "collective_times", "message_sizes"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def message_sizes(quick: bool) -> tuple[int, ...]:
    """Payload bytes per rank: 1 KiB to 64 MiB by factors of 4 (quick: 1 KiB to 4 MiB by factors of 16)."""
    return tuple(1 << p for p in (range(10, 23, 4) if quick else range(10, 27, 2)))


def _call(kind: str, nbytes: int):
    """A no-argument function running one `kind` collective of `nbytes` payload on this rank, and the bytes
    it really moves (the element count rounded down to a multiple of the world size)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = max(n, nbytes // 4 // n * n)
    x = torch.ones(numel)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x)), numel * 4
    if kind == "all_gather":
        out, mine = torch.empty(numel), torch.ones(numel // n)
        return (lambda: all_gather_single(out, mine)), numel * 4
    if kind == "reduce_scatter":
        out = torch.empty(numel // n)
        return (lambda: reduce_scatter_single(out, x)), numel * 4
    if kind == "all_to_all":
        out = torch.empty(numel)
        return (lambda: dist.all_to_all_single(out, x)), numel * 4
    if kind == "send_recv":
        return _ping_pong(x, torch.empty(numel), rank), numel * 4
    raise ValueError(f"collective kind {kind!r}: use one of {KINDS}")


def _ping_pong(x: torch.Tensor, y: torch.Tensor, rank: int):
    """Ranks pair up (0-1, 2-3, ...), every pair at once: the even rank sends `x` and receives it back; one
    call is one round trip (the caller halves it). A rank without a partner (odd world size) idles."""
    peer = rank ^ 1
    if peer >= dist.get_world_size():
        return lambda: None
    if rank % 2 == 0:
        return lambda: (dist.send(x, peer), dist.recv(y, peer))
    return lambda: (dist.recv(y, peer), dist.send(x, peer))


def collective_times(sizes, kinds=KINDS, *, target: float = 0.02, batches: int = 5) -> list:
    """This rank's seconds per call, as `(kind, bytes, [mean of each batch])` rows (send_recv: one way, half a
    round trip). Per kind and size: one warm-up call, whose slowest time over the ranks (an all-reduce, so
    every rank agrees) sets the calls per batch, about `target` seconds of them (at least one); then
    `batches` batches (3 when a call takes over 0.1 s), each started by a barrier. The caller takes, per
    batch, the slowest rank's mean (the time a collective keeps its ranks), then the fastest batch and the
    median one (see `compute.timed`)."""
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for size in sizes:
            fn, nbytes = _call(kind, size)
            start = time.perf_counter()
            fn()
            estimate = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
            reps = max(1, min(1000, round(target / max(estimate.item(), 1e-7))))
            means = []
            for _ in range(3 if estimate.item() > 0.1 else batches):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                means.append((time.perf_counter() - start) / reps / (2 if kind == "send_recv" else 1))
            rows.append((kind, nbytes, means))
    return rows
