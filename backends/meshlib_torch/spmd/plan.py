"""Running a per-shard function abstractly: the vma check before any collective, and the compiler's
list of a region's collectives.

`region_collectives(f, mesh=..., in_specs=..., out_specs=..., args=...)` runs `f` once on meta
tensors of the local shapes (`args`: the shards one rank holds, as meta tensors or `ShapeDtype`s),
with `MetaBackend` recording each collective (and, with `backward=True`, those its backward runs),
checks the results against `out_specs`, and returns a `RegionPlan`: the records and the local
output shapes. shard_map calls `abstract_run` before it runs `f` for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from meshlib import Mesh
from meshlib.tree import ShapeDtype

from .backend import MetaBackend
from .records import Record
from .region import Region
from .run import run_region
from .specs import Leaf, check_spec_tree, match
from .vma import VmaMode, vma

__all__ = ["RegionPlan", "abstract_run", "region_collectives"]


@dataclass(frozen=True, slots=True)
class RegionPlan:
    """What one run of a region does per rank: its collectives in order, and its results' local
    shapes and varying axes as the out specs cast them (trees shaped like `f`'s results)."""

    records: tuple[Record, ...]
    outputs: Any
    varying: Any


def _meta(leaf: Leaf, grad: bool):
    """A meta tensor of the leaf's (local) shape, needing a gradient if `grad` and it can have one."""
    v = leaf.value
    if isinstance(v, ShapeDtype):
        v = torch.empty(v.shape, dtype=getattr(torch, v.dtype), device="meta")
    if not isinstance(v, torch.Tensor) or leaf.spec is None:
        return v
    out = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
    return out.requires_grad_(grad and (out.is_floating_point() or out.is_complex()))


def abstract_run(
    f, mesh: Mesh, leaves: list[Leaf], treedef, out_specs, *, check_vma: bool, backward: bool = False,
    deferred: frozenset = frozenset(),
):  # fmt: skip
    """Run `f` on meta twins of `leaves` (local shapes): `(result leaves, result treedef, records)`, the
    results cast to their out specs (`deferred`: see `Region`)."""
    backend = MetaBackend()
    region = Region(mesh, backend, check_vma=check_vma, deferred=deferred)
    region.mode = VmaMode(region)
    args = optree.tree_unflatten(treedef, [_meta(leaf, backward) for leaf in leaves])
    in_specs = optree.tree_unflatten(treedef, [leaf.spec for leaf in leaves])
    try:
        outs, out_tree = run_region(f, region, args, in_specs=in_specs, out_specs=out_specs)
    except (NotImplementedError, RuntimeError) as err:
        if "meta" not in str(err).lower():
            raise
        raise ValueError(
            f"shard_map({getattr(f, '__name__', repr(f))}) runs f on meta tensors first (to check it before any "
            f"collective) and f failed there: {str(err).split('. ')[0]}. f must not read tensor values into "
            "Python (.item(), .tolist(), `if` on a tensor: they differ per rank), nor use ops whose result's shape "
            "depends on values (torch.bincount, nonzero, unique). Fix: keep values as tensors (torch.where), give "
            "shapes from sizes you know (a one-hot sum for bincount), or pass check_vma=False"
        ) from err
    seeds = [(o.value, torch.empty_like(o.value)) for o in outs if backward and o.value.requires_grad]
    if seeds:
        torch.autograd.backward([t for t, _ in seeds], [g for _, g in seeds])
    return outs, out_tree, tuple(backend.records)


def region_collectives(
    f, /, *, mesh: Mesh, in_specs, out_specs, args: tuple, check_vma: bool = True, backward: bool = True,
    deferred: frozenset = frozenset(),
) -> RegionPlan:  # fmt: skip
    """The collectives one rank runs in `f` (and in its backward), on meta tensors of the local shapes
    `args` (a tuple, as `f` takes them). Raises what shard_map would before running anything.
    `deferred`: axes whose implicit casts' gradient sums the caller runs (`Region`), left out."""
    name = getattr(f, "__name__", repr(f))
    check_spec_tree(in_specs, mesh, "in_specs")
    check_spec_tree(out_specs, mesh, "out_specs")
    leaves, treedef = match(in_specs, tuple(args), "args", "in_specs", name)
    outs, out_tree, records = abstract_run(
        f, mesh, leaves, treedef, out_specs, check_vma=check_vma, backward=backward, deferred=deferred
    )
    shapes = [ShapeDtype(tuple(o.value.shape), o.value.dtype) for o in outs]
    return RegionPlan(
        records, optree.tree_unflatten(out_tree, shapes), optree.tree_unflatten(out_tree, [vma(o.value) for o in outs])
    )
