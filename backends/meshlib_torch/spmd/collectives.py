"""The collectives as autograd functions over a region's backend, each with the transpose JAX gives it.

Forward and backward both call the backend the region had when the op ran, so a dry run records
backward collectives too. Under vma typing (`check_vma=True`) the transposes are those of
`jax/_src/lax/parallel.py`: psum's is the identity (a pvary: the cotangent of an invariant value is
already whole; a second psum there is Megatron's f/g bug), pvary's is a psum, all_gather's a
psum_scatter and back, all_gather_invariant's this rank's block, all_to_all's the swapped all_to_all,
ppermute's the inverse permutation, ragged_all_to_all's the reverse exchange (and meshlib's
all_to_all_v's, the exchange with its row counts swapped). Untyped (`check_vma=False`), JAX makes
psum its own transpose and all_gather_invariant an all_gather (its slice would be wrong there), with
the boundary scaling in `spmd.boundary`.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from .records import Call
from .region import Axes, Region

__all__ = [
    "AllGather", "AllGatherInvariant", "AllToAll", "AllToAllV", "Hop", "Permute", "PermuteStart", "PermuteWait", "Psum",
    "PsumScatter", "Ragged", "Reduce",
]  # fmt: skip


class _Collective(Function):
    """Saves what every transpose needs: the region (its backend and typing), the axes and the call."""

    @staticmethod
    def setup(ctx, region: Region, axes: Axes, call: Call) -> None:
        ctx.region, ctx.axes, ctx.call = region, axes, call
        ctx.backend = region.backend


class Psum(_Collective):
    @staticmethod
    def forward(ctx, x, region, axes, call):
        _Collective.setup(ctx, region, axes, call)
        return region.backend.all_reduce(x, axes, "sum", call)

    @staticmethod
    def backward(ctx, grad):
        out = grad if ctx.region.check_vma else ctx.backend.all_reduce(grad, ctx.axes, "sum", ctx.call)
        return out, None, None, None


class Reduce(_Collective):
    """pmax / pmin: JAX defines no derivative for them."""

    @staticmethod
    def forward(ctx, x, region, axes, call, op: str):
        _Collective.setup(ctx, region, axes, call)
        return region.backend.all_reduce(x, axes, op, call)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError(
            f"lax.{ctx.call.op} at {ctx.call.source} has no derivative (JAX defines none). Fix: reduce a "
            f"detached value, lax.{ctx.call.op}(x.detach(), ...), as a numerically stable softmax does"
        )


class AllGather(_Collective):
    @staticmethod
    def forward(ctx, x, region, axes, call, dim: int):
        _Collective.setup(ctx, region, axes, call)
        ctx.dim = dim
        return region.backend.all_gather(x, axes, dim, call)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backend.reduce_scatter(grad, ctx.axes, ctx.dim, ctx.call), None, None, None, None


class AllGatherInvariant(AllGather):
    @staticmethod
    def backward(ctx, grad):
        if not ctx.region.check_vma:
            return AllGather.backward(ctx, grad)
        return ctx.backend.block(grad, ctx.axes, ctx.dim), None, None, None, None


class PsumScatter(_Collective):
    @staticmethod
    def forward(ctx, x, region, axes, call, dim: int):
        _Collective.setup(ctx, region, axes, call)
        ctx.dim = dim
        return region.backend.reduce_scatter(x, axes, dim, call)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backend.all_gather(grad, ctx.axes, ctx.dim, ctx.call), None, None, None, None


class AllToAll(_Collective):
    @staticmethod
    def forward(ctx, x, region, axes, call, split: int, concat: int):
        _Collective.setup(ctx, region, axes, call)
        ctx.split, ctx.concat = split, concat
        return region.backend.all_to_all(x, axes, split, concat, call)

    @staticmethod
    def backward(ctx, grad):
        out = ctx.backend.all_to_all(grad, ctx.axes, ctx.concat, ctx.split, ctx.call)
        return out, None, None, None, None, None


class AllToAllV(_Collective):
    """meshlib's all_to_all_v (host row counts): the transpose sends each block back, counts swapped."""

    @staticmethod
    def forward(ctx, x, region, axes, call, send_rows: tuple, recv_rows: tuple):
        _Collective.setup(ctx, region, axes, call)
        ctx.rows = send_rows, recv_rows
        return region.backend.all_to_all_v(x, axes, send_rows, recv_rows, call)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.rows
        out = ctx.backend.all_to_all_v(grad, ctx.axes, recv_rows, send_rows, ctx.call)
        return out, None, None, None, None, None


class Permute(_Collective):
    @staticmethod
    def forward(ctx, x, region, axes, call, pairs: tuple):
        _Collective.setup(ctx, region, axes, call)
        ctx.pairs = pairs
        return region.backend.permute(x, axes, pairs, call)

    @staticmethod
    def backward(ctx, grad):
        inverse = tuple((d, s) for s, d in ctx.pairs)
        return ctx.backend.permute(grad, ctx.axes, inverse, ctx.call), None, None, None, None


class Hop:
    """One asynchronous ppermute of one tensor (`lax.ppermute_start`): what its start and its wait share.
    `sent` is the forward transfer under way (`backend.InFlight`), `returned` the backward's: the cotangent
    sent back by the inverse permutation, begun by the wait's backward and finished by the start's."""

    __slots__ = ("axes", "call", "pairs", "region", "returned", "sent")

    def __init__(self, region: Region, axes: Axes, call: Call, pairs: tuple):
        self.region, self.axes, self.call, self.pairs = region, axes, call, pairs
        self.sent = self.returned = None

    def inverse(self) -> tuple:
        return tuple((d, s) for s, d in self.pairs)


class PermuteStart(Function):
    """ppermute, begun: starts the transfer of `x` and returns a token (an empty tensor) for `PermuteWait`,
    so that autograd orders the two. Backward: waits for the cotangent `PermuteWait`'s backward sent back
    (the token's own gradient is empty), which travelled while autograd ran the nodes between them."""

    @staticmethod
    def forward(ctx, x, hop: Hop):
        ctx.hop = hop
        hop.sent = hop.region.backend.permute_start(x, hop.axes, hop.pairs, hop.call)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, token_grad):
        hop = ctx.hop
        returned, hop.returned = hop.returned, None
        if returned is None:  # only if autograd skipped the wait's backward, which it runs first
            raise RuntimeError(f"lax.ppermute_start at {hop.call.source}: its wait's backward did not run first")
        return returned.wait(), None


class PermuteWait(Function):
    """ppermute, finished: waits for the transfer `PermuteStart` began and returns what arrived. Backward:
    begins the inverse permutation of the cotangent and returns at once; `PermuteStart`'s backward waits."""

    @staticmethod
    def forward(ctx, token, hop: Hop):
        ctx.hop = hop
        sent, hop.sent = hop.sent, None
        return sent.wait()

    @staticmethod
    def backward(ctx, grad):
        hop = ctx.hop
        hop.returned = hop.region.backend.permute_start(grad, hop.axes, hop.inverse(), hop.call)
        return grad.new_empty(0), None


class Ragged(_Collective):
    """jax.lax.ragged_all_to_all; the transpose is `_ragged_all_to_all_transpose` in jax: the received
    slices go back where they came from, and the output's gradient loses them."""

    @staticmethod
    def forward(ctx, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, region, axes, call):
        _Collective.setup(ctx, region, axes, call)
        sizes = (input_offsets, send_sizes, output_offsets, recv_sizes)
        ctx.save_for_backward(*sizes)
        ctx.operand_shape = operand.shape
        return region.backend.ragged_all_to_all(operand, output, *sizes, axes, call)

    @staticmethod
    def backward(ctx, grad):
        input_offsets, send_sizes, output_offsets, recv_sizes = ctx.saved_tensors
        backend, axes, call = ctx.backend, ctx.axes, ctx.call
        landed = backend.all_to_all(output_offsets, axes, 0, 0, call)  # where my received slices are
        came_from = backend.all_to_all(input_offsets, axes, 0, 0, call)  # where they were on their senders
        zeros = grad.new_zeros(ctx.operand_shape)
        operand_grad = backend.ragged_all_to_all(grad, zeros, landed, recv_sizes, came_from, send_sizes, axes, call)
        output_grad = grad * (1 - _received(grad, landed, recv_sizes))
        return (operand_grad, output_grad) + (None,) * 7


def _received(t: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """1 on the rows of `t` that slices [start, start + size) cover, else 0, shaped to broadcast."""
    rows = t.shape[0]
    edges = torch.zeros(rows + 1, dtype=t.dtype, device=t.device)
    some = (sizes > 0).to(t.dtype)
    edges.index_add_(0, starts.long().clamp(0, rows), some)
    edges.index_add_(0, (starts + sizes).long().clamp(0, rows), -some)
    return edges.cumsum(0)[:rows].reshape((rows,) + (1,) * (t.dim() - 1))
