"""Capacity mode in one process: the model as written, its experts dropping what the ranks drop.

Capacity mode (`capacity_factor=`) lets each expert take at most C = ceil(c·T·k/E) pairs from each rank's
call, the first C in (token, slot) order (`experts.capacity_dropped`); a dropped pair adds nothing. The
ranks' calls see contiguous, equal blocks of the global batch's rows: data rank r holds rows r·B/n on, and
cuts them into m microbatches in order, so the global batch is n·m blocks in row order, each one call on
one rank. `drop_as_ranks(model, blocks, c)` makes one process's call of `model` on the global batch drop
exactly those pairs: a pre-hook on each experts module zeroes the dropped pairs' weights, block by block,
and counts them. The reference is the rule written again over the whole batch, not the ranks' code.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compiler.capture.moe import expert_modules
from ..experts.routing import capacity_dropped


class DropAsRanks:
    """The hooks `drop_as_ranks` hangs; `dropped` counts the pairs dropped since made (or `remove`d)."""

    def __init__(self, model: nn.Module, blocks: int, capacity_factor: float):
        self.blocks, self.capacity_factor, self.dropped = blocks, capacity_factor, 0
        self.handles = [mod.register_forward_pre_hook(self._hook) for mod in expert_modules(model).values()]
        if not self.handles:
            raise ValueError("drop_as_ranks: the model has no experts module meshlib recognises")

    def _hook(self, mod: nn.Module, args: tuple):
        x, index, weights = args[:3]
        if index.shape[0] % self.blocks:
            raise ValueError(f"drop_as_ranks: {index.shape[0]} tokens do not split into {self.blocks} equal blocks")
        experts = mod.gate_up_proj.shape[0]
        drop = torch.cat([
            capacity_dropped(block, num_experts=experts, capacity_factor=self.capacity_factor)
            for block in index.chunk(self.blocks)
        ])  # fmt: skip
        self.dropped += int(drop.sum())
        return (x, index, weights.masked_fill(drop, 0), *args[3:])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def drop_as_ranks(model: nn.Module, blocks: int, capacity_factor: float) -> DropAsRanks:
    """Make `model`'s experts drop, on the global batch, what capacity mode drops on `blocks` rank calls."""
    return DropAsRanks(model, blocks, capacity_factor)


__all__ = ["DropAsRanks", "drop_as_ranks"]
