"""`Mesh`: named axes with sizes, and the row-major rank <-> coordinate map.

A mesh is abstract: it holds no devices and no processes. Rank `r` sits at the
coordinates that `jax.make_mesh(sizes, names)` gives device `r` and that
torch's `init_device_mesh(..., mesh_dim_names=names)` gives rank `r`: row-major,
the last axis fastest.

Example:
    >>> mesh = Mesh(dp=2, tp=4)
    >>> mesh == Mesh((2, 4), ("dp", "tp"))
    True
    >>> mesh.coords(5)
    {'dp': 1, 'tp': 1}
    >>> mesh.group(5, "tp")
    (4, 5, 6, 7)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping

__all__ = ["Mesh", "CANONICAL_AXES"]

CANONICAL_AXES = ("dp", "pp", "cp", "ep", "tp")


def _as_axes(axes: str | Iterable[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


class Mesh:
    """Named mesh axes with sizes: `Mesh(dp=2, tp=4)` or `Mesh((2, 4), ("dp", "tp"))`."""

    __slots__ = ("axis_names", "axis_sizes", "_strides")

    def __init__(
        self,
        axis_sizes: Iterable[int] | Mapping[str, int] | None = None,
        axis_names: Iterable[str] | None = None,
        /,
        **axes: int,
    ) -> None:
        names, sizes = self._parse(axis_sizes, axis_names, axes)
        _set = object.__setattr__
        _set(self, "axis_names", names)
        _set(self, "axis_sizes", sizes)
        strides = [1] * len(sizes)
        for i in range(len(sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * sizes[i + 1]
        _set(self, "_strides", tuple(strides))

    @staticmethod
    def _parse(axis_sizes, axis_names, axes):
        if isinstance(axis_sizes, Mapping):
            if axis_names is not None or axes:
                raise TypeError("Mesh({...}) takes the axes mapping alone")
            axes, axis_sizes = dict(axis_sizes), None
        if axis_sizes is not None or axis_names is not None:
            if axes:
                raise TypeError(
                    "Mesh takes either (axis_sizes, axis_names) or keyword axes, not both: "
                    f"got {axis_sizes!r}, {axis_names!r} and {axes!r}"
                )
            if axis_sizes is None or axis_names is None:
                raise TypeError("Mesh((sizes), (names)) needs both the sizes and the names")
            sizes, names = tuple(axis_sizes), tuple(axis_names)
            if len(sizes) != len(names):
                raise ValueError(
                    f"Mesh got {len(sizes)} sizes {sizes} for {len(names)} axis names {names}; "
                    "give one size per axis name"
                )
        else:
            names, sizes = tuple(axes), tuple(axes.values())
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(
                    f"mesh axis name {name!r} is not a Python identifier; use names "
                    f"such as {', '.join(CANONICAL_AXES)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names {names} repeat a name; each axis needs its own")
        for name, size in zip(names, sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"mesh axis {name!r} has size {size!r}; a size is a positive int"
                )
        return names, sizes

    @classmethod
    def for_world(cls, world_size: int, /, **axes: int) -> Mesh:
        """A mesh over `world_size` ranks; at most one axis may be -1 (inferred).

        Example:
            >>> Mesh.for_world(8, dp=-1, tp=2)
            Mesh(dp=4, tp=2)
        """
        infer = [name for name, size in axes.items() if size == -1]
        if len(infer) > 1:
            raise ValueError(f"only one mesh axis can be -1 (inferred); got {infer}")
        known = math.prod(size for size in axes.values() if size != -1)
        if infer:
            if known < 1 or world_size % known:
                raise ValueError(
                    f"cannot infer axis {infer[0]!r}: world size {world_size} is not a "
                    f"multiple of the other axes' product {known} ({axes})"
                )
            axes = {**axes, infer[0]: world_size // known}
        mesh = cls(**axes)
        mesh.check_world_size(world_size)
        return mesh

    # -- value semantics ----------------------------------------------------
    def __setattr__(self, name, value):
        raise AttributeError(f"Mesh is frozen; build a new Mesh instead of setting {name!r}")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mesh):
            return (self.axis_names, self.axis_sizes) == (other.axis_names, other.axis_sizes)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.axis_names, self.axis_sizes))

    def __reduce__(self):
        return (Mesh, (self.axis_sizes, self.axis_names))

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={s}' for n, s in self.shape.items())})"

    # -- shape ----------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order (JAX's `mesh.shape`)."""
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def ndim(self) -> int:
        return len(self.axis_names)

    def __contains__(self, axis: object) -> bool:
        return axis in self.axis_names

    def axis_size(self, axes: str | Iterable[str]) -> int:
        """Size of one axis, or the product over several."""
        return math.prod(self.axis_sizes[self.axis_index(a)] for a in _as_axes(axes))

    def axis_index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise ValueError(
                f"unknown mesh axis {axis!r}; this mesh has axes {self.axis_names}. "
                f"Fix: use one of them, or add {axis!r} to the Mesh"
            ) from None

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the mesh covers exactly `world_size` ranks."""
        if self.size != world_size:
            raise ValueError(
                f"{self!r} has {self.size} ranks but the world size is {world_size}. "
                f"Fix: launch {self.size} processes (torchrun --nproc-per-node {self.size}) "
                f"or change the mesh so its axes multiply to {world_size}"
            )

    # -- ranks and coordinates -----------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside {self!r}, which has ranks 0..{self.size - 1}")

    def coords(self, rank: int) -> dict[str, int]:
        """Axis name -> coordinate of `rank`, row-major."""
        self._check_rank(rank)
        return {
            name: (rank // stride) % size
            for name, size, stride in zip(self.axis_names, self.axis_sizes, self._strides)
        }

    def rank(self, coords: Mapping[str, int] | None = None, /, **kw: int) -> int:
        """The rank at `coords` (missing axes count as 0)."""
        coords = {**(coords or {}), **kw}
        rank = 0
        for name, value in coords.items():
            i = self.axis_index(name)
            if not 0 <= value < self.axis_sizes[i]:
                raise ValueError(f"coordinate {name}={value} is outside axis size {self.axis_sizes[i]}")
            rank += value * self._strides[i]
        return rank

    def axis_coord(self, rank: int, axes: str | Iterable[str]) -> int:
        """Index of `rank` within its group over `axes` (flattened, first axis major)."""
        index = 0
        for axis in _as_axes(axes):
            i = self.axis_index(axis)
            index = index * self.axis_sizes[i] + (rank // self._strides[i]) % self.axis_sizes[i]
        return index

    def group(self, rank: int, axes: str | Iterable[str]) -> tuple[int, ...]:
        """Ranks that share every coordinate with `rank` except those on `axes`.

        They are ordered by their flattened coordinate over `axes` (first axis
        major), which is each rank's index in the group's collectives.
        """
        self._check_rank(rank)
        axes = _as_axes(axes)
        idx = [self.axis_index(a) for a in axes]
        if len(set(idx)) != len(idx):
            raise ValueError(f"axes {axes} repeat an axis")
        base = rank - sum(((rank // self._strides[i]) % self.axis_sizes[i]) * self._strides[i] for i in idx)
        ranges = [range(0, self.axis_sizes[i] * self._strides[i], self._strides[i]) for i in idx]
        return tuple(base + sum(offsets) for offsets in itertools.product(*ranges))

    def groups(self, axes: str | Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """Every group over `axes`; together they partition the ranks."""
        axes = _as_axes(axes)
        rest = [a for a in self.axis_names if a not in axes]
        leaders = self.group(0, rest) if rest else (0,)
        return tuple(self.group(r, axes) for r in leaders)

    # -- derived meshes --------------------------------------------------------
    def submesh(self, axes: str | Iterable[str]) -> Mesh:
        """The mesh of just `axes`, in the order given (e.g. one rank's tp group)."""
        axes = _as_axes(axes)
        return Mesh(tuple(self.axis_size(a) for a in axes), axes)

    def flatten(self, axes: Iterable[str], name: str | None = None) -> Mesh:
        """Merge adjacent `axes` into one axis; every rank keeps its place.

        Example:
            >>> Mesh(pp=2, dp=2, cp=2, tp=2).flatten(("dp", "cp"))
            Mesh(pp=2, dp_cp=4, tp=2)
        """
        axes = _as_axes(axes)
        idx = [self.axis_index(a) for a in axes]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(
                f"flatten needs adjacent axes in mesh order; {axes} are not, in {self!r}. "
                "Fix: pass them in mesh order, or spell the group as a tuple entry in P"
            )
        name = name or "_".join(axes)
        names = self.axis_names[: idx[0]] + (name,) + self.axis_names[idx[-1] + 1 :]
        sizes = self.axis_sizes[: idx[0]] + (self.axis_size(axes),) + self.axis_sizes[idx[-1] + 1 :]
        return Mesh(sizes, names)

    def to_json(self) -> dict:
        return {"axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes)}

    @classmethod
    def from_json(cls, data: Mapping) -> Mesh:
        return cls(tuple(data["axis_sizes"]), tuple(data["axis_names"]))

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`Mesh.parse("dp=2,tp=4")`, the command-line form."""
        axes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().lstrip("-").isdigit():
                raise ValueError(f"mesh {text!r}: {part!r} is not axis=size, as in 'dp=2,tp=4'")
            if name.strip() in axes:
                raise ValueError(
                    f"mesh {text!r}: axis {name.strip()!r} is given twice. Fix: name each axis once, e.g. "
                    f"'{name.strip()}={int(size) * axes[name.strip()]}' for one axis of both sizes"
                )
            axes[name.strip()] = int(size)
        return cls(**axes)
