"""Running a per-shard function on this rank's shards, in a region: the one entry both shard_map and a
compiled model's region use.

`run_region(f, region, args, in_specs=..., out_specs=...)` types each shard by its spec (a view that
varies over the axes the spec names, so the caller's tensors are not touched), runs `f` with the
region entered (its lax collectives go through `region.backend`), checks the results against
`out_specs` and casts them to them (JAX's implicit pvary at the output). Gradients at the inputs are
the per-shard cotangents JAX's inner function gives: under `check_vma` each is already summed over
the axes its spec leaves out; untyped, they are partial there and the caller sums them (shard_map's
boundary does, as JAX's transpose does).
"""

from __future__ import annotations

import optree
import torch

from meshlib import Mesh

from .boundary import output_cast
from .records import Call
from .region import Region, user_line
from .specs import Leaf, match
from .vma import set_vma, vma

__all__ = ["check_outputs", "run_region"]


def _typed(leaf: Leaf, check_vma: bool):
    if leaf.spec is None or not isinstance(leaf.value, torch.Tensor):
        return leaf.value
    return set_vma(leaf.value.view_as(leaf.value), frozenset(leaf.spec.axes) if check_vma else frozenset())


def run_region(f, region: Region, args: tuple, *, in_specs, out_specs) -> tuple[list[Leaf], object]:
    """`f(*args)` on this rank's shards inside `region`: `(result leaves, their treedef)`, each result
    cast to its out spec."""
    name = getattr(f, "__name__", repr(f))
    leaves, treedef = match(in_specs, tuple(args), "args", "in_specs", name)
    shards = optree.tree_unflatten(treedef, [_typed(leaf, region.check_vma) for leaf in leaves])
    with region.entered():
        result = f(*shards)
    outs, out_tree = match(out_specs, result, "out", "out_specs", name)
    check_outputs(outs, region.mesh, region.check_vma, name)
    call = Call("pvary", user_line())  # the out specs' implicit pvary, at the caller's line
    return [Leaf(o.path, output_cast(o.value, o.spec, region, call), o.spec) for o in outs], out_tree


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
