"""`EagerBackend`: the per-shard collectives on a DeviceMesh's process groups, NCCL or gloo alike.

A group over several axes is `runtime.dist.group` over them in mesh order; an axis name that lists
them in another order (JAX allows `("tp", "dp")`) only renumbers the ranks, so blocks are put in the
order the name gives (`order[i]`: the group rank of the name's index `i`). A point-to-point permute
and a ragged exchange are one `all_to_all_single` with split sizes (zero for ranks it skips), which
both backends run without send/recv pairing; `permute_start` issues the permute with `async_op=True` and
returns at once (`backend.InFlight`: its `wait()` finishes it), so the bytes move while the caller computes.
Every call is counted in `COUNTER`: logical bytes per rank (an all-gather its output, a reduce-scatter
its input, a ragged exchange the rows it sends, an all_to_all_v the rows it sends to other ranks).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as c10d

from meshlib import Mesh

from ..runtime import dist
from ..runtime.comm import COUNTER, CommCounter
from .backend import InFlight, nbytes, phase
from .records import Call
from .region import Axes

__all__ = ["EagerBackend"]

# torch 2.13 names the tensor-in, tensor-out collectives *_single; older releases only the old names
_gather_into = getattr(c10d, "all_gather_single", None) or c10d.all_gather_into_tensor
_scatter_from = getattr(c10d, "reduce_scatter_single", None) or c10d.reduce_scatter_tensor
_OPS = {"sum": c10d.ReduceOp.SUM, "max": c10d.ReduceOp.MAX, "min": c10d.ReduceOp.MIN}


def _merge(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """(n, ..., d, ...) -> (..., n*d, ...): the n blocks concatenated along `dim`."""
    moved = stacked.movedim(0, dim)
    shape = list(moved.shape)
    return moved.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2 :])


def _split(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """(..., n*d, ...) -> (n, ..., d, ...): the n blocks of `dim`, stacked."""
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1 :]).movedim(dim, 0)


class EagerBackend:
    """Collectives on the process groups of `dm` (the DeviceMesh of `mesh`), counted in `counter`."""

    abstract = False

    def __init__(self, mesh: Mesh, dm, counter: CommCounter = COUNTER):
        self.mesh, self.dm, self.counter = mesh, dm, counter
        self.rank = c10d.get_rank()
        self._groups: dict[tuple[str, ...], tuple] = {}

    def _group(self, axes: Axes) -> tuple:
        """(process group, order, inverse): `order[i]` is the group rank of index `i` in `axes`' order."""
        if axes.names not in self._groups:
            ordered = tuple(a for a in self.mesh.axis_names if a in axes.names)
            pg = dist.group(self.dm, ordered)
            by_pg = self.mesh.group(self.rank, ordered)
            order = [by_pg.index(r) for r in self.mesh.group(self.rank, axes.names)]
            inverse = [order.index(j) for j in range(len(order))]
            self._groups[axes.names] = (pg, order, inverse)
        return self._groups[axes.names]

    def index(self, axes: Axes) -> int:
        return self.mesh.axis_coord(self.rank, axes.names)

    def _count(self, call: Call, kind: str, axes: Axes, size: int) -> None:
        self.counter.record(phase(), kind, str(axes), size, f"{call.op}@{call.source}")

    def host_read(self, tensors: list, call: Call) -> list[list]:
        """The values of `tensors` as Python lists, in one device-to-host read (counted: kind "host_sync")."""
        self._count(call, "host_sync", Axes((), 1), sum(nbytes(t) for t in tensors))
        flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
        edges = [0, *itertools.accumulate(t.numel() for t in tensors)]
        return [flat[a:b] for a, b in zip(edges, edges[1:])]

    def all_reduce(self, x, axes: Axes, op: str, call: Call):
        self._count(call, "all_reduce", axes, nbytes(x))
        out = x.contiguous().clone()
        c10d.all_reduce(out, op=_OPS[op], group=self._group(axes)[0])
        return out

    def all_gather(self, x, axes: Axes, dim: int, call: Call):
        pg, order, _ = self._group(axes)
        x = x.contiguous()
        flat = torch.empty(axes.size * x.numel(), dtype=x.dtype, device=x.device)
        _gather_into(flat, x.reshape(-1), group=pg)
        out = _merge(flat.reshape((axes.size,) + tuple(x.shape))[order], dim)
        self._count(call, "all_gather", axes, nbytes(out))
        return out

    def reduce_scatter(self, x, axes: Axes, dim: int, call: Call):
        pg, _, inverse = self._group(axes)
        self._count(call, "reduce_scatter", axes, nbytes(x))
        stacked = _split(x, axes.size, dim)[inverse].contiguous()
        out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
        _scatter_from(out.view(-1), stacked.view(-1), group=pg)
        return out

    def all_to_all(self, x, axes: Axes, split: int, concat: int, call: Call):
        pg, order, inverse = self._group(axes)
        self._count(call, "all_to_all", axes, nbytes(x))
        parts = _split(x, axes.size, split)[inverse].contiguous()
        out = torch.empty_like(parts)
        c10d.all_to_all_single(out, parts, group=pg)
        return _merge(out[order], concat)

    def permute(self, x, axes: Axes, pairs, call: Call):
        return self.permute_start(x, axes, pairs, call).wait()

    def permute_start(self, x, axes: Axes, pairs, call: Call) -> InFlight:
        """The permute begun (`async_op=True`): the bytes move while the caller computes, until `wait()`."""
        pg, order, _ = self._group(axes)
        self._count(call, "send_recv", axes, nbytes(x))
        me, size = self.index(axes), x.numel()
        dest = {s: d for s, d in pairs}.get(me)
        source = {d: s for s, d in pairs}.get(me)
        sends = [size if dest is not None and j == order[dest] else 0 for j in range(axes.size)]
        recvs = [size if source is not None and j == order[source] else 0 for j in range(axes.size)]
        flat = x.contiguous().reshape(-1) if dest is not None else x.new_empty(0)
        out = x.new_empty(x.shape) if source is not None else torch.zeros_like(x)
        into = out.view(-1) if source is not None else x.new_empty(0)
        work = c10d.all_to_all_single(into, flat, recvs, sends, group=pg, async_op=True)
        return InFlight(out, work, (flat, into))

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, call):
        pg, order, inverse = self._group(axes)
        landing = self.all_to_all(output_offsets, axes, 0, 0, call).tolist()  # where my received slices go
        starts, sends, recvs = input_offsets.tolist(), send_sizes.tolist(), recv_sizes.tolist()
        per = len(sends) // axes.size
        rows = operand.reshape(operand.shape[0], -1) if operand.dim() else operand.reshape(1, 1)
        width = rows.shape[1]
        slots = [range(inverse[j] * per, (inverse[j] + 1) * per) for j in range(axes.size)]  # by group rank
        packed = [rows[starts[k] : starts[k] + sends[k]] for slot in slots for k in slot]
        send_buf = torch.cat(packed) if packed else rows[:0]
        send_rows = [sum(sends[k] for k in slot) for slot in slots]
        recv_rows = [sum(recvs[k] for k in slot) for slot in slots]
        recv_buf = rows.new_empty((sum(recv_rows), width))
        self._count(call, "all_to_all", axes, sum(send_rows) * width * operand.element_size())
        c10d.all_to_all_single(
            recv_buf.view(-1), send_buf.contiguous().view(-1), [r * width for r in recv_rows],
            [r * width for r in send_rows], group=pg,
        )  # fmt: skip
        result = output.clone(memory_format=torch.contiguous_format)
        flat = result.view(result.shape[0], -1) if result.dim() else result.view(1, 1)
        pieces = iter(recv_buf.split([recvs[k] for slot in slots for k in slot]))
        for k in (k for slot in slots for k in slot):
            flat[landing[k] : landing[k] + recvs[k]] = next(pieces)
        return result

    def all_to_all_v(self, x, axes: Axes, send_rows, recv_rows, call: Call):
        pg, order, inverse = self._group(axes)  # inverse[g]: the index along `axes` of group rank g
        leaving = sum(send_rows) - send_rows[self.index(axes)]
        self._count(call, "all_to_all", axes, leaving * math.prod(x.shape[1:]) * x.element_size())
        same = inverse == list(range(axes.size))
        x = x.contiguous() if same else torch.cat([x.split(list(send_rows))[i] for i in inverse])
        sends, recvs = [send_rows[i] for i in inverse], [recv_rows[i] for i in inverse]
        out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
        c10d.all_to_all_single(out, x, recvs, sends, group=pg)
        return out if same else torch.cat([out.split(recvs)[g] for g in order])

    def block(self, x, axes: Axes, dim: int):
        size = x.shape[dim] // axes.size
        return x.narrow(dim, self.index(axes) * size, size)

    def axis_index(self, axes: Axes):
        return torch.tensor(self.index(axes), dtype=torch.int32, device=self.dm.device_type)
