"""The optimizer step's memory above the model state, on one rank, as the runtime's optimizer runs it.

`MeshOptimizer` (runtime/optim.py) first gives each master its gradient: under mixed precision a
full-precision copy of the parameter's gradient (ZeRO-1: this rank's piece, reduce-scattered in
buckets, `zero1_buckets`), all kept until the update ends; then the inner optimizer (AdamW, one
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
from ..placement.placements import zero1_shard_dim
from ..program import Compiled, fsdp_whole, shard_axes, shard_ranks, zero1_args, zero1_in_backward, zero1_pieces
from ..zero1_buckets import DataGroup, Zero1Buckets
from .opcount import OpCounter


def step_extra(compiled: Compiled, names=None) -> int:
    """Bytes above the model state (parameters, gradients, optimizer state) at the peak of the optimizer
    step of a rank holding the parameters `names` (all by default): ZeRO-1's reduce-scatters (or, where
    they ran behind backward, their pieces, held from its end), the update, or ZeRO-1's all-gathers
    (`_zero1_peaks`). Negative where ZeRO-1 frees more gradients than the step makes."""
    sizes, copies = _masters(compiled, names)
    full = next(iter(compiled.traced.params.values())).dtype
    scatter, gather, freed = _zero1_peaks(compiled, names, full, copies)
    return max(scatter, copies - freed + max(gather, _update_peak(sizes, full)))


def dry_zero1(compiled: Compiled, names=None) -> _DryZero1 | None:
    """ZeRO-1's buckets of a rank holding the parameters `names` (all by default), on meta tensors of rank
    0's shapes, whose pieces are the largest; None where ZeRO-1 splits none of them."""
    reduce = getattr(torch, compiled.options.precision.reduce)
    pieces = zero1_pieces(compiled)
    shapes, dims, groups = {}, {}, {}
    for n in compiled.traced.params:
        if pieces.get(n) is None or shard_ranks(compiled, n) < 2 or (names is not None and n not in names):
            continue
        args = zero1_args(compiled, n)
        shapes[n], dims[n] = args[0], zero1_shard_dim(*args)
        groups[n] = DataGroup(None, shard_axes(compiled, n), 0, args[1])
    return _DryZero1(shapes, dims, groups, reduce) if shapes else None


def _zero1_peaks(compiled: Compiled, names, full: torch.dtype, copies: int) -> tuple[int, int, int]:
    """ZeRO-1's buckets, run as the step runs them (`zero1_buckets.Zero1Buckets`, `dry_zero1`): the most
    bytes held above the model state while the gradients are reduce-scattered (each bucket's input until it
    lands, its output, and while it is waited for the copy of its input gloo sums, `_DryWork`; each
    gradient freed once its bucket holds it; where the gradients sum in another dtype than the masters',
    the outputs are held until the masters' gradients, `copies`, are made from them), or where backward
    reduce-scattered them (`program.zero1_in_backward`) the outputs alone, which the step starts with and
    the backward's peak holds with the rest; the most above the masters' gradients while the updated
    pieces are all-gathered; and the bytes of the gradients freed. (NCCL reduce-scatters without gloo's
    copy: there the plan is one bucket's input high.)"""
    param = getattr(torch, compiled.options.precision.param)
    buckets = dry_zero1(compiled, names)
    if buckets is None:
        return 0, 0, 0
    shapes = buckets.shapes
    params = {n: torch.nn.Parameter(torch.empty(shape, dtype=param, device="meta")) for n, shape in shapes.items()}
    for p in params.values():
        p.grad = torch.empty_like(p)
    freed = sum(p.grad.nbytes for p in params.values())
    with PeakTracker() as tracker:
        tracker.baseline([*params.values(), *(p.grad for p in params.values())])
        base = tracker.live
        out = buckets.reduce_scatter(params)  # frees the gradients
        scatter, outputs = tracker.peak - base, tracker.live - base + freed
    if zero1_in_backward(compiled):
        scatter = outputs
    if buckets.reduce_dtype.itemsize != full.itemsize:
        scatter = max(scatter, outputs + copies - freed)
    del out
    targets = {n: p.data for n, p in params.items()}
    mine = {p.name: torch.empty(p.shape, dtype=full, device="meta") for b in buckets.buckets for p in b.pieces}
    with PeakTracker() as tracker:
        tracker.baseline([*targets.values(), *mine.values()])
        base = tracker.live
        buckets.all_gather(mine, targets)
        gather = tracker.peak - base
    return scatter, gather, freed


class _DryZero1(Zero1Buckets):
    """`Zero1Buckets` on meta tensors: nobody sums or gathers; a reduce-scatter's wait allocates the copy
    of its input gloo sums (its reduce-scatter is an all-reduce of a copy of the input)."""

    def scatter(self, mine, buf, bucket, phase):
        return _DryWork(buf)

    def gather(self, full, mine, bucket):
        return _DryWork(None)


class _DryWork:
    """A collective's wait on meta tensors: a reduce-scatter's (`copied`: its input) holds a copy of the
    input while gloo sums it; an all-gather's nothing more."""

    def __init__(self, copied: torch.Tensor | None):
        self.copied = copied

    def wait(self) -> None:
        if self.copied is not None:
            torch.empty_like(self.copied)  # held while the sum runs, then freed


def accumulation_compute(compiled: Compiled, names, m: int) -> Compute:
    """Per microbatch, autograd's adds summing a step's `m` microbatch gradients of the trained parameters
    among `names` (`meshlib.Compute.accumulation`: the first is kept, each later one added), which a one
    microbatch dry run does not meet: into gradients in the parameter dtype, or where FSDP2 accumulates
    them (ZeRO-2/3, the sync off) in the reduce dtype."""
    opts, params = compiled.options, compiled.traced.params
    new, reduce = (getattr(torch, d).itemsize for d in (opts.precision.param, opts.precision.reduce))
    whole = fsdp_whole(compiled) if opts.zero >= 2 else set()
    held: dict[int, tuple[int, int]] = {}  # the held gradients' itemsize: (elements, tensors)
    for n in names:
        if params[n].requires_grad:
            size = reduce if opts.zero >= 2 and n not in whole else new
            elements, tensors = held.get(size, (0, 0))
            held[size] = (elements + math.prod(compiled.local_param_shape(n)), tensors + 1)
    return sum((Compute.accumulation(e, m, new, size, t) for size, (e, t) in held.items()), Compute())


def optimizer_compute(compiled: Compiled, names=None) -> Compute:
    """What the update computes on a rank holding the parameters `names` (all by default): torch's AdamW, one
    tensor at a time, run on meta tensors of each master's size and counted op by op (`opcount.OpCounter`).
    Of each tensor's traffic, one read of the parameter, its gradient and its state and one write of the
    parameter and the state are `bytes`; the rest re-touches them, op after op, while they and the update's
    temporaries are the working set (`Compute.reused`: from cache where that fits)."""
    sizes = Counter(_masters(compiled, names)[0])
    full = next(iter(compiled.traced.params.values())).dtype
    out = Compute()
    for n, k in sizes.items():
        p = torch.nn.Parameter(torch.empty(n, dtype=full, device="meta"))
        p.grad = torch.empty_like(p)
        opt = torch.optim.AdamW([p], foreach=False)
        opt.step()  # makes the state
        counter = OpCounter()
        with PeakTracker() as tracker, counter:  # one step: its traffic, and the temporaries it makes
            tracker.baseline([p, p.grad, *opt.state[p].values()])
            base = tracker.live
            opt.step()
        c = counter.computes().get("forward", Compute())
        state = sum(v.nbytes for v in opt.state[p].values() if v.numel() == n)  # not the step count
        once = min(c.bytes, (p.nbytes + p.grad.nbytes + state) + (p.nbytes + state))
        held = p.nbytes + p.grad.nbytes + state + tracker.peak - base  # those and the update's temporaries
        out = out + Compute(c.matmuls, c.flops, once, c.ops, ((held, c.bytes - once),)).scaled(k)
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


__all__ = ["accumulation_compute", "dry_zero1", "optimizer_compute", "step_extra"]
