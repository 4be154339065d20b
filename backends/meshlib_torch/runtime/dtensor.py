"""Our placements as DTensor's: the one seam between the compiler's layouts and torch.distributed.tensor.

A shard in equal groups is DTensor's strided shard. A shard in unequal parts (a fused qkv under
grouped-query attention: each rank a block of q, of k and of v) has no DTensor placement: such a
parameter is a DTensor `Shard(dim)` of its rows in rank order (rank 0's blocks, then rank 1's, ...),
which is what each rank holds. Norms and elementwise updates see the right values; what reads it
whole puts the rows back in the model's order (`model_order`, from `Compiled.param_rank_order`):
`Parallel.whole`, `export` and checkpoints do, and a bare `full_tensor()` of it does not.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..compiler.placement import placements as pl
from ..torch_private import StridedShard


def torch_placements(layout: pl.Layout) -> list:
    """One DTensor placement per mesh axis (a shard in groups is DTensor's strided shard; in unequal parts,
    a plain shard of the rows in rank order)."""
    out = []
    for p in layout:
        if isinstance(p, pl.Shard):
            out.append(StridedShard(p.dim, split_factor=p.groups) if p.groups > 1 else Shard(p.dim))
        elif isinstance(p, pl.Partial):
            out.append(Partial())
        else:
            out.append(Replicate())
    return out


def model_order(whole: torch.Tensor, order: dict[int, torch.Tensor]) -> torch.Tensor:
    """A whole tensor whose rows along each dim of `order` are in rank order, in the model's order."""
    for dim, rows in order.items():
        out = torch.empty_like(whole)
        out.index_copy_(dim, rows.to(whole.device), whole)
        whole = out
    return whole


def gather_whole(t: torch.Tensor, order: dict[int, torch.Tensor]) -> torch.Tensor:
    """The whole of a parameter (or of a tensor laid out as it is: its gradient, master, optimizer state)
    on every rank that holds a part: DTensor gathers it, and rows held in rank order go back in place."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return model_order(whole, order) if order and tuple(whole.shape) == tuple(t.shape) else whole


__all__ = ["gather_whole", "model_order", "torch_placements"]
