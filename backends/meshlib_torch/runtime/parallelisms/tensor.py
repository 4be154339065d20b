"""Tensor (and sequence) parallelism on a real mesh: the compiled collectives bound to process groups.

The compiler placed every value and inserted each redistribution as a
`CommSpec` and each rank-dependent op (the vocab-parallel embedding and loss)
as a `SpecialSpec`. Here each becomes a module on the lowered root, on this
rank's coordinates and its axes' process groups: a `Comm` (one c10d
collective per axis that changes, counted) and the local op.
"""

from __future__ import annotations

from torch import nn

from ...modules.special import special_module
from ..comm import Comm, reducer


def bind_collectives(root: nn.Module, compiled, groups: dict, coords: dict) -> None:
    """Add the compiled collectives and rank-dependent ops to `root`, by the names the graph calls them."""
    for spec in compiled.comms:
        root.add_module(spec.name, Comm(spec, compiled.axes, groups, coords, mode=compiled.options.recompute))
    for spec in compiled.specials:
        root.add_module(spec.name, special_module(spec, coords, reducer(groups)))


__all__ = ["bind_collectives"]
