"""A bundled Llama whose feed-forward is per-shard code: a `shard_map` region, Megatron's MLP written
as JAX users write it (each tp rank multiplies by its columns of w1 and w3 and its rows of w2, then
`lax.psum` over tp), for the tests that compile it.

`build_region(mesh)` and `build_plain()` make the same weights (the region keeps the `nn.Linear`
children, so parameter names match); the plain one is the single-process reference. The functions
live at module level so that rank pools can run them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshlib as ml
from meshlib_torch import lax, shard_map
from meshlib_torch.models import build, default_rules

NAME, BATCH, SEQ = "llama-tiny", 4, 8


def megatron_mlp(x, w1, w3, w2):
    """Per tp rank: x (b, t, d) whole over tp; w1, w3 (f/tp, d); w2 (d, f/tp)."""
    h = F.silu(x @ w1.t()) * (x @ w3.t())
    return lax.psum(h @ w2.t(), "tp")


def _mapped(mesh: ml.Mesh, fn=megatron_mlp, check_vma: bool = True):
    dp = "dp" if "dp" in mesh else None
    return shard_map(
        fn, mesh=mesh, check_vma=check_vma,
        in_specs=(ml.P(dp), ml.P("tp", None), ml.P("tp", None), ml.P(None, "tp")), out_specs=ml.P(dp),
    )  # fmt: skip


class RegionFeedForward(nn.Module):
    """The feed-forward's weights, multiplied in a region of per-shard code."""

    def __init__(self, ffn: nn.Module, mapped):
        super().__init__()
        self.w1, self.w2, self.w3, self.mapped = ffn.w1, ffn.w2, ffn.w3, mapped

    def forward(self, x):
        return self.mapped(x, self.w1.weight, self.w3.weight, self.w2.weight)


def build_plain() -> nn.Module:
    torch.manual_seed(0)
    model = build(NAME, device="cpu", dtype=torch.float64)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    model.init_buffers()
    return model


def build_region(mesh: str, check_vma: bool = True) -> nn.Module:
    model = build_plain()
    mapped = _mapped(ml.Mesh.parse(mesh), check_vma=check_vma)
    for layer in model.layers:
        layer.feed_forward = RegionFeedForward(layer.feed_forward, mapped)
    return model


def rules(mesh: ml.Mesh):
    return default_rules(NAME, mesh)


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)
