"""ZeRO-1's collectives in buckets: one reduce-scatter of many gradients, one all-gather of many updated
pieces, as Megatron's distributed optimizer and FSDP2's flat buffers move them.

Each parameter ZeRO-1 splits is cut along one dim of its local tensor (`placements.zero1_shard_dim`) into
the data ranks' pieces, torch.chunk's sizes padded to equal ones. A bucket lays out rank r's pieces of
all its parameters side by side, then rank r+1's: one reduce-scatter of that buffer leaves each rank its
own pieces, summed, and one all-gather of each rank's pieces, side by side, rebuilds every parameter.
The buckets are `buckets.grad_buckets`'s, on the padded bytes each gradient moves; at most
`Buckets.INFLIGHT` are in flight at once.

The reduce-scatters run behind backward where they can (`watch`), as Megatron's distributed optimizer
runs them: a bucket starts once its gradients are in and every bucket before it has started, while
gradient sync is on (the last microbatch). The gradients stay (`p.grad`, which clipping reads), and this
rank's summed pieces land beside them when backward ends, G/dp more bytes held into the step. The step
applies the pieces only while every gradient is the tensor they were cut from, unchanged since (its
version counters, the check autograd makes on the tensors it saves, and its sum and sum of squares,
which see the writes those miss); else, and where nothing ran in backward (sync off, a pipeline's
schedule), it reduce-scatters in the step.

One class serves the runtime (`runtime.zero1.Zero1Sync` issues the collectives) and the plan
(`estimates.stepmem` and `estimates.dryrun` run it on meta tensors, the collectives allocating what gloo
allocates), so the memory the plan charges is what the step holds, as `Buckets` does for ZeRO-0.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..torch_private import local_tensor, version
from .buckets import InFlight, InOrder, grad_buckets
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
    buckets, gradients summed in `reduce_dtype`. `scatter` and `gather` start the collectives (`phase`:
    "backward" from `watch`'s hooks, "optimizer" from the step)."""

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
        self.enabled = True  # `watch`'s hooks start the reduce-scatters (gradient sync on)
        self.landed: dict[str, torch.Tensor] | None = None  # the last backward's pieces, until `take`
        self._params: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, tuple | None] = {}  # per gradient packed in backward: what it was then
        self._complete = False  # every bucket of the last backward landed (`landed` is whole)
        self._order: InOrder | None = None  # `watch`'s: starts the buckets as backward fills them

    def scatter(self, mine: torch.Tensor, buf: torch.Tensor, bucket: Zero1Bucket, phase: str):
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
        running = InFlight(lambda work, b, buf, mine, had: self._took(work, b, mine, had, out))
        for b in self.buckets:
            running.make_room()
            buf, mine, had = self._pack(b, params, free=True)
            running.add(self.scatter(mine, buf.view(-1), b, "optimizer"), b, buf, mine, had)  # held until it lands
            del buf
        running.drain()
        return out

    def _pack(self, b: Zero1Bucket, params, free: bool) -> tuple[torch.Tensor, torch.Tensor, set]:
        """A bucket's input (every rank's pieces of its gradients, side by side), its output and the names
        of the gradients it holds (`free`: each freed once copied in)."""
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
            if free:
                p.grad = grad = None
        return buf, torch.empty(b.numel, dtype=self.reduce_dtype, device=first.device), had

    # -- behind backward -------------------------------------------------------------------------------
    def watch(self, params: dict[str, torch.Tensor]) -> list:
        """Reduce-scatter in backward while `enabled`: a bucket starts once every gradient in it is in and
        every bucket before it has started; at backward's end the rest start (a parameter backward did not
        reach sums zeros) and all land in `landed` (`buckets.InOrder`). Gradients are kept. Returns the
        hooks' handles."""
        self._params = params
        me = weakref.ref(self)  # the parameters' hooks must not keep dropped buckets (and their pieces) alive
        of = {piece.name: i for i, b in enumerate(self.buckets) for piece in b.pieces}
        trained = [n for n in self.shapes if params[n].requires_grad]  # a frozen one never gets a gradient
        needed = [sum(params[p.name].requires_grad for p in b.pieces) for b in self.buckets]
        self._order = InOrder(needed, lambda i: self._start(self.buckets[i]),
                              lambda work, b, buf, mine, had: self._took(work, b, mine, had, self.landed),
                              begin=self._begin, end=self._end)  # fmt: skip
        return [
            params[n].register_post_accumulate_grad_hook(lambda _, i=of[n]: me() is not None and me()._arrived(i))
            for n in trained
        ]

    def _arrived(self, i: int) -> None:
        if self.enabled:
            self._order.arrived(i)  # a late gradient (not counted) changes its stamp: the step sums afresh

    def _begin(self) -> None:
        self._complete, self.landed, self._stamps = False, {}, {}

    def _start(self, b: Zero1Bucket) -> tuple:
        buf, mine, had = self._pack(b, self._params, free=False)
        for piece in b.pieces:
            self._stamps[piece.name] = _stamp(self._params[piece.name].grad)
        return self.scatter(mine, buf.view(-1), b, "backward"), b, buf, mine, had

    def _end(self) -> None:
        self._complete = True

    def take(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The pieces the last backward reduce-scattered (as `reduce_scatter` returns them), each gradient
        then freed; None where none landed or a gradient changed since (clipped, accumulated into, cleared):
        the step then reduce-scatters them as they are."""
        landed, stamps, complete = self.landed, self._stamps, self._complete
        self.discard()
        if landed is None or not complete or not all(_unchanged(params[n].grad, s) for n, s in stamps.items()):
            return None
        for n in self.shapes:
            params[n].grad = None
        return landed

    def discard(self) -> None:
        """Drop the pieces the last backward left (a new step starts)."""
        self.landed, self._stamps, self._complete = None, {}, False

    def _took(self, work, b: Zero1Bucket, mine: torch.Tensor, had: set, out) -> None:
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
        running = InFlight(lambda work, b, mine, full: self._gathered(work, b, full, targets))
        for b in self.buckets:
            running.make_room()
            n, first = b.group.size, targets[b.pieces[0].name]
            mine = torch.zeros(b.numel, dtype=first.dtype, device=first.device)
            for piece in b.pieces:
                _, rows = chunk_rows(self.shapes[piece.name][piece.dim], n, b.group.index)
                region = mine[piece.offset : piece.offset + _numel(piece.shape)].view(piece.shape)
                region.narrow(piece.dim, 0, rows).copy_(pieces[piece.name])
            full = torch.empty(n * b.numel, dtype=first.dtype, device=first.device)
            running.add(self.gather(full, mine, b), b, mine, full)
        running.drain()

    def _gathered(self, work, b: Zero1Bucket, full: torch.Tensor, targets) -> None:
        work.wait()
        n = b.group.size
        parts = full.view(n, b.numel)
        for piece in b.pieces:
            region = parts[:, piece.offset : piece.offset + _numel(piece.shape)].view(n, *piece.shape)
            _gather_rows(targets[piece.name], region, piece, n)


def _stamp(grad: torch.Tensor | None) -> tuple | None:
    """What a gradient is: the tensor itself, its version counters (a DTensor's own and its local tensor's:
    an in-place op through the DTensor bumps only the first, one on the local tensor only the second) and
    its sum and sum of squares, as the reduce-scatter read it. The sums are there because the version
    counters miss some writes: torch's foreach ops on a DTensor, as `clip_grad_norm_` scales gradients,
    bump neither (torch 2.13), and writes through `.data` bump none by design."""
    if grad is None:
        return None
    local = local_tensor(grad)
    return weakref.ref(grad), weakref.ref(local), version(grad), version(local), _sums(local)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """Two reductions, each one pass at memory speed (float32 for narrower dtypes: a cast to float64
    makes them about 20 times slower on CPU); they need only be the same for the same values."""
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    return torch.stack([t.sum(dtype=wide), torch.linalg.vector_norm(t, dtype=wide)])


def _unchanged(grad: torch.Tensor | None, stamp: tuple | None) -> bool:
    """Whether `grad` is the gradient `stamp` was taken of, not written to since."""
    if grad is None or stamp is None:
        return grad is None and stamp is None
    was, was_local, v, v_local, sums = stamp
    local = local_tensor(grad)
    same = was() is grad and was_local() is local and (version(grad), version(local)) == (v, v_local)
    return same and torch.allclose(_sums(local), sums, rtol=0.0, atol=0.0, equal_nan=True)  # fp16's overflows


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
