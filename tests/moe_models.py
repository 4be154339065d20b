"""The bundled MoE models as test subjects: the same fp64 weights on every call, module-level functions
that rank pools can run (see `region_models` for the pattern)."""

from __future__ import annotations

import torch
from torch import nn

from meshlib_torch.models import build, default_rules

BATCH, SEQ = 4, 8


def build_moe(name: str = "moe-tiny") -> nn.Module:
    torch.manual_seed(0)
    model = build(name, device="cpu", dtype=torch.float64)
    for pname, p in model.named_parameters():
        if not pname.endswith("norm.weight"):
            nn.init.normal_(p, std=0.05)
    model.init_buffers()
    return model


def build_tiny() -> nn.Module:
    return build_moe("moe-tiny")


def build_ds() -> nn.Module:
    return build_moe("moe-tiny-ds")


def rules_tiny(mesh):
    return default_rules("moe-tiny", mesh)


def rules_ds(mesh):
    return default_rules("moe-tiny-ds", mesh)


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


class BalancedRouter(nn.Module):
    """A router whose choices are fixed and even: token t's slot j goes to expert (t*k + j) mod E, so
    every rank sends every other the same number of rows (the closed forms' assumption); its weights
    still come from the router's softmax, so the router trains."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.weight, self.top_k, self.n_experts = gate.weight, gate.top_k, gate.n_experts

    def forward(self, x):
        logits = x @ self.weight.t()
        slots = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * self.top_k
        index = (slots + torch.arange(self.top_k, device=x.device)) % self.n_experts
        return logits, torch.softmax(logits, dim=-1).gather(1, index), index


class SkewedRouter(BalancedRouter):
    """`BalancedRouter`, its choices among experts 0 .. `share` - 1 only: on ep ranks of E/ep experts each
    with `share` = E/ep, every pair goes to rank 0's experts, which draw ep times an even share."""

    def __init__(self, gate: nn.Module, share: int):
        super().__init__(gate)
        self.n_experts = share


def build_balanced() -> nn.Module:
    model = build_moe("moe-tiny-ds")
    for layer in model.layers:
        if hasattr(layer, "moe"):
            layer.moe.gate = BalancedRouter(layer.moe.gate)
    return model


def build_skewed_to_rank_0_of_2() -> nn.Module:
    """moe-tiny-ds whose routers send every pair to experts 0-3, rank 0's of ep=2 (E = 8)."""
    model = build_moe("moe-tiny-ds")
    for layer in model.layers:
        if hasattr(layer, "moe"):
            layer.moe.gate = SkewedRouter(layer.moe.gate, 4)
    return model


CAPACITY = 1.0  # drops pairs of moe-tiny-ds's routing on every mesh the tests use


def build_ds_dropping_as(blocks: int):
    """moe-tiny-ds whose experts drop, on the global batch, what capacity mode drops on `blocks` rank calls
    (moe-tiny-ds has no auxiliary loss, which microbatches would make per microbatch)."""
    from meshlib_torch.testing.capacity import drop_as_ranks

    model = build_ds()
    model.capacity_hooks = drop_as_ranks(model, blocks, CAPACITY)
    return model


def build_ds_dropping_as_2():
    return build_ds_dropping_as(2)


def build_ds_dropping_as_4():
    return build_ds_dropping_as(4)



def long_batch(step: int) -> tuple:
    """8 sequences of 64 tokens: 512 tokens, 1,024 (token, expert) pairs per router per step."""
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, 256, (8, 64), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def uneven_batch(step: int) -> tuple:
    """5 sequences of 8: ep=4 splits them 2, 2, 1, 0 under `uneven="chunk"` (the last rank routes nothing)."""
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, 256, (5, 8), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)
