"""Running a per-shard function abstractly: the vma check before any collective, and the compiler's
list of a region's collectives.

`region_collectives(f, mesh=..., in_specs=..., out_specs=..., args=...)` runs `f` once on meta
tensors of the local shapes (`args`: the shards one rank holds, as meta tensors or `ShapeDtype`s),
with `MetaBackend` recording each collective (and, with `backward=True`, those its backward runs),
checks the results against `out_specs`, and returns a `RegionPlan`: the records and the local
output shapes. shard_map calls `check` with the same machinery before it runs `f` for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from meshlib import Mesh
from meshlib.tree import ShapeDtype

from .backend import MetaBackend
from .boundary import output_cast
from .records import Call, Record
from .region import Region
from .specs import Leaf, check_spec_tree, match
from .vma import VmaMode, set_vma, vma

__all__ = ["RegionPlan", "abstract_run", "check_outputs", "region_collectives"]


@dataclass(frozen=True, slots=True)
class RegionPlan:
    """What one run of a region does per rank: its collectives in order, and its results' local
    shapes and varying axes (trees shaped like `f`'s results)."""

    records: tuple[Record, ...]
    outputs: Any
    varying: Any


def _meta(leaf: Leaf, check_vma: bool, grad: bool):
    v = leaf.value
    if isinstance(v, ShapeDtype):
        v = torch.empty(v.shape, dtype=getattr(torch, v.dtype), device="meta")
    if not isinstance(v, torch.Tensor) or leaf.spec is None:
        return v
    out = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
    out.requires_grad_(grad and (out.is_floating_point() or out.is_complex()))
    return set_vma(out, frozenset(leaf.spec.axes) if check_vma else frozenset())


def abstract_run(f, mesh: Mesh, leaves: list[Leaf], treedef, out_specs, *, check_vma: bool, backward: bool = False):
    """Run `f` on meta twins of `leaves` (local shapes): `(result leaves, result treedef, records)`."""
    name = getattr(f, "__name__", repr(f))
    backend = MetaBackend()
    region = Region(mesh, backend, check_vma=check_vma)
    region.mode = VmaMode(region)
    args = optree.tree_unflatten(treedef, [_meta(leaf, check_vma, backward) for leaf in leaves])
    try:
        with region.entered():
            result = f(*args)
    except (NotImplementedError, RuntimeError) as err:
        if "meta" not in str(err):
            raise
        raise ValueError(
            f"shard_map({name}) runs f on meta tensors first (to check it before any collective) and f "
            f"failed there: {err}. f must not read tensor values into Python (.item(), .tolist(), `if` on a "
            "tensor): they differ per rank. Fix: keep values as tensors (torch.where), or pass check_vma=False"
        ) from err
    outs, out_tree = match(out_specs, result, "out", "out_specs", name)
    check_outputs(outs, mesh, check_vma, name)
    if backward:
        _backward(outs, region)
    return outs, out_tree, tuple(backend.records)


def _backward(outs: list[Leaf], region: Region) -> None:
    call = Call("shard_map", "(out_specs)")
    cast = [output_cast(o.value, o.spec, region, call) for o in outs]
    seeds = [(t, torch.empty_like(t)) for t in cast if t.requires_grad]
    if seeds:
        torch.autograd.backward([t for t, _ in seeds], [g for _, g in seeds])


def check_outputs(outs: list[Leaf], mesh: Mesh, check_vma: bool, name: str) -> None:
    """Every result is a tensor its spec fits, and (typed) varies only over axes its spec names."""
    wrong = []
    for o in outs:
        if not isinstance(o.value, torch.Tensor):
            raise TypeError(
                f"shard_map({name}): {o.path} is a {type(o.value).__name__}, not a tensor. Fix: return tensors"
            )
        if len(o.spec) > o.value.dim():
            raise ValueError(
                f"shard_map({name}): {o.path} has {o.value.dim()} dims but its out spec {o.spec!r} has "
                f"{len(o.spec)} entries. Fix: give at most {o.value.dim()} entries"
            )
        extra = [a for a in mesh.axis_names if a in vma(o.value) and a not in o.spec.axes]
        if check_vma and extra:
            wrong.append(_vma_error(o, extra))
    if wrong:
        raise ValueError(
            f"shard_map({name}): out_specs promise replication that check_vma cannot prove:\n"
            + "\n".join(wrong)
            + "\nAn axis an out spec leaves out promises the result is equal on every rank along it. Fix: reduce "
            "over that axis inside f (lax.psum / lax.pmean / lax.all_gather_invariant), or name it in the out "
            "spec to concatenate the shards, or pass check_vma=False if it is equal for reasons f cannot show"
        )


def _vma_error(o: Leaf, extra: list[str]) -> str:
    axes = ", ".join(repr(a) for a in extra)
    name = repr(extra[0]) if len(extra) == 1 else repr(tuple(extra))
    return (
        f"  {o.path}: out spec {o.spec!r} leaves out {axes}, but {o.path} varies over {axes} "
        f"(varying axes {sorted(vma(o.value))}). Fix for {o.path}: lax.psum(..., {name}) if its shards "
        f"are partial sums, or an out spec naming {axes}"
    )


def region_collectives(
    f, /, *, mesh: Mesh, in_specs, out_specs, args: tuple, check_vma: bool = True, backward: bool = True
) -> RegionPlan:
    """The collectives one rank runs in `f` (and in its backward), on meta tensors of the local shapes
    `args` (a tuple, as `f` takes them). Raises what shard_map would before running anything."""
    name = getattr(f, "__name__", repr(f))
    check_spec_tree(in_specs, mesh, "in_specs")
    check_spec_tree(out_specs, mesh, "out_specs")
    leaves, treedef = match(in_specs, tuple(args), "args", "in_specs", name)
    outs, out_tree, records = abstract_run(f, mesh, leaves, treedef, out_specs, check_vma=check_vma, backward=backward)
    shapes = [ShapeDtype(tuple(o.value.shape), o.value.dtype) for o in outs]
    return RegionPlan(
        records, optree.tree_unflatten(out_tree, shapes), optree.tree_unflatten(out_tree, [vma(o.value) for o in outs])
    )
