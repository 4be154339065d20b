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
