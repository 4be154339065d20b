"""shard_map's specs beside its arguments and results: matching, checking, shapes and placements.

Specs match a tree by prefix, as in JAX (`broadcast_prefix`): one `P` covers a whole subtree, and a
`None` in_spec passes its argument to `f` unchanged. Every error names the leaf by its path
(`args[1]['w']`, `out[0]`) and says what to change; all of them are raised before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.distributed.tensor import Replicate, Shard

from meshlib import Mesh, P
from meshlib.sharding import check_spec

from ..torch_private import StridedShard

__all__ = ["Leaf", "check_spec_tree", "global_shape", "local_shape", "match", "path_str", "placements"]


@dataclass(frozen=True, slots=True)
class Leaf:
    """One leaf of the arguments (or results) with the spec that covers it (None: not mapped)."""

    path: str
    value: Any
    spec: P | None


def path_str(root: str, path: tuple) -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def check_spec_tree(specs, mesh: Mesh, what: str) -> None:
    """Every `P` in `specs` names axes of `mesh` only, and nothing shard_map cannot honour."""
    paths, leaves, _ = optree.tree_flatten_with_path(specs, none_is_leaf=True)
    for path, spec in zip(paths, leaves):
        where = path_str(what, path)
        if spec is None and what == "in_specs":
            continue
        check_spec(mesh, spec, path=where)
        if spec.unreduced or spec.reduced or spec.has_unconstrained:
            raise ValueError(
                f"{where}: {spec!r} is not supported by shard_map (unreduced, reduced and UNCONSTRAINED "
                "entries). Fix: give plain entries; reduce inside f with lax.psum"
            )


def match(specs, tree, root: str, what: str, fn_name: str) -> tuple[list[Leaf], Any]:
    """The leaves of `tree` (named from `root`), each with the spec covering it; and the treedef."""
    try:
        flat_specs = optree.broadcast_prefix(specs, tree, none_is_leaf=True)
    except ValueError as err:
        why = str(err).split("; ")[:2]  # optree's reason, without its dump of the values
        shapes = optree.tree_map(_short, tree, none_is_leaf=True)
        raise ValueError(
            f"shard_map({fn_name}): {what} do not match {root}: {'; '.join(why)}. {what} is {specs!r}, {root} is "
            f"{shapes}; {what} must be a tree prefix of {root} (a P per leaf, or one P for a whole subtree). "
            f"Fix: give {what} the structure of {root}"
        ) from None
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [Leaf(path_str(root, p), v, s) for p, v, s in zip(paths, leaves, flat_specs)], treedef


def _short(x) -> str:
    return f"Tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def local_shape(leaf: Leaf, shape: tuple[int, ...], mesh: Mesh, fn_name: str, chunked=None) -> tuple[int, ...]:
    """The shard each rank holds of a global `shape` under `leaf.spec`; raises on a rank or size mismatch.
    `chunked` {axis: size}: a dim of that size split over that axis alone comes in torch.chunk's pieces
    (meshlib's extension, for compiled attention under uneven='chunk'); the shape is the largest, rank 0's."""
    spec = leaf.spec
    if len(spec) > len(shape):
        raise ValueError(
            f"shard_map({fn_name}): {leaf.path} has shape {shape} ({len(shape)} dims) but its spec {spec!r} has "
            f"{len(spec)} entries. Fix: give at most {len(shape)} entries (dims left out are not split)"
        )
    out = []
    for dim, size in enumerate(shape):
        axes = spec.dim_axes(dim)
        ways = mesh.axis_size(axes) if axes else 1
        if size % ways and len(axes) == 1 and (chunked or {}).get(axes[0]) == size:
            out.append(-(-size // ways))
            continue
        if size % ways:
            raise ValueError(
                f"shard_map({fn_name}): {leaf.path} dim {dim} has size {size}, which {spec!r} splits over "
                f"{axes} ({ways} ranks); {ways} does not divide {size}. Fix: pad dim {dim} to a multiple of "
                f"{ways} (and mask the padding in f), or split it over fewer axes"
            )
        out.append(size // ways)
    return tuple(out)


def global_shape(shape: tuple[int, ...], spec: P, mesh: Mesh, chunked=None) -> tuple[int, ...]:
    """The whole of a result each rank holds a `shape` block of: dims named in `spec` concatenated (a dim split
    over an axis of `chunked` alone, in torch.chunk's pieces: its size there)."""
    out = []
    for d, n in enumerate(shape):
        axes = spec.dim_axes(d)
        whole = (chunked or {}).get(axes[0]) if len(axes) == 1 else None
        out.append(whole if whole is not None and -(-whole // mesh.axis_size(axes)) == n else
                   n * (mesh.axis_size(axes) if axes else 1))  # fmt: skip
    return tuple(out)


def placements(spec: P, mesh: Mesh) -> list:
    """DTensor placements, one per mesh axis, giving each rank the block JAX's layout of `spec` does.

    Within a dim split over several axes, an axis whose entry lists axes before it that come later in
    the mesh is strided (`_StridedShard`), as `compiler.annotate.spec_to_layout` works it out."""
    out = []
    for m, axis in enumerate(mesh.axis_names):
        placement = Replicate()
        for dim in range(len(spec)):
            axes = spec.dim_axes(dim)
            if axis in axes:
                before = axes[: axes.index(axis)]
                stride = 1
                for a in before:
                    stride *= mesh.axis_size(a) if mesh.axis_index(a) > m else 1
                placement = StridedShard(dim, split_factor=stride) if stride > 1 else Shard(dim)
        out.append(placement)
    return out


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)
