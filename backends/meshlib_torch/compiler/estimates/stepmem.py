"""The optimizer step's memory above the model state, on one rank, as the runtime's optimizer runs it.

`MeshOptimizer` (runtime/optim.py) first gives each master its gradient: under mixed precision a
full-precision copy of the parameter's gradient (ZeRO-1: this rank's piece, reduce-scattered in
buckets, `runtime.zero1`), all kept until the update ends; then the inner optimizer (AdamW, one
tensor at a time) updates each master with temporaries of its size; ZeRO-1 then all-gathers the
updated pieces in the same buckets. Under ZeRO-2/3 FSDP2's shards are the masters and their
gradients are already full precision. The update's temporaries are measured by running torch's own
AdamW on meta tensors of the masters' sizes; the step's peak is the model state, the gradients, these
copies and the largest moment of the update or of ZeRO-1's buckets.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from meshlib import Compute

from ...memtrack import PeakTracker
from ..buckets import Buckets, grad_buckets, most_held
from ..program import Compiled, shard_axes, shard_ranks, zero1_pieces
from .opcount import OpCounter


def step_extra(compiled: Compiled, names=None) -> int:
    """Bytes above the model state (parameters, gradients, optimizer state) at the peak of the optimizer
    step of a rank holding the parameters `names` (all by default): ZeRO-1's reduce-scatters, the
    update, or ZeRO-1's all-gathers (`_zero1_peaks`). Negative where ZeRO-1 frees more gradients than
    the step makes."""
    sizes, copies = _masters(compiled, names)
    full = next(iter(compiled.traced.params.values())).dtype
    scatter, gather, freed = _zero1_peaks(compiled, names, full, copies)
    return max(scatter, copies - freed + max(gather, _update_peak(sizes, full)))


def _zero1_peaks(compiled: Compiled, names, full: torch.dtype, copies: int) -> tuple[int, int, int]:
    """ZeRO-1's buckets (`runtime.zero1.Zero1Buckets`), at most `Buckets.INFLIGHT` in flight: the most bytes
    held, beside the gradients not yet freed, while the gradients are reduce-scattered (each bucket's
    input, its output, which holds the masters' gradients, and while it is waited for the copy of its input
    gloo sums; a parameter's own gradient is freed once its bucket holds it; where the gradients sum in
    another dtype than the masters', the outputs are held until the masters' gradients, `copies`, are
    made from them); the most above the masters' gradients while the updated pieces are all-gathered
    (each bucket's pieces and their gathered whole); and the bytes of the gradients freed. (NCCL
    reduce-scatters without gloo's copy: there the plan is one bucket's input high.)"""
    opts = compiled.options
    reduce, param = (getattr(torch, d).itemsize for d in (opts.precision.reduce, opts.precision.param))
    pieces = zero1_pieces(compiled)
    entries = [
        (n, shard_axes(compiled, n), pieces[n] * shard_ranks(compiled, n) * reduce)
        for n in compiled.traced.params
        if pieces.get(n) is not None and shard_ranks(compiled, n) > 1 and (names is None or n in names)
    ]  # fmt: skip
    grads = {n: math.prod(compiled.local_param_shape(n)) * param for n, _, _ in entries}  # in the compute dtype
    buckets = [(nbytes, shard_ranks(compiled, ns[0]), sum(grads[n] for n in ns))
               for _, ns, nbytes in grad_buckets(entries)]  # fmt: skip
    live = scatter = outputs = freed = 0
    running: list[int] = []  # the inputs of the buckets in flight, oldest first

    def wait_oldest() -> tuple[int, int]:  # gloo sums a reduce-scatter as an all-reduce of a copy of its input
        nbytes = running.pop(0)
        return max(scatter, live + nbytes), live - nbytes

    for nbytes, n, held in buckets:
        while len(running) >= Buckets.INFLIGHT:
            scatter, live = wait_oldest()
        live += nbytes  # its input
        scatter = max(scatter, live)
        live += nbytes // n - held  # its gradients freed once copied in, its output made
        outputs, freed = outputs + nbytes // n, freed + held
        scatter = max(scatter, live)
        running.append(nbytes)
    while running:
        scatter, live = wait_oldest()
    if reduce != full.itemsize:
        scatter = max(scatter, outputs + copies - freed)
    gather = most_held([nbytes // reduce * param * (n + 1) // n for nbytes, n, _ in buckets])
    return scatter, gather, freed


def optimizer_compute(compiled: Compiled, names=None) -> Compute:
    """What the update computes on a rank holding the parameters `names` (all by default): torch's AdamW, one
    tensor at a time, run on meta tensors of each master's size and counted op by op (`opcount.OpCounter`)."""
    sizes = Counter(_masters(compiled, names)[0])
    full = next(iter(compiled.traced.params.values())).dtype
    out = Compute()
    for n, k in sizes.items():
        p = torch.nn.Parameter(torch.empty(n, dtype=full, device="meta"))
        p.grad = torch.empty_like(p)
        opt = torch.optim.AdamW([p], foreach=False)
        opt.step()  # makes the state
        counter = OpCounter()
        with counter:
            opt.step()
        out = out + counter.computes().get("forward", Compute()).scaled(k)
    return out


def _masters(compiled: Compiled, names=None) -> tuple[list[int], int]:
    """The elements of each master the update steps on this rank, and the bytes of the masters' gradients
    kept until it ends."""
    opts = compiled.options
    full = next(iter(compiled.traced.params.values())).dtype
    mixed = getattr(torch, opts.precision.param) in (torch.bfloat16, torch.float16)
    pieces = zero1_pieces(compiled)
    sizes, copies = [], 0
    for name in compiled.traced.params:
        if names is not None and name not in names:
            continue
        local = math.prod(compiled.local_param_shape(name))
        if opts.zero >= 2:
            sizes.append(math.ceil(local / shard_ranks(compiled, name)))
            continue
        piece = pieces.get(name)
        size = local if piece is None else piece
        sizes.append(size)
        if mixed or piece is not None:
            copies += size * full.itemsize  # the master's gradient, kept until the update ends
    return sizes, copies


def _update_peak(sizes: list[int], dtype: torch.dtype) -> int:
    """The most bytes torch's AdamW (one tensor at a time, as `MeshOptimizer` runs it) holds above its
    parameters, gradients and state while it updates tensors of these sizes (meta tensors)."""
    if not sizes:
        return 0
    params = [torch.nn.Parameter(torch.empty(n, dtype=dtype, device="meta")) for n in sorted(set(sizes))]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW(params, foreach=False)
    opt.step()  # makes the state
    with PeakTracker() as tracker:
        tracker.baseline([*params, *(p.grad for p in params), *(v for s in opt.state.values() for v in s.values())])
        base = tracker.live
        opt.step()
    return tracker.peak - base


__all__ = ["optimizer_compute", "step_extra"]
