"""What `shard_map` returns: `f` mapped over its arguments' shards, in the three places it runs.

- Called on real tensors or DTensors, it runs on the mesh's ranks (`shard_map.eager_call`).
- Traced by torch.fx inside a model given to `compile_model`, it is one node: the call itself, whose
  target is this object, opaque to the compiler but for its specs (`compiler.placement.ops`).
- Called on meta or fake tensors (the compiler's passes that note each value's shape and dtype), it
  returns empty tensors of the results' global shapes, from one abstract run of `f` on the shards.

This module imports nothing of the runtime, so the compiler can recognise a region's node by its type.
"""

from __future__ import annotations

import functools

import optree
import torch
import torch.fx as fx

from meshlib import Mesh

from ..torch_private import is_fake
from .plan import abstract_run
from .specs import Leaf, global_shape, local_shape, match

__all__ = ["ShardMapped", "local_args"]


class ShardMapped:
    """`f` over the shards of its arguments on `mesh` (see the module docstring); `shard_map` makes it."""

    def __init__(self, f, mesh: Mesh, in_specs, out_specs, check_vma: bool, eager):
        self.f, self.mesh, self.in_specs, self.out_specs, self.check_vma = f, mesh, in_specs, out_specs, check_vma
        self._eager = eager
        functools.update_wrapper(self, f)

    def __repr__(self) -> str:
        return f"shard_map({self.__name__}, in_specs={self.in_specs!r}, out_specs={self.out_specs!r})"

    def __call__(self, *args):
        leaves = optree.tree_leaves(args, none_is_leaf=True)
        proxy = next((a for a in leaves if isinstance(a, fx.Proxy)), None)
        if proxy is not None:  # traced by torch.fx: one node, this object its target
            return proxy.tracer.create_proxy("call_function", self, args, {})
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
            t = torch.empty(global_shape(tuple(o.value.shape), o.spec, self.mesh), dtype=o.value.dtype, device=device)
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
        shape = local_shape(leaf, tuple(leaf.value.shape), mapped.mesh, name)
        local.append(Leaf(leaf.path, torch.empty(shape, dtype=leaf.value.dtype, device="meta"), leaf.spec))
    return leaves, local, treedef
