"""The optimizer step's memory above the model state, on one rank, as the runtime's optimizer runs it.

`MeshOptimizer` (runtime/optim.py) first gives each master its gradient: under mixed precision a
full-precision copy of the parameter's gradient (ZeRO-1: of this rank's piece, reduce-scattered
from a full-precision copy of the whole local gradient), all kept until the update ends; then
the inner optimizer (AdamW, one tensor at a time) updates each master with temporaries of its
size. Under ZeRO-2/3 FSDP2's shards are the masters and their gradients are already full
precision. The update's temporaries are measured by running torch's own AdamW on meta tensors of
the masters' sizes; the step's peak is the model state, the gradients, these copies and the
largest moment of the update.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from meshlib import Compute

from ...memtrack import PeakTracker
from ..program import Compiled, shard_ranks, zero1_pieces
from .opcount import OpCounter


def step_extra(compiled: Compiled, names=None) -> int:
    """Bytes above the model state (parameters, gradients, optimizer state) at the peak of the optimizer
    step of a rank holding the parameters `names` (all by default)."""
    sizes, copies, largest = _masters(compiled, names)
    full = next(iter(compiled.traced.params.values())).dtype
    return copies + max(largest, _update_peak(sizes, full))


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


def _masters(compiled: Compiled, names=None) -> tuple[list[int], int, int]:
    """The elements of each master the update steps on this rank, the bytes of the masters' gradients kept
    until it ends, and the largest temporary of a ZeRO-1 reduce-scatter."""
    opts = compiled.options
    full = next(iter(compiled.traced.params.values())).dtype
    mixed = getattr(torch, opts.precision.param) in (torch.bfloat16, torch.float16)
    pieces = zero1_pieces(compiled)
    sizes, copies, largest = [], 0, 0
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
        if piece is not None:  # a full-precision copy of the local gradient, reduce-scattered into the piece
            largest = max(largest, 2 * local * full.itemsize)
    return sizes, copies, largest


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
