"""The seam between per-shard code and communication: one small backend object per region.

`lax.psum` and the rest never talk to torch.distributed themselves. Each calls a primitive of the
region's backend, forward and (through autograd) backward, and the same `f` runs wherever a backend
exists:

- `EagerBackend` (`spmd.eager`): c10d collectives on the process groups of a DeviceMesh, NCCL or
  gloo alike, each counted in `runtime.comm.COUNTER` by phase, kind and axes;
- `MetaBackend` (here): meta tensors of the right shapes, and a `Record` per collective instead of
  a run: what a dry run and the vma check use.

A backend has `abstract` (True: meta tensors) and these primitives. `axes` is a resolved `Axes`
(names in the order given, major first: the group's ranks are ordered by `Mesh.group(rank, names)`),
`call` the `Call` to count or record it under:

    all_reduce(x, axes, op, call)            op: "sum" | "max" | "min"
    all_gather(x, axes, dim, call)           every rank's x, concatenated along dim in group order
    reduce_scatter(x, axes, dim, call)       the sum, cut along dim; this rank's block
    all_to_all(x, axes, split, concat, call) block j of split goes to rank j; received along concat
    permute(x, axes, pairs, call)            (source, dest) pairs of group indices; zeros if none
    permute_start(x, axes, pairs, call)      the same permute begun: an `InFlight` whose `wait()` gives it
    ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, call)
    all_to_all_v(x, axes, send_rows, recv_rows, call)  rows of x in blocks of send_rows[j] to index j; the
                                             blocks received (recv_rows[j] from j) in index order
    block(x, axes, dim)                      this rank's block of x along dim (no communication)
    axis_index(axes)                         this rank's index in the group, an int32 scalar

A new backend (the compiler's traced one, say) implements these; nothing in `lax` changes.
"""

from __future__ import annotations

import math

import torch

from ..modules.recompute import replaying
from ..torch_private import in_backward
from .records import Bound, Call, Record
from .region import Axes

__all__ = ["InFlight", "MetaBackend", "nbytes", "phase"]


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def phase() -> str:
    """The phase a region's collective runs in: "recompute" while a checkpointed layer replays its forward (a
    region's collectives are not cached through it: they run again), else backward or forward."""
    if not in_backward():
        return "forward"
    return "recompute" if replaying() else "backward"


class InFlight:
    """A collective under way (`permute_start`): `wait()` blocks until it is done and returns its result,
    the tensor it writes into. `work` is torch.distributed's handle (None: already done, as on meta
    tensors); `keep` holds what the transfer reads until then. The wait is bounded by the process group's
    timeout, as a blocking collective is: gloo fails the operation after it and NCCL's watchdog aborts it.
    Waiting again returns the same tensor."""

    __slots__ = ("_keep", "_result", "_work")

    def __init__(self, result: torch.Tensor, work=None, keep=None):
        self._result, self._work, self._keep = result, work, keep

    def __repr__(self) -> str:
        state = "done" if self._work is None else "under way"
        return f"InFlight({tuple(self._result.shape)}, {self._result.dtype}, {state})"

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._keep = None, None
        return self._result


def _resized(x: torch.Tensor, scale: dict[int, tuple[int, int]]) -> torch.Tensor:
    """A meta tensor like `x` with each dim `d` of `scale` multiplied and divided: `{d: (mul, div)}`."""
    shape = list(x.shape)
    for d, (mul, div) in scale.items():
        shape[d] = shape[d] * mul // div
    return torch.empty(shape, dtype=x.dtype, device="meta")


class MetaBackend:
    """Shapes and records, no communication: each primitive returns a meta tensor and appends a
    `Record` to `records` (a ragged all-to-all or all_to_all_v priced from its call's `price`, else
    from the bound its operand's rows set: every row leaves)."""

    abstract = True

    def __init__(self):
        self.records: list[Record] = []

    def _note(self, call: Call, kind: str, axes: Axes, size: int, priced: str = "exact") -> None:
        self.records.append(Record(call.op, kind, axes.names, axes.size, size, phase(), call.source, priced))

    def all_reduce(self, x, axes: Axes, op: str, call: Call):
        self._note(call, "all_reduce", axes, nbytes(x))
        return torch.empty_like(x, device="meta")

    def host_read(self, tensors: list, call: Call) -> None:
        """A read of `tensors` to the host: recorded (kind "host_sync"); a dry run has no values to read."""
        self._note(call, "host_sync", Axes((), 1), sum(nbytes(t) for t in tensors))

    def all_gather(self, x, axes: Axes, dim: int, call: Call):
        out = _resized(x, {dim: (axes.size, 1)})
        self._note(call, "all_gather", axes, nbytes(out))
        return out

    def reduce_scatter(self, x, axes: Axes, dim: int, call: Call):
        self._note(call, "reduce_scatter", axes, nbytes(x))
        return _resized(x, {dim: (1, axes.size)})

    def all_to_all(self, x, axes: Axes, split: int, concat: int, call: Call):
        self._note(call, "all_to_all", axes, nbytes(x))
        if split == concat:
            return torch.empty_like(x, device="meta")
        return _resized(x, {split: (1, axes.size), concat: (axes.size, 1)})

    def permute(self, x, axes: Axes, pairs, call: Call):
        return self.permute_start(x, axes, pairs, call).wait()

    def permute_start(self, x, axes: Axes, pairs, call: Call) -> InFlight:
        self._note(call, "send_recv", axes, nbytes(x))
        return InFlight(torch.empty_like(x, device="meta"))

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, call):
        self._note(call, "all_to_all", axes, nbytes(output_offsets))  # where each slice lands
        price = call.price or Bound(operand.shape[0] if operand.dim() else 0)
        row = nbytes(operand[0]) if operand.dim() and operand.shape[0] else 0
        self._note(call, "all_to_all", axes, price.rows * row, type(price).__name__.lower())
        return torch.empty_like(output, device="meta")

    def all_to_all_v(self, x, axes: Axes, send_rows, recv_rows, call: Call):
        price = call.price or Bound(sum(send_rows))
        row = math.prod(x.shape[1:]) * x.element_size()
        self._note(call, "all_to_all", axes, price.rows * row, type(price).__name__.lower())
        return torch.empty((sum(recv_rows),) + tuple(x.shape[1:]), dtype=x.dtype, device="meta")

    def block(self, x, axes: Axes, dim: int):
        return _resized(x, {dim: (1, axes.size)})

    def axis_index(self, axes: Axes):
        return torch.zeros((), dtype=torch.int32, device="meta")
