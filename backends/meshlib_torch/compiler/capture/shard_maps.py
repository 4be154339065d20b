"""shard_map regions in a graph torch.export traced: each back as one call of the region itself.

torch.fx records a region's call as one node whose target is the `ShardMapped` (`spmd/mapped.py`).
torch.export runs the forward on fake tensors, where a region would be traced through to the empty
tensors its abstract run gives; so while exporting, a region calls the custom op `meshlib::shard_map`
on its tensors instead, and `restore_shard_maps` turns each such node back into the call torch.fx
would have recorded: the same target, the same arguments, its results read by `getitem` when there
are several.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...spmd.mapped import exported


def restore_shard_maps(gm: fx.GraphModule) -> None:
    """Replace every `meshlib::shard_map` node of `gm` by its region's call (in place)."""
    graph = gm.graph
    op = torch.ops.meshlib.shard_map.default
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is op]:
        key, tensors = node.args
        call = exported(key)
        single = call.out.is_leaf()
        if not single and not all(child.is_leaf() for child in call.out.children()):
            raise NotImplementedError(
                f"shard_map({call.mapped.__name__}) at {node.meta.get('stack_trace', 'an unknown line')} returns "
                f"{call.out}: in a traced model a region returns one tensor or a flat tuple of them"
            )
        with graph.inserting_before(node):
            region = graph.call_function(call.mapped, call.call_args(list(tensors)), {})
        region.meta = {k: v for k, v in node.meta.items() if k != "val"}
        for user in list(node.users):
            if single and user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(region)
                graph.erase_node(user)
        node.replace_all_uses_with(region)
        graph.erase_node(node)


__all__ = ["restore_shard_maps"]
