"""The recompute step: each block of the lowered graph under activation checkpointing (`modules.recompute`)."""

from __future__ import annotations

from ..modules.recompute import Recompute, gathers, keep_shards


def apply_recompute(par) -> None:
    """Wrap every layer block in `Recompute` ("block": keep its inputs only; "selective": keep its
    collectives', projections' and attention's outputs too), in the graph or in each of this rank's
    stages; and keep the all-gathered values backward needs as their shards
    (`modules.recompute.keeping_shards`)."""
    if any(gathers(spec) for spec in par.compiled.comms):  # sequence parallelism's all-gathers
        for module in par.stage_modules:
            keep_shards(module)
    mode = par.compiled.options.recompute
    if mode == "none":
        return
    for module in par.stage_modules:
        for name, block in list(module.named_children()):
            if name.startswith("layer_"):
                setattr(module, name, Recompute(block, mode))


__all__ = ["apply_recompute"]
