"""`NamedSharding`: a spec placed on a mesh, and the per-rank layout it implies.

For every mesh, spec and global shape, `devices_indices_map` gives rank `r`
exactly the slices JAX's `NamedSharding(mesh, spec).devices_indices_map(shape)`
gives device `r`. A dim split over axes `(a, b)` is cut into `|a|*|b|` blocks
and rank `r` holds block `coord_a * |b| + coord_b`; mesh axes the spec does
not name replicate.

Uneven dims follow a policy: `"error"` (JAX's behaviour, the default) or
`"chunk"`, where block `i` of a dim of size `n` cut `k` ways is
`torch.arange(n).chunk(k)[i]`, empty past the end, as DTensor's `Shard` cuts.

Example:
    >>> s = NamedSharding(Mesh(dp=2, tp=2), P(("tp", "dp")))
    >>> s.devices_indices_map((8,))[1]
    (slice(4, 6, None),)
"""

from __future__ import annotations

import functools
import gc
import math
import operator
from collections.abc import Sequence

from .mesh import Mesh
from .spec import P

__all__ = ["NamedSharding", "UNEVEN_FIX", "UNEVEN_POLICIES", "check_spec"]

UNEVEN_POLICIES = ("error", "chunk")
_FULL = slice(None, None, None)


def _where(path: str | None) -> str:
    return f"{path}: " if path else ""


def check_spec(mesh: Mesh, spec: P, *, path: str | None = None) -> None:
    """Raise unless every axis `spec` names is on `mesh`."""
    if not isinstance(spec, P):
        raise TypeError(f"{_where(path)}spec is {spec!r} ({type(spec).__name__}); expected a P")
    for axis in spec.axes + tuple(spec.reduced):
        if axis not in mesh:
            raise ValueError(
                f"{_where(path)}spec {spec!r} names mesh axis {axis!r}, but {mesh!r} has axes "
                f"{mesh.axis_names}. Fix: use one of those axes, or add {axis!r} to the mesh"
            )


def _check_shape(mesh: Mesh, spec: P, shape: tuple[int, ...], uneven: str, path: str | None):
    if len(spec) > len(shape):
        raise ValueError(
            f"{_where(path)}spec {spec!r} has {len(spec)} entries but the tensor has rank "
            f"{len(shape)} (shape {shape}). Fix: give at most {len(shape)} entries; "
            "trailing dims left out are replicated"
        )
    if spec.has_unconstrained:
        raise ValueError(
            f"{_where(path)}spec {spec!r} has UNCONSTRAINED dims, which have no layout until "
            "the compiler picks one. Fix: give a concrete entry, or let `compile` resolve it"
        )
    if uneven != "error":
        return
    for dim, size in enumerate(shape):
        axes = spec.dim_axes(dim)
        ways = mesh.axis_size(axes) if axes else 1
        if size % ways:
            sizes = " x ".join(f"{a}={mesh.axis_size(a)}" for a in axes)
            raise ValueError(
                f"{_where(path)}dim {dim} of shape {shape} has size {size}, which spec {spec!r} "
                f"splits {ways} ways over mesh axes {sizes}; {size} is not a multiple of {ways}. "
                f"Fix: make dim {dim} a multiple of {ways} (pad it), shard it over fewer axes{UNEVEN_FIX}"
            )


# the last fix a shape error offers; a layer that only lays out even shards (the torch compiler) drops it
UNEVEN_FIX = ", or use uneven='chunk' for torch.chunk block sizes"


def _blocks(size: int, ways: int, uneven: str) -> tuple[slice, ...]:
    """The `ways` slices a dim of `size` is cut into."""
    if ways == 1:
        return (_FULL,)
    step = size // ways if uneven == "error" else -(-size // ways)
    return tuple(slice(min(i * step, size), min((i + 1) * step, size)) for i in range(ways))


@functools.lru_cache(maxsize=4096)
def block_index(mesh: Mesh, axes: tuple[str, ...]) -> tuple[int, ...]:
    """For each rank, which block of a dim split over `axes` it holds."""
    return tuple(mesh.axis_coord(r, axes) for r in range(mesh.size))


@functools.lru_cache(maxsize=1024)
def _dim_slices(mesh: Mesh, axes: tuple[str, ...], size: int, uneven: str) -> tuple[slice, ...]:
    """For each rank, its slice of one dim of `size` split over `axes`."""
    if not axes:
        return (_FULL,) * mesh.size
    blocks = _blocks(size, mesh.axis_size(axes), uneven)
    index = block_index(mesh, axes)
    return operator.itemgetter(*index)(blocks) if mesh.size > 1 else (blocks[index[0]],)


# Whole layouts are cached only a few at a time: on a big mesh each is thousands of
# tuples, and keeping many alive costs more in memory traffic than recomputing them
# (measured: 64 cached layouts made the distinct-shape benchmark 4x slower than 8).
@functools.lru_cache(maxsize=8)
def _indices(mesh: Mesh, spec: P, shape: tuple[int, ...], uneven: str) -> tuple[tuple[slice, ...], ...]:
    """Per-rank slices, indexed by rank (shape already checked)."""
    if not shape:
        return ((),) * mesh.size
    per_dim = [_dim_slices(mesh, spec.dim_axes(d), n, uneven) for d, n in enumerate(shape)]
    # Millions of small tuples of slices: the cyclic collector would rescan them over and
    # over while they are built (they hold no cycles), so build them with it paused.
    paused = gc.isenabled()
    gc.disable()
    try:
        return tuple(zip(*per_dim))
    finally:
        if paused:
            gc.enable()


class NamedSharding:
    """A `P` placed on a `Mesh`: JAX's `NamedSharding`, plus an uneven-dim policy."""

    __slots__ = ("mesh", "spec", "uneven")

    def __init__(self, mesh: Mesh, spec: P, *, uneven: str = "error") -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"NamedSharding needs a meshlib Mesh, got {type(mesh).__name__}")
        if isinstance(spec, (tuple, list)):
            spec = P(*spec)
        check_spec(mesh, spec)
        if uneven not in UNEVEN_POLICIES:
            raise ValueError(f"uneven={uneven!r}; choose one of {UNEVEN_POLICIES}")
        _set = object.__setattr__
        _set(self, "mesh", mesh)
        _set(self, "spec", spec)
        _set(self, "uneven", uneven)

    def __setattr__(self, name, value):
        raise AttributeError("NamedSharding is frozen")

    def _key(self):
        return (self.mesh, self.spec, self.uneven)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NamedSharding):
            return self._key() == other._key()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        return (_rebuild, self._key())

    def __repr__(self) -> str:
        extra = "" if self.uneven == "error" else f", uneven={self.uneven!r}"
        return f"NamedSharding({self.mesh!r}, {self.spec!r}{extra})"

    # -- JAX's surface ----------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def device_set(self) -> frozenset[int]:
        return frozenset(range(self.mesh.size))

    @property
    def is_fully_replicated(self) -> bool:
        """True when every rank holds the whole value (no split, no partial sum)."""
        named = self.spec.sharded_axes + tuple(self.spec.unreduced)
        return self.mesh.axis_size(named) == 1 if named else True

    def check(self, global_shape: Sequence[int], *, path: str | None = None) -> None:
        """Raise, naming `path`, unless this sharding can lay out `global_shape`."""
        _check_shape(self.mesh, self.spec, tuple(global_shape), self.uneven, path)

    def devices_indices_map(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """Rank -> the slices of the global array it holds (JAX's method, ranks for devices)."""
        return dict(enumerate(self.rank_indices(global_shape)))

    def rank_indices(self, global_shape: Sequence[int], *, path: str | None = None):
        """The same slices as a tuple indexed by rank (cached; cheaper than the dict)."""
        shape = tuple(global_shape)
        _check_shape(self.mesh, self.spec, shape, self.uneven, path)
        return _indices(self.mesh, self.spec, shape, self.uneven)

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one shard; under `uneven='chunk'` the largest (rank 0's)."""
        shape = tuple(global_shape)
        _check_shape(self.mesh, self.spec, shape, self.uneven, None)
        out = []
        for dim, size in enumerate(shape):
            ways = self.mesh.axis_size(self.spec.dim_axes(dim))
            out.append(size // ways if self.uneven == "error" else -(-size // ways))
        return tuple(out)

    def local_shape(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """The exact shape rank `rank` holds (differs across ranks only under `chunk`)."""
        slices = self.rank_indices(global_shape)[rank]
        return tuple(len(range(*s.indices(n))) for s, n in zip(slices, global_shape))

    def shard_bytes(self, global_shape: Sequence[int], itemsize: int) -> int:
        """Bytes of the largest shard."""
        return math.prod(self.shard_shape(global_shape)) * itemsize

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same block as `rank` (the axes the spec does not split)."""
        free = [a for a in self.mesh.axis_names if a not in self.spec.sharded_axes]
        return self.mesh.group(rank, free) if free else (rank,)

    def with_spec(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec, uneven=self.uneven)


def _rebuild(mesh, spec, uneven):
    return NamedSharding(mesh, spec, uneven=uneven)
