"""Writes into a buffer in the forward (`self.tokens_per_expert.add_(counts)`, a running count).

torch.fx counts a method call as pure, so its dead-code elimination drops such a write whose result
no one reads, and the buffer silently stops changing. Every dead-code elimination in the compiler
goes through `eliminate_dead_code` here, which keeps them. A kept write has no rule of its own: it is
placed as an op without one (every input whole: a partial sum such as a count over a split batch is
summed over the ranks first, so each rank's buffer holds the same, global, value). After placement
(`as_buffer_writes`) each runs through `modules.recompute.write_buffer`, which a recomputed block's
replay skips, so a count is not counted twice.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def writes_buffer(node: fx.Node) -> bool:
    """An in-place method (`add_`, `copy_`, `mul_`, ...) called on a buffer of the graph's module (or such
    a call made recompute-aware by `as_buffer_writes`)."""
    if node.meta.get("writes_buffer"):
        return True
    if node.op != "call_method" or not node.target.endswith("_") or node.target.endswith("__"):
        return False
    base = node.args[0] if node.args else None
    if not isinstance(base, fx.Node) or base.op != "get_attr" or node.graph.owning_module is None:
        return False
    try:
        value = node.graph.owning_module.get_buffer(base.target)
    except AttributeError:
        return False
    return isinstance(value, torch.Tensor)


def eliminate_dead_code(graph: fx.Graph) -> None:
    """fx's dead-code elimination, keeping writes into buffers."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or writes_buffer(n))


def as_buffer_writes(graph: fx.Graph) -> None:
    """Each buffer write becomes `modules.recompute.write_buffer`: a recomputed block writes once."""
    from ...modules.recompute import write_buffer

    for node in list(graph.nodes):
        if writes_buffer(node) and node.op == "call_method":
            node.args = (node.target, *node.args)
            node.op, node.target = "call_function", write_buffer
            node.meta["writes_buffer"] = True


__all__ = ["as_buffer_writes", "eliminate_dead_code", "writes_buffer"]
