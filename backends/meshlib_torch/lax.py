"""jax.lax's collectives for per-shard code inside `meshlib_torch.shard_map`, with JAX's names,
arguments, typing and derivatives (jax 0.10, `jax/_src/lax/parallel.py`).

Each takes an axis name of the shard_map's mesh, or a tuple of them (major first, as JAX orders the
ranks), and maps over a pytree of tensors as jax.lax does. Under `check_vma` an input that does not
vary over the axes yet is cast first (JAX's implicit pvary), and the result's varying axes follow
JAX: a reduction drops its axes, `all_gather` keeps them and `all_gather_invariant` drops them,
`axis_index` varies over its axes. `psum(1, "tp")` is the axis size, as in JAX.

- reductions: `psum`, `pmean`, `pmax`, `pmin`
- gathers and scatters: `all_gather`, `all_gather_invariant`, `psum_scatter`
- exchanges: `all_to_all`, `ppermute`, `ragged_all_to_all` (dropless expert parallelism; `price=`
  `Bound(rows)` or `Expected(rows)` tells a dry run how many rows this rank sends)
- meshlib's extensions, which JAX has not: `all_to_all_v`, an exchange of row counts known on the host;
  `ppermute_start`, a ppermute that runs while the caller computes (`Pending.wait()` finishes it)
- where this shard is: `axis_index`, `axis_size`
- typing: `pcast(x, axes, to="varying")` (jax 0.10 removed `pvary` in favour of it)

Example (inside `shard_map(f, mesh=Mesh(tp=4), in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())`):

    def f(h, w2):
        return lax.psum(h @ w2, "tp")   # row-parallel: partial sums -> the whole, invariant over tp
"""

from __future__ import annotations

import optree
import torch

from .spmd import collectives as C
from .spmd.records import Bound, Call, Expected
from .spmd.region import Axes, Region, current, user_line
from .spmd.vma import pvary, set_vma, vma

__all__ = [
    "Bound", "Expected", "Pending", "all_gather", "all_gather_invariant", "all_to_all", "all_to_all_v", "axis_index",
    "axis_size", "pcast", "pmax", "pmean", "pmin", "ppermute", "ppermute_start", "psum", "psum_scatter",
    "ragged_all_to_all",
]  # fmt: skip


def _start(op: str, axis_name, axis_index_groups=None) -> tuple[Region, Axes, Call]:
    region = current(op)
    if axis_index_groups is not None:
        raise ValueError(f"lax.{op}: axis_index_groups is not supported. Fix: give the axes as a mesh of their own")
    call = Call(op, user_line())
    return region, region.axes(axis_name, op, call.source), call


def _operand(region: Region, x, axes: Axes, call: Call, op: str) -> torch.Tensor:
    """`x` as a collective takes it: a tensor (meta in a dry run), cast to vary over `axes` (JAX's
    `insert_collective_pvary`) when values are typed."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"lax.{op} takes tensors (or pytrees of them); got {type(x).__name__} at {call.source}")
    x = region.mode.local(x) if region.mode is not None else x
    return pvary(x, region, axes.names, call) if region.check_vma else x


def _apply(region: Region, fn, *args, varies: frozenset) -> torch.Tensor:
    """`fn.apply(*args)`, its arithmetic untyped, the result typed `varies` (nothing when untyped)."""
    with region.untyped():
        out = fn.apply(*args)
    return set_vma(out, varies if region.check_vma else frozenset())


def _dim(d: int, ndim: int, what: str, op: str) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"lax.{op}: {what}={d} is out of range for {ndim} dims")
    return d % ndim


def _fits(size: int, axes: Axes, tiled: bool, what: str, call: Call) -> None:
    """A dim cut over `axes`: tiled, a multiple of their size; untiled, exactly it (one slot per rank)."""
    if size % axes.size if tiled else size != axes.size:
        need = f"a multiple of {axes.size}" if tiled else f"exactly {axes.size} (untiled: one slot per rank)"
        raise ValueError(
            f"lax.{call.op} over {axes.names} at {call.source}: {what} has size {size}, which must be {need}, the "
            f"size of {axes.names}. Fix: pad that dim, or pass tiled=True to cut it in {axes.size} blocks"
        )


# -- reductions ----------------------------------------------------------------------------------
def _reduce(op: str, x, axis_name, how: str, axis_index_groups):
    region, axes, call = _start(op, axis_name, axis_index_groups)

    def leaf(t):
        if isinstance(t, (int, float, bool)) and not isinstance(t, torch.Tensor):
            return t * axes.size if how == "sum" else t  # a constant is the same on every rank
        t = _operand(region, t, axes, call, op)
        if t.dtype == torch.bool and how == "sum":  # as jax: booleans are summed as int32
            with region.untyped():
                t = set_vma(t.to(torch.int32), vma(t))
        fn, extra = (C.Psum, ()) if how == "sum" else (C.Reduce, (how,))
        return _apply(region, fn, t, region, axes, call, *extra, varies=vma(t) - set(axes.names))

    return optree.tree_map(leaf, x)


def psum(x, axis_name, *, axis_index_groups=None):
    """The sum over the ranks of `axis_name`; invariant over them. Backward: the identity under
    check_vma (the cotangent is already invariant)."""
    return _reduce("psum", x, axis_name, "sum", axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
    """`psum(x) / axis_size`."""
    size = _start("pmean", axis_name, axis_index_groups)[1].size
    return optree.tree_map(lambda t: t / size, _reduce("pmean", x, axis_name, "sum", axis_index_groups))


def pmax(x, axis_name, *, axis_index_groups=None):
    """The elementwise max over the ranks of `axis_name` (no derivative, as in JAX)."""
    return _reduce("pmax", x, axis_name, "max", axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
    """The elementwise min over the ranks of `axis_name` (no derivative, as in JAX)."""
    return _reduce("pmin", x, axis_name, "min", axis_index_groups)


# -- gathers and scatters ------------------------------------------------------------------------
def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False, to: str = "varying"):
    """Every rank's `x`: stacked on a new dim `axis`, or concatenated along `axis` when `tiled`. The
    result still varies over `axis_name` (`to="invarying"`: it does not; that is
    `all_gather_invariant`). Backward: psum_scatter."""
    op = "all_gather" if to == "varying" else "all_gather_invariant"
    if to not in ("varying", "invarying"):
        raise ValueError(f"lax.all_gather(to={to!r}): use 'varying' or 'invarying' ('reduced' is not supported)")
    region, axes, call = _start(op, axis_name, axis_index_groups)

    def leaf(t):
        t = _operand(region, t, axes, call, op)
        dim = _dim(axis, t.dim() + (not tiled), "axis", op)
        if not tiled:
            with region.untyped():
                t = set_vma(t.unsqueeze(dim), vma(t))
        varies = vma(t) if to == "varying" else vma(t) - set(axes.names)
        fn = C.AllGather if to == "varying" else C.AllGatherInvariant
        return _apply(region, fn, t, region, axes, call, dim, varies=varies)

    return optree.tree_map(leaf, x)


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """`all_gather` whose result is invariant over `axis_name`; backward: this rank's block (no
    communication), as `jax.lax.all_gather(..., to="invarying")`."""
    return all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None, tiled: bool = False):
    """`psum(x)` cut along `scatter_dimension`, this rank keeping its block (that dim removed unless
    `tiled`); still varying over `axis_name`. Backward: all_gather."""
    region, axes, call = _start("psum_scatter", axis_name, axis_index_groups)

    def leaf(t):
        t = _operand(region, t, axes, call, "psum_scatter")
        dim = _dim(scatter_dimension, t.dim(), "scatter_dimension", "psum_scatter")
        _fits(t.shape[dim], axes, tiled, f"scatter_dimension {dim}", call)
        out = _apply(region, C.PsumScatter, t, region, axes, call, dim, varies=vma(t))
        if not tiled:
            with region.untyped():
                out = set_vma(out.squeeze(dim), vma(out))
        return out

    return optree.tree_map(leaf, x)


# -- exchanges -------------------------------------------------------------------------------------
def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, axis_index_groups=None, tiled: bool = False):
    """Block `j` of `split_axis` goes to rank `j`; the blocks received are concatenated along
    `concat_axis` (untiled: `split_axis` has the axis size and is replaced by a new dim at
    `concat_axis`, as in JAX). Backward: the all_to_all with the two swapped."""
    region, axes, call = _start("all_to_all", axis_name, axis_index_groups)

    def leaf(t):
        t = _operand(region, t, axes, call, "all_to_all")
        split = _dim(split_axis, t.dim(), "split_axis", "all_to_all")
        concat = _dim(concat_axis, t.dim(), "concat_axis", "all_to_all")
        _fits(t.shape[split], axes, tiled, f"split_axis {split}", call)
        varies = vma(t)
        with region.untyped():
            if not tiled and split != concat:  # as jax's all_to_all: a new dim to receive into, then squeeze
                concat, split = (concat + 1, split) if split < concat else (concat, split + 1)
                t = t.unsqueeze(concat)
            out = C.AllToAll.apply(t, region, axes, call, split, concat)
            out = out.squeeze(split) if not tiled and split != concat else out
        return set_vma(out, varies)

    return optree.tree_map(leaf, x)


def ppermute(x, axis_name, perm):
    """Rank `src` sends `x` to rank `dst` for each `(src, dst)` in `perm` (indices along `axis_name`);
    a rank no one sends to gets zeros. Backward: the inverse permutation.

    Over a tuple of axes the indices count ranks in mesh order whatever the tuple's order, as jax's
    lowering does (it sorts the group's devices); `axis_index` follows the tuple's order."""
    region, axes, call, pairs = _permutation("ppermute", axis_name, perm)

    def leaf(t):
        t = _operand(region, t, axes, call, "ppermute")
        return _apply(region, C.Permute, t, region, axes, call, pairs, varies=vma(t))

    return optree.tree_map(leaf, x)


def ppermute_start(x, axis_name, perm) -> Pending:
    """meshlib's extension (JAX has none: XLA schedules its collectives asynchronously by itself): `ppermute`
    begun, not finished. Returns a `Pending` at once, while the bytes move; its `wait()` gives what
    `ppermute(x, axis_name, perm)` would. Compute issued in between overlaps the transfer:

        pending = lax.ppermute_start(kv, "cp", ring)   # the next hop, under way
        out = attend(q, kv)                            # this hop's block, meanwhile
        kv = pending.wait()

    Backward likewise: the wait's backward begins the inverse permutation of the cotangent and the start's
    finishes it, so the gradient travels while autograd runs the nodes recorded between the two (it runs
    later-recorded nodes first). Counted and recorded as `ppermute` (kind "send_recv"), the same bytes.
    Call `wait()` on every rank, in the same order relative to the other collectives of the group."""
    region, axes, call, pairs = _permutation("ppermute", axis_name, perm)

    def leaf(t):
        t = _operand(region, t, axes, call, "ppermute")
        hop = C.Hop(region, axes, call, pairs)
        return _apply(region, C.PermuteStart, t, hop, varies=vma(t)), hop

    leaves, treedef = optree.tree_flatten(x)
    return Pending(region, treedef, [leaf(t) for t in leaves])


class Pending:
    """A `ppermute_start` under way; `wait()` finishes it and returns the permuted values (the same ones if
    called again)."""

    __slots__ = ("_done", "_hops", "_region", "_treedef")

    def __init__(self, region: Region, treedef, hops: list):
        self._region, self._treedef, self._hops, self._done = region, treedef, hops, None

    def __repr__(self) -> str:
        return f"Pending(ppermute of {len(self._hops)} tensors, {'done' if self._done is not None else 'under way'})"

    def wait(self):
        if self._done is None:
            outs = [_apply(self._region, C.PermuteWait, token, hop, varies=vma(token)) for token, hop in self._hops]
            self._done, self._hops = optree.tree_unflatten(self._treedef, outs), []
        return self._done


def _permutation(op: str, axis_name, perm) -> tuple[Region, Axes, Call, tuple]:
    """(region, axes in mesh order, call, pairs) of a ppermute, `perm` checked: indices in range, each
    source and each destination at most once."""
    region, axes, call = _start(op, axis_name)
    axes = region.axes(tuple(a for a in region.mesh.axis_names if a in axes.names), op)
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    bad = [p for p in pairs if not all(0 <= i < axes.size for i in p)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"lax.{op} over {axes.names} at {call.source}: perm {list(pairs)} must pair indices in "
            f"[0, {axes.size}) with each source and each destination at most once"
        )
    return region, axes, call, pairs


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None,
    price: Bound | Expected | None = None,
):  # fmt: skip
    """jax.lax.ragged_all_to_all: slice `k` of `operand` (rows `input_offsets[k]` on, `send_sizes[k]` of
    them) goes to rank `k // (K / axis size)`, which writes it into its copy of `output` at the offset
    the sender gives (`output_offsets[k]`); `recv_sizes` are the rows each slice received has. The
    result has `output`'s shape. `price`: the rows this rank sends, for a dry run (`Bound`, default
    the operand's rows, or `Expected`); a real run counts the rows it sent.

    The result varies over `axis_name` and everything its arguments vary over (jax 0.10 types it as
    `output` alone, which lets an out spec claim a received value is replicated)."""
    region, axes, call = _start("ragged_all_to_all", axis_name, axis_index_groups)
    call = Call(call.op, call.source, price)
    sizes = (input_offsets, send_sizes, output_offsets, recv_sizes)
    _check_ragged(operand, output, sizes, axes, call)
    operand, output = _operand(region, operand, axes, call, call.op), _operand_untyped(region, output, call)
    sizes = tuple(_operand_untyped(region, t, call) for t in sizes)
    varies = frozenset(axes.names).union(*(vma(t) for t in (operand, output) + sizes))
    if region.check_vma:
        operand, output = (pvary(t, region, tuple(varies), call) for t in (operand, output))
    return _apply(region, C.Ragged, operand, output, *sizes, region, axes, call, varies=varies)


def _check_ragged(operand, output, sizes, axes: Axes, call: Call) -> None:
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    for name, t in zip(names, sizes):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex:
            raise ValueError(f"lax.ragged_all_to_all at {call.source}: {name} must be a 1-D integer tensor")
    k = sizes[0].shape[0]
    if any(t.shape[0] != k for t in sizes) or k == 0 or k % axes.size:
        raise ValueError(
            f"lax.ragged_all_to_all at {call.source}: offsets and sizes must have one equal length, a positive "
            f"multiple of the size of {axes.names} ({axes.size}); got {[t.shape[0] for t in sizes]}"
        )
    if not isinstance(output, torch.Tensor) or operand.dim() < 1 or operand.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"lax.ragged_all_to_all at {call.source}: operand and output must be tensors whose rows have one shape"
        )


def all_to_all_v(x, axis_name, send_rows, recv_rows, *, price: Bound | Expected | None = None):
    """meshlib's extension (JAX has no such op; it is MPI's Alltoallv, c10d's `all_to_all_single` with
    split sizes): the rows of `x` cut in consecutive blocks, `send_rows[j]` rows going to index `j`
    along `axis_name`; the result is the blocks received, `recv_rows[j]` rows from index `j`,
    concatenated in index order. The counts are Python ints that the caller has read to the host
    once (each rank's `recv_rows[j]` is index j's `send_rows` entry for it), so the exchange waits for
    no value and its buffers have their exact sizes; `ragged_all_to_all` takes device offsets into an
    output of fixed size instead. Backward: the same exchange with the counts swapped.

    Counted as the rows this rank sends to other ranks (its own block stays). `price`: those rows for
    a dry run, whose counts are guesses (`Expected`, `Bound`; default `Bound(sum(send_rows))`). The
    result varies over `axis_name` and what `x` varies over."""
    region, axes, call = _start("all_to_all_v", axis_name)
    call = Call(call.op, call.source, price)
    send, recv = _row_counts(send_rows, axes, call, "send_rows"), _row_counts(recv_rows, axes, call, "recv_rows")
    x = _operand(region, x, axes, call, call.op)
    if x.dim() < 1 or x.shape[0] != sum(send):
        raise ValueError(
            f"lax.all_to_all_v at {call.source}: x has {x.shape[0] if x.dim() else 'no'} rows but send_rows "
            f"{list(send)} sum to {sum(send)}. Fix: send every row of x, in blocks by destination"
        )
    return _apply(region, C.AllToAllV, x, region, axes, call, send, recv, varies=vma(x))


def _row_counts(rows, axes: Axes, call: Call, name: str) -> tuple[int, ...]:
    if isinstance(rows, torch.Tensor):
        raise TypeError(
            f"lax.all_to_all_v at {call.source}: {name} is a tensor; it takes Python ints (host values). Fix: "
            "read the counts once with .tolist() (one host sync), or use lax.ragged_all_to_all"
        )
    rows = tuple(rows)
    if len(rows) != axes.size or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rows):
        raise ValueError(
            f"lax.all_to_all_v at {call.source}: {name} must be {axes.size} non-negative ints (one per index along "
            f"{axes.names}); got {list(rows)}"
        )
    return rows


# -- where this shard is -------------------------------------------------------------------------
def axis_index(axis_name) -> torch.Tensor:
    """This rank's index along `axis_name` (row-major over a tuple), an int32 scalar varying over it."""
    region, axes, _ = _start("axis_index", axis_name)
    out = region.backend.axis_index(axes)
    return set_vma(out, frozenset(axes.names)) if region.check_vma else out


def axis_size(axis_name) -> int:
    """The number of ranks along `axis_name` (a Python int, as in JAX)."""
    return _start("axis_size", axis_name)[1].size


def pcast(x, axis_name, *, to: str):
    """`to="varying"`: cast invariant values to vary over `axis_name` (JAX's pvary): the identity
    forward, a psum backward. The other `to`s of jax (reduced, unreduced) are not supported."""
    if to != "varying":
        raise ValueError(f"lax.pcast(to={to!r}): only to='varying' is supported")
    region, axes, call = _start("pcast", axis_name)

    def leaf(t):
        t = _operand_untyped(region, t, call)
        already = [a for a in axes.names if a in vma(t)]
        if already and region.check_vma:
            raise ValueError(
                f"lax.pcast(..., {axis_name!r}, to='varying') at {call.source}: the value already varies over "
                f"{already}. Fix: cast only over axes it does not vary over yet"
            )
        return pvary(t, region, axes.names, call) if region.check_vma else t

    return optree.tree_map(leaf, x)


def _operand_untyped(region: Region, x, call: Call) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"lax.{call.op} takes tensors (or pytrees of them); got {type(x).__name__} at {call.source}")
    return region.mode.local(x) if region.mode is not None else x
