"""Activation recompute of the compiled model's blocks: whole blocks, or all but the matmuls.

`block` keeps only each block's inputs and recomputes the rest in backward.
`selective` keeps the outputs of the matmuls and attention (the expensive
ops) and recomputes the cheap elementwise ones (torch's selective
activation checkpointing). Collectives inside a block run again when it is
recomputed; the plan counts them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
_KEEP = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default, aten.matmul.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_attention_math.default,
}  # fmt: skip


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


class Recompute(nn.Module):
    """Run `block` under activation checkpointing (`mode`: "block" or "selective")."""

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, *args):
        if self.mode == "selective":
            ctx = partial(create_selective_checkpoint_contexts, _policy)
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=ctx)
        return checkpoint(self.block, *args, use_reentrant=False)
