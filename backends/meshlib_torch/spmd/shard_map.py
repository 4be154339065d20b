"""`shard_map(f, /, *, mesh, in_specs, out_specs, check_vma=True)`: JAX's shard_map, eager, on torch.

`f` runs on each rank's shards of its arguments and returns its shards of the results. An axis an out
spec names concatenates the shards along that dim; an axis it leaves out promises the result is the
same on every rank of that axis, and with `check_vma` that promise is proved before anything runs:
`f` is first run on meta tensors carrying the axes each value varies over (`spmd.vma`), and a result
that may vary over an axis its spec leaves out is an error naming the result, the axis and the fix,
raised on every rank before any collective. Then `f` runs for real with the collectives of
`meshlib_torch.lax` on the mesh's process groups (`spmd.eager`), and its results become DTensors.

Arguments are global tensors (the same on every rank) or DTensors; gradients flow back as
`jax.grad`'s through `jax.shard_map`: a global input's `.grad` is the whole gradient on every rank.
With `check_vma=False` nothing is checked before `f` runs (values are untyped, as in JAX): an error
in `f` then comes while it runs, on every rank at the same point.

Example (under torchrun with 4 processes; `x` and `w` the same on every rank):

    mesh = Mesh(dp=2, tp=2)
    def f(x, w):                          # x: (B/dp, H), w: (H, F/tp)
        return x @ w                      # (B/dp, F/tp): varies over dp and tp
    y = shard_map(f, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp", "tp"))(x, w)
    y.full_tensor()                       # x @ w, on every rank
"""

from __future__ import annotations

import functools

import optree
import torch.distributed as c10d
from torch.distributed.tensor import DTensor

from meshlib import Mesh

from ..runtime import dist
from .boundary import check_dtensor, from_dtensor, localize, to_dtensor
from .eager import EagerBackend
from .mapped import ShardMapped, local_args
from .plan import abstract_run
from .records import Call
from .region import Region, user_line
from .run import run_region
from .specs import Leaf, check_spec_tree
from .vma import VmaMode

__all__ = ["shard_map"]


def shard_map(f, /, *, mesh: Mesh, in_specs, out_specs, check_vma: bool = True):
    """`f` mapped over the shards of its arguments on `mesh`; see the module docstring."""
    if not callable(f):
        raise TypeError(f"shard_map takes the function to map first; got {type(f).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_map(mesh=...) takes a meshlib Mesh; got {type(mesh).__name__}")
    if not isinstance(check_vma, bool):
        raise TypeError(f"shard_map(check_vma=...) takes a bool; got {check_vma!r}")
    check_spec_tree(in_specs, mesh, "in_specs")
    check_spec_tree(out_specs, mesh, "out_specs")

    eager = functools.partial(_call, f, mesh, in_specs, out_specs, check_vma)
    return ShardMapped(f, mesh, in_specs, out_specs, check_vma, eager)


def _call(f, mesh: Mesh, in_specs, out_specs, check_vma: bool, args: tuple):
    mapped = ShardMapped(f, mesh, in_specs, out_specs, check_vma, None)
    leaves, local, treedef = local_args(mapped, args)
    for leaf in leaves:
        if leaf.spec is not None and isinstance(leaf.value, DTensor):
            check_dtensor(leaf, mesh, getattr(f, "__name__", repr(f)))
    if check_vma:  # every rank raises the same error here, before any collective
        abstract_run(f, mesh, local, treedef, out_specs, check_vma=True)
    dm = dist.device_mesh(mesh)
    region = Region(mesh, EagerBackend(mesh, dm), check_vma=check_vma)
    region.mode = VmaMode(region) if check_vma else None
    call = Call("shard_map", user_line())
    shards = optree.tree_unflatten(treedef, [_shard(leaf, region, dm, call) for leaf in leaves])
    outs, out_tree = run_region(f, region, shards, in_specs=in_specs, out_specs=out_specs)
    return optree.tree_unflatten(out_tree, [to_dtensor(o.value, o.spec, mesh, dm) for o in outs])


def _shard(leaf: Leaf, region: Region, dm, call: Call):
    if leaf.spec is None:
        return leaf.value
    if isinstance(leaf.value, DTensor):
        return from_dtensor(leaf, region, dm)
    return localize(leaf, region, c10d.get_rank(), call)
