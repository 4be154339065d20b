"""The region a per-shard function runs in: its mesh, the backend its collectives go through, its typing.

`Region` is what `lax.psum` and friends look up while `f` runs inside `shard_map` (a context
variable, so a collective called anywhere else raises, naming the fix). `axes(axis_name)` resolves
an axis name as jax.lax takes it (a name, or a tuple of names, major first) against the mesh once,
for every collective alike. `user_line()` is the file:line of the user's call, for the records.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
from dataclasses import dataclass

from meshlib import Mesh

__all__ = ["Axes", "Region", "current", "user_line"]

_CURRENT: contextvars.ContextVar[Region | None] = contextvars.ContextVar("meshlib_shard_map_region", default=None)
_HERE = os.path.dirname(os.path.abspath(__file__))  # spmd/: shard_map and the collectives
_LAX = os.path.join(os.path.dirname(_HERE), "lax.py")
_TORCH = os.sep + "torch" + os.sep


@dataclass(frozen=True, slots=True)
class Axes:
    """An axis name resolved on a mesh: the axes in the order given (major first) and their total size."""

    names: tuple[str, ...]
    size: int

    def __str__(self) -> str:
        return "_".join(self.names)


class Region:
    """One run of a per-shard function: `mesh`, the collective `backend`, and whether values carry their
    varying axes (`check_vma`, JAX's typing). `mode` is the `VmaMode` that types every torch op while the
    region is entered (None: untyped). `deferred`: axes over which the gradient of an implicit cast to
    varying (a pvary) is left partial, for the caller to sum: a compiled model's data-parallel axes,
    whose gradients the runtime sums once per step (summing them here too would count them twice)."""

    def __init__(self, mesh: Mesh, backend, *, check_vma: bool, deferred: frozenset = frozenset()):
        self.mesh, self.backend, self.check_vma = mesh, backend, check_vma
        self.deferred = frozenset(deferred)  # axes whose implicit casts' gradient sums the caller runs
        self.mode = None

    @property
    def abstract(self) -> bool:
        """True on meta tensors: shapes and records only, nothing moves."""
        return self.backend.abstract

    def axes(self, axis_name, op: str, source: str = "") -> Axes:
        """`axis_name` (a name or a tuple of names) checked against the mesh, for `lax.<op>` at `source`."""
        names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        unknown = [a for a in names if a not in self.mesh.axis_names]
        if not names or unknown or len(set(names)) != len(names):
            what = f"unknown axis {unknown[0]!r}" if unknown else "no axis, or an axis twice"
            raise ValueError(
                f"lax.{op}(..., axis_name={axis_name!r}){' at ' + source if source else ''}: {what}; the shard_map's "
                f"mesh has axes "
                f"{self.mesh.axis_names}. Fix: name one of them, or a tuple of distinct ones"
            )
        return Axes(names, math.prod(self.mesh.axis_size(a) for a in names))

    @contextlib.contextmanager
    def entered(self):
        """Make this the current region (and type every torch op, with `mode`) while `f` runs."""
        if _CURRENT.get() is not None:
            raise ValueError(
                "shard_map inside shard_map is not supported. Fix: call the inner function directly "
                "(it already runs per shard) and use lax collectives over the axes it needs"
            )
        token = _CURRENT.set(self)
        try:
            with self.mode if self.mode is not None else contextlib.nullcontext():
                yield self
        finally:
            _CURRENT.reset(token)
            if self.mode is not None:
                self.mode.forget()  # the autograd graph keeps the region: let it not keep every cast too

    @contextlib.contextmanager
    def untyped(self):
        """Torch ops inside run as they are: the collectives' own arithmetic is not user code to type."""
        if self.mode is None:
            yield
            return
        was, self.mode.paused = self.mode.paused, True
        try:
            yield
        finally:
            self.mode.paused = was


def current(op: str) -> Region:
    """The region `lax.<op>` was called in; raises outside `shard_map`."""
    region = _CURRENT.get()
    if region is None:
        raise ValueError(
            f"lax.{op} was called outside shard_map: a collective needs the mesh axes it runs over. "
            f"Fix: call it inside a function wrapped by meshlib_torch.shard_map(f, mesh=..., in_specs=..., "
            "out_specs=...)"
        )
    return region


def user_line() -> str:
    """`file.py:LINE` of the innermost caller outside shard_map, the lax collectives and torch (so a
    rank-dependent op written inside meshlib_torch, a model's, is its own source)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_HERE) and path != _LAX and _TORCH not in path and "contextlib" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
