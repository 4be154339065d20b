"""ZeRO-1's collectives in buckets: one reduce-scatter of many gradients, one all-gather of many updated
pieces, as Megatron's distributed optimizer and FSDP2's flat buffers move them.

Each parameter ZeRO-1 splits is cut along one dim of its local tensor (`placements.zero1_shard_dim`) into
the data ranks' pieces, torch.chunk's sizes padded to equal ones. A bucket lays out rank r's pieces of
all its parameters side by side, then rank r+1's: one reduce-scatter of that buffer leaves each rank its
own pieces, summed, and one all-gather of each rank's pieces, side by side, rebuilds every parameter.
The buckets are `buckets.grad_buckets`'s, on the padded bytes each gradient moves; at most
`Buckets.INFLIGHT` are in flight at once.

One class serves the runtime (`runtime.zero1.Zero1Sync` issues the collectives) and the plan
(`estimates.stepmem` runs it on meta tensors, the collectives allocating what gloo allocates), so the
memory the plan charges is what the step holds, as `Buckets` does for ZeRO-0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..torch_private import local_tensor
from .buckets import InFlight, grad_buckets
from .placement.placements import chunk_rows


class DataGroup(NamedTuple):
    """The data-parallel ranks ZeRO-1 spreads one parameter's state over: their process group, the names
    of their mesh axes, this rank's index among them and their number."""

    group: object
    axes: tuple[str, ...]
    index: int
    size: int

    @property
    def axis(self) -> str:
        """The axes as one name, as the counter and the plan write them (`dp_ep`)."""
        return "_".join(self.axes)


class _Piece(NamedTuple):
    """One parameter in a bucket: where its pieces sit in a rank's part of the buffer, and how they cut it."""

    name: str
    offset: int
    dim: int
    step: int  # rows per piece (the last ones padded)
    shape: tuple[int, ...]  # a piece's shape


class Zero1Bucket(NamedTuple):
    group: DataGroup
    pieces: list[_Piece]
    numel: int  # of one rank's part


def zero1_entries(shapes: dict[str, tuple[int, ...]], dims: dict[str, int], groups, itemsize: int):
    """`(name, axes, bytes)` per parameter for `grad_buckets`: the padded gradient a reduce-scatter moves."""
    out = []
    for name, shape in shapes.items():
        d, n = dims[name], groups[name].size
        rows = -(-shape[d] // n) * n
        out.append((name, groups[name].axes, rows * (_numel(shape) // max(1, shape[d])) * itemsize))
    return out


class Zero1Buckets:
    """Reduce-scatter the gradients and all-gather the updated pieces of the parameters ZeRO-1 splits
    (`shapes`: each one's local shape, `dims`: the dim it is cut along, `groups`: its `DataGroup`), in
    buckets, gradients summed in `reduce_dtype`. `scatter` and `gather` start the collectives."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dims: dict[str, int], groups: dict[str, DataGroup],
                 reduce_dtype: torch.dtype):  # fmt: skip
        self.reduce_dtype, self.shapes = reduce_dtype, shapes
        self.buckets: list[Zero1Bucket] = []
        for _, names, _ in grad_buckets(zero1_entries(shapes, dims, groups, reduce_dtype.itemsize)):
            pieces, offset, n = [], 0, groups[names[0]].size
            for name in names:
                shape, d = list(shapes[name]), dims[name]
                shape[d] = -(-shape[d] // n)
                pieces.append(_Piece(name, offset, d, shape[d], tuple(shape)))
                offset += _numel(shape)
            self.buckets.append(Zero1Bucket(groups[names[0]], pieces, offset))

    def scatter(self, mine: torch.Tensor, buf: torch.Tensor, bucket: Zero1Bucket):
        """Start reduce-scattering `buf` (every rank's part, side by side) into `mine`; what `.wait()`s for it."""
        raise NotImplementedError

    def gather(self, full: torch.Tensor, mine: torch.Tensor, bucket: Zero1Bucket):
        """Start all-gathering every rank's `mine` into `full`; what `.wait()`s for it."""
        raise NotImplementedError

    def reduce_scatter(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's piece of each parameter's summed gradient (`params`: name to parameter), in
        `reduce_dtype`: views into each bucket's output. A parameter's gradient is freed (`.grad = None`)
        once its bucket holds it, as FSDP2 frees an unsharded gradient once reduce-scattered; where backward
        made none, zeros are summed and no piece is returned."""
        out: dict[str, torch.Tensor] = {}
        running = InFlight(lambda b, buf, mine, work, had: self._took(b, mine, work, had, out))
        for b in self.buckets:
            running.make_room()
            n, first = b.group.size, local_tensor(params[b.pieces[0].name])
            buf = torch.empty(n, b.numel, dtype=self.reduce_dtype, device=first.device)
            had = set()
            for piece in b.pieces:
                region = buf[:, piece.offset : piece.offset + _numel(piece.shape)].view(n, *piece.shape)
                p = params[piece.name]
                grad = None if p.grad is None else local_tensor(p.grad)
                _scatter_rows(region, grad, piece, self.shapes[piece.name][piece.dim])
                if grad is not None:
                    had.add(piece.name)
                p.grad = grad = None
            mine = torch.empty(b.numel, dtype=self.reduce_dtype, device=first.device)
            running.add(b, buf, mine, self.scatter(mine, buf.view(-1), b), had)  # its input held until it lands
            del buf
        running.drain()
        return out

    def _took(self, b: Zero1Bucket, mine: torch.Tensor, work, had: set, out) -> None:
        work.wait()
        for piece in b.pieces:
            if piece.name not in had:
                continue
            _, rows = chunk_rows(self.shapes[piece.name][piece.dim], b.group.size, b.group.index)
            view = mine[piece.offset : piece.offset + _numel(piece.shape)].view(piece.shape)
            out[piece.name] = view.narrow(piece.dim, 0, rows)

    def all_gather(self, pieces: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
        """Rebuild each parameter (`targets`: its local tensor, written in place) from every rank's updated
        piece (`pieces`: this rank's, any dtype)."""
        running = InFlight(lambda b, mine, full, work: self._gathered(b, full, work, targets))
        for b in self.buckets:
            running.make_room()
            n, first = b.group.size, targets[b.pieces[0].name]
            mine = torch.zeros(b.numel, dtype=first.dtype, device=first.device)
            for piece in b.pieces:
                _, rows = chunk_rows(self.shapes[piece.name][piece.dim], n, b.group.index)
                region = mine[piece.offset : piece.offset + _numel(piece.shape)].view(piece.shape)
                region.narrow(piece.dim, 0, rows).copy_(pieces[piece.name])
            full = torch.empty(n * b.numel, dtype=first.dtype, device=first.device)
            running.add(b, mine, full, self.gather(full, mine, b))
        running.drain()

    def _gathered(self, b: Zero1Bucket, full: torch.Tensor, work, targets) -> None:
        work.wait()
        n = b.group.size
        parts = full.view(n, b.numel)
        for piece in b.pieces:
            region = parts[:, piece.offset : piece.offset + _numel(piece.shape)].view(n, *piece.shape)
            _gather_rows(targets[piece.name], region, piece, n)


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def _scatter_rows(region: torch.Tensor, g: torch.Tensor | None, piece: _Piece, size: int) -> None:
    """Copy `g`'s rows into `region` (n, *piece), rank r's piece at [r], padding zeroed."""
    n = region.shape[0]
    if g is None:
        region.zero_()
        return
    if size == piece.step * n:  # even: one copy of a view
        region.copy_(g.unflatten(piece.dim, (n, piece.step)).movedim(piece.dim, 0))
        return
    for r in range(n):
        start, rows = chunk_rows(size, n, r)
        region[r].narrow(piece.dim, 0, rows).copy_(g.narrow(piece.dim, start, rows))
        region[r].narrow(piece.dim, rows, piece.step - rows).zero_()


def _gather_rows(target: torch.Tensor, region: torch.Tensor, piece: _Piece, n: int) -> None:
    """Copy every rank's piece (`region`, (n, *piece)) back into its rows of `target`."""
    size = target.shape[piece.dim]
    if size == piece.step * n:
        target.unflatten(piece.dim, (n, piece.step)).movedim(piece.dim, 0).copy_(region)
        return
    for r in range(n):
        start, rows = chunk_rows(size, n, r)
        target.narrow(piece.dim, start, rows).copy_(region[r].narrow(piece.dim, 0, rows))


__all__ = ["DataGroup", "Zero1Bucket", "Zero1Buckets", "zero1_entries"]
