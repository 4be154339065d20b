"""shard_map's two edges, as autograd functions: whole values in, this rank's shards to `f`; `f`'s
shards out, DTensors on the mesh.

In: a global tensor (the same on every rank) is cut to this rank's block (no communication); in
backward the block's gradient is gathered whole along every split dim, so each rank's `.grad` is the
whole gradient, as `jax.grad` gives it. A DTensor is redistributed to the spec's placements and
its local tensor taken (`to_local(grad_placements=...)`).

Out: under `check_vma`, a result is cast to vary over the axes its spec names that it does not vary
over yet (JAX's implicit pvary at the output: concatenated copies; backward, their gradients
summed). Untyped, JAX scales an output's cotangent by 1/size of the axes its spec leaves out and sums
an input's over them (`_shard_map_transpose`); both are here.
"""

from __future__ import annotations

import math

import torch
from torch.autograd import Function
from torch.distributed.tensor import DTensor, Partial

from meshlib import Mesh, NamedSharding, P

from .records import Call
from .region import Axes, Region
from .specs import Leaf, global_shape, placements
from .vma import pvary

__all__ = ["check_dtensor", "from_dtensor", "localize", "output_cast", "to_dtensor"]


def _axes(mesh: Mesh, names) -> Axes:
    names = tuple(names)
    return Axes(names, math.prod(mesh.axis_size(a) for a in names))


def _unmentioned(spec: P, mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a not in spec.axes)


class _Localize(Function):
    @staticmethod
    def forward(ctx, x, region: Region, spec: P, index: tuple, call: Call):
        ctx.region, ctx.spec, ctx.call = region, spec, call
        return x[index].clone()

    @staticmethod
    def backward(ctx, grad):
        region, spec, backend = ctx.region, ctx.spec, ctx.region.backend
        rest = _unmentioned(spec, region.mesh)
        if not region.check_vma and rest:
            grad = backend.all_reduce(grad, _axes(region.mesh, rest), "sum", ctx.call)
        for dim in range(len(spec)):
            if spec.dim_axes(dim):
                grad = backend.all_gather(grad, _axes(region.mesh, spec.dim_axes(dim)), dim, ctx.call)
        return grad, None, None, None, None


def localize(leaf: Leaf, region: Region, rank: int, call: Call) -> torch.Tensor:
    """This rank's block of a global tensor."""
    index = NamedSharding(region.mesh, leaf.spec).rank_indices(tuple(leaf.value.shape), path=leaf.path)[rank]
    return _Localize.apply(leaf.value, region, leaf.spec, index, call)


def check_dtensor(leaf: Leaf, mesh: Mesh, fn_name: str) -> None:
    """A DTensor argument lives on a device mesh with `mesh`'s axes and sizes (checked before anything moves)."""
    dm = leaf.value.device_mesh
    if tuple(dm.mesh_dim_names or ()) != mesh.axis_names or tuple(dm.shape) != mesh.axis_sizes:
        raise ValueError(
            f"shard_map({fn_name}): {leaf.path} is a DTensor on a mesh with axes {dm.mesh_dim_names} of sizes "
            f"{tuple(dm.shape)}, not shard_map's {mesh!r}. Fix: make it on runtime.dist.device_mesh(mesh)"
        )


def from_dtensor(leaf: Leaf, region: Region, dm) -> torch.Tensor:
    """This rank's block of a DTensor laid out by the spec (redistributed first if it is not)."""
    x, mesh = leaf.value, region.mesh
    target = placements(leaf.spec, mesh)
    if tuple(x.placements) != tuple(target):
        x = x.redistribute(dm, target)
    grads = list(target)
    if not region.check_vma:  # an untyped gradient is partial over the axes the spec leaves out
        grads = [Partial() if a in _unmentioned(leaf.spec, mesh) else p for a, p in zip(mesh.axis_names, grads)]
    return x.to_local(grad_placements=grads)


class _Scale(Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def output_cast(t: torch.Tensor, spec: P, region: Region, call: Call) -> torch.Tensor:
    """A result as its out spec takes it: cast to vary over every axis the spec names (typed), or
    with its cotangent scaled by 1/size of the axes the spec leaves out (untyped)."""
    if region.check_vma:
        return pvary(t, region, tuple(a for a in region.mesh.axis_names if a in spec.axes), call)
    rest = tuple(a for a in _unmentioned(spec, region.mesh) if a not in region.deferred)
    if not rest or not (t.requires_grad and torch.is_grad_enabled()):
        return t
    return _Scale.apply(t, 1.0 / _axes(region.mesh, rest).size)


def to_dtensor(t: torch.Tensor, spec: P, mesh: Mesh, dm) -> DTensor:
    """The DTensor whose shards the ranks hold (each a block `spec` places, JAX's layout)."""
    shape = global_shape(tuple(t.shape), spec, mesh)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(t, dm, placements(spec, mesh), run_check=False, shape=shape, stride=tuple(stride))
