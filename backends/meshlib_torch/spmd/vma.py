"""Varying manual axes (JAX's vma): each value inside `f` carries the mesh axes it may differ over.

The rules are JAX's (`jax/_src/shard_map.py`, `jax/_src/lax/parallel.py`; the shard_map tutorial's
"Tracking how values vary over manual mesh axes"):

- an input varies over the axes its in spec names; a tensor made inside `f`, or closed over, over none;
- an ordinary op's result varies over the union of its inputs' axes, and an input that varies over
  fewer is first cast to the union (an implicit `pvary`: identity forward, a psum over the added axes
  backward, so the gradient of an invariant value is the same on every rank);
- each collective has its own rule (in `lax.py`); an output's spec must name every axis it varies over.

The set is an attribute of the tensor object (`_meshlib_vma`), so in-place ops and views keep theirs.
`VmaMode` applies the rules to every torch function called while a region is entered. Inside a custom
`torch.autograd.Function` the ops are typed too (its results vary as they should), but its forward
runs without grad, so no input is cast there: a custom Function that mixes an invariant input that
needs a gradient with varying ones must be given inputs cast alike (`lax.pcast(w, axes, to="varying")`).
"""

from __future__ import annotations

import math

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..torch_private import version
from .records import Call
from .region import Axes, Region, user_line

__all__ = ["VmaMode", "pvary", "set_vma", "vma"]

_ATTR = "_meshlib_vma"
EMPTY: frozenset = frozenset()


def vma(x) -> frozenset:
    """The axes `x` varies over (none for anything untyped: a closed-over tensor, a Python number)."""
    return getattr(x, _ATTR, EMPTY) if isinstance(x, torch.Tensor) else EMPTY


def set_vma(x: torch.Tensor, axes: frozenset) -> torch.Tensor:
    setattr(x, _ATTR, frozenset(axes))
    return x


class _Pvary(torch.autograd.Function):
    """Invariant -> varying over `axes`: the value as it is; backward, the gradient summed over `axes`."""

    @staticmethod
    def forward(ctx, x, region: Region, axes: Axes, call):
        ctx.region, ctx.axes, ctx.call = region, axes, call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        region = ctx.region
        if not region.check_vma:  # untyped (check_vma=False): JAX's pvary is then the identity
            return grad, None, None, None
        names = tuple(a for a in ctx.axes.names if a not in region.deferred)  # the caller sums the rest
        if not names:
            return grad, None, None, None
        axes = Axes(names, math.prod(region.mesh.axis_size(a) for a in names))
        return region.backend.all_reduce(grad, axes, "sum", ctx.call), None, None, None


def pvary(x: torch.Tensor, region: Region, axes: tuple[str, ...], call) -> torch.Tensor:
    """`x` cast to vary over `axes` too (those it already varies over are skipped).

    A value cast the same way twice in one region is cast once (`VmaMode.casts`): its uses' gradients
    add up before the one psum, which is the sum of the psums JAX's per-use casts would run."""
    extra = _mesh_order(region, [a for a in axes if a not in vma(x)])
    if not extra:
        return x
    key = (id(x), version(x), extra)
    casts = region.mode.casts if region.mode is not None else {}
    if key in casts:
        return casts[key][1]
    out = x
    if x.requires_grad and torch.is_grad_enabled():
        with region.untyped():
            out = _Pvary.apply(x, region, region.axes(extra, "pvary"), call)
    out = set_vma(out if out is not x else x.view_as(x), vma(x) | set(extra))
    casts[key] = (x, out)  # holding x keeps its id unique while the region runs
    return out


def _mesh_order(region: Region, axes) -> tuple[str, ...]:
    return tuple(a for a in region.mesh.axis_names if a in axes)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class VmaMode(TorchFunctionMode):
    """While a region is entered: every torch function's result gets the union of its inputs' axes, and
    an input that requires grad and varies over fewer is cast first (implicit pvary). In an abstract
    region, real tensors that `f` closes over are swapped for meta ones of the same shape (once each)."""

    def __init__(self, region: Region):
        super().__init__()
        self.region, self.paused = region, False
        self._meta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (id, version, axes) -> (x, cast x)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        tensors = [t for t in optree.tree_leaves((args, kwargs)) if _is_tensor(t)]
        if self.region.abstract and any(t.device.type != "meta" for t in tensors):
            args, kwargs = optree.tree_map(self.local, (args, kwargs))
            tensors = [self.local(t) for t in tensors]
        union = EMPTY.union(*(vma(t) for t in tensors))
        if union and self.region.check_vma and any(vma(t) != union and t.requires_grad for t in tensors):
            call = Call("pvary", user_line())
            cast = lambda t: pvary(t, self.region, tuple(union), call) if _is_tensor(t) else t
            args, kwargs = optree.tree_map(cast, (args, kwargs))
        out = func(*args, **kwargs)
        if union:
            written = [args[0]] if func is torch.Tensor.__setitem__ else []  # in place, returns None
            for t in optree.tree_leaves(out) + written:
                if _is_tensor(t):
                    set_vma(t, vma(t) | union)
        return out

    def forget(self) -> None:
        """Drop the casts and meta twins of a region that has ended."""
        self.casts.clear()
        self._meta.clear()

    def local(self, t):
        """`t` as this region computes on it: in an abstract region, a real tensor's meta twin (made once);
        anything else as it is."""
        if not self.region.abstract or not _is_tensor(t) or t.device.type == "meta":
            return t
        if id(t) not in self._meta:
            twin = torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
            self._meta[id(t)] = (t, set_vma(twin, vma(t)))
        return self._meta[id(t)][1]
