"""Our placements as DTensor's: the one seam between the compiler's layouts and torch.distributed.tensor."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from ..compiler import placements as pl
from ..torch_private import StridedShard


def torch_placements(layout: pl.Layout) -> list:
    """One DTensor placement per mesh axis (a shard in groups is DTensor's strided shard)."""
    out = []
    for p in layout:
        if isinstance(p, pl.Shard):
            out.append(Shard(p.dim) if p.groups == 1 else StridedShard(p.dim, split_factor=p.groups))
        elif isinstance(p, pl.Partial):
            out.append(Partial())
        else:
            out.append(Replicate())
    return out


__all__ = ["torch_placements"]
