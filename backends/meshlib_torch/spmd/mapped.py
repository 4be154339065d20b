"""What `shard_map` returns: `f` mapped over its arguments' shards, in the three places it runs.

- Called on real tensors or DTensors, it runs on the mesh's ranks (`shard_map.eager_call`).
- Traced by torch.fx inside a model given to `compile_model`, it is one node: the call itself, whose
  target is this object, opaque to the compiler but for its specs (`compiler.placement.ops`).
- Traced by torch.export, it is one call of the custom op `meshlib::shard_map` on its tensors (`exported`),
  which the compiler turns back into the call itself (`capture.shard_maps.restore_shard_maps`).
- Called on meta or fake tensors (the compiler's passes that note each value's shape and dtype), it
  returns empty tensors of the results' global shapes, from one abstract run of `f` on the shards.

This module imports nothing of the runtime, so the compiler can recognise a region's node by its type.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import optree
import torch
import torch.fx as fx

from meshlib import Mesh

from ..torch_private import is_fake
from .plan import abstract_run
from .specs import Leaf, global_shape, local_shape, match

__all__ = ["Exported", "ShardMapped", "exported", "local_args"]


class ShardMapped:
    """`f` over the shards of its arguments on `mesh` (see the module docstring); `shard_map` makes it."""

    def __init__(self, f, mesh: Mesh, in_specs, out_specs, check_vma: bool, eager):
        self.f, self.mesh, self.in_specs, self.out_specs, self.check_vma = f, mesh, in_specs, out_specs, check_vma
        # the mesh axis whose sequence shards the region takes in the head-tail layout (context parallelism's
        # attention, `compiler.capture.attention`); None: every shard is JAX's block
        self.zigzag: str | None = None
        # axes over which the region's rows (dim 0 of its row inputs and results) may come in any order
        # (per-row code: mixture-of-experts layers), as the first input holds them
        self.any_rows: tuple[str, ...] = ()
        # {axis: size}: a dim of that size split over that axis alone comes in torch.chunk's pieces, the last
        # ones shorter (context parallelism's attention under uneven='chunk'); JAX's shard_map has no such thing
        self.chunked: dict[str, int] = {}
        self._eager = eager
        functools.update_wrapper(self, f)

    def __repr__(self) -> str:
        return f"shard_map({self.__name__}, in_specs={self.in_specs!r}, out_specs={self.out_specs!r})"

    def __call__(self, *args):
        leaves = optree.tree_leaves(args, none_is_leaf=True)
        proxy = next((a for a in leaves if isinstance(a, fx.Proxy)), None)
        if proxy is not None:  # traced by torch.fx: one node, this object its target
            return proxy.tracer.create_proxy("call_function", self, args, {})
        if torch.compiler.is_exporting():
            return _export_call(self, args)
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        if tensors and all(t.is_meta or is_fake(t) for t in tensors):
            return self.abstract(args)
        return self._eager(args)

    def abstract(self, args: tuple):
        """Empty tensors of the results' global shapes (on the inputs' device: meta, or fake)."""
        leaves, local, treedef = local_args(self, args)
        outs, out_tree, _ = abstract_run(self.f, self.mesh, local, treedef, self.out_specs, check_vma=self.check_vma)
        device = next(leaf.value.device for leaf in leaves if isinstance(leaf.value, torch.Tensor))
        grad = any(isinstance(leaf.value, torch.Tensor) and leaf.value.requires_grad for leaf in leaves)
        results = []
        for o in outs:
            shape = global_shape(tuple(o.value.shape), o.spec, self.mesh, self.chunked)
            t = torch.empty(shape, dtype=o.value.dtype, device=device)
            results.append(t.requires_grad_(grad and t.is_floating_point() and torch.is_grad_enabled()))
        return optree.tree_unflatten(out_tree, results)


def local_args(mapped: ShardMapped, args: tuple) -> tuple[list[Leaf], list[Leaf], object]:
    """`(leaves, local leaves, treedef)`: the arguments, and the same with every mapped tensor replaced by a
    meta tensor of the shard one rank holds (checked: a tensor, a spec that fits it)."""
    name = getattr(mapped.f, "__name__", repr(mapped.f))
    leaves, treedef = match(mapped.in_specs, args, "args", "in_specs", name)
    local = []
    for leaf in leaves:
        if leaf.spec is not None and not isinstance(leaf.value, torch.Tensor):
            raise TypeError(
                f"shard_map({name}): {leaf.path} is a {type(leaf.value).__name__}, not a tensor, but in_specs gives "
                f"it {leaf.spec!r}. Fix: pass a tensor, or give it the spec None to pass it to f unchanged"
            )
        if leaf.spec is None:
            local.append(leaf)
            continue
        shape = local_shape(leaf, tuple(leaf.value.shape), mapped.mesh, name, mapped.chunked)
        local.append(Leaf(leaf.path, torch.empty(shape, dtype=leaf.value.dtype, device="meta"), leaf.spec))
    return leaves, local, treedef


@dataclass
class Exported:
    """A region called while torch.export traced: the call's argument tree, its non-tensor leaves (None
    where a tensor goes) and, once the op's fake ran, its result tree."""

    mapped: ShardMapped
    args: object
    leaves: list
    out: object = None

    def call_args(self, tensors: list) -> tuple:
        it = iter(tensors)
        return optree.tree_unflatten(self.args, [next(it) if leaf is None else leaf for leaf in self.leaves])


_EXPORTED: dict[int, Exported] = {}  # key -> the region call a `meshlib::shard_map` node stands for
_KEYS = itertools.count()


def exported(key: int) -> Exported:
    """The region call a `meshlib::shard_map` node of key `key` stands for (given once)."""
    return _EXPORTED.pop(key)


@torch.library.custom_op("meshlib::shard_map", mutates_args=())
def _region_op(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(
        "meshlib::shard_map stands for a shard_map region in a graph torch.export traced; the compiler puts the "
        "region back in its place (capture.shard_maps.restore_shard_maps) before anything runs"
    )


@_region_op.register_fake
def _region_op_fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _EXPORTED[key]
    leaves, call.out = optree.tree_flatten(call.mapped.abstract(call.call_args(tensors)), none_is_leaf=True)
    return leaves


def _export_call(mapped: ShardMapped, args: tuple):
    """One `meshlib::shard_map` op on the call's tensors: torch.export keeps it as one node."""
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)
    key = next(_KEYS)
    _EXPORTED[key] = Exported(mapped, treedef, [None if isinstance(a, torch.Tensor) else a for a in leaves])
    outs = torch.ops.meshlib.shard_map(key, [a for a in leaves if isinstance(a, torch.Tensor)])
    return optree.tree_unflatten(_EXPORTED[key].out, outs)
