"""The precision step: parameters in the compute dtype, with their full-precision values kept for masters.

Below ZeRO-2 every parameter becomes a bf16/fp16 copy and the optimizer keeps
fp32 masters (`MeshAdamW`). Under ZeRO-2/3 FSDP2's mixed-precision policy casts
what it shards; only what it leaves whole (`zero.left_whole`) is cast here.
"""

from __future__ import annotations

import torch
from torch import nn

from ..torch_private import own_parameters
from .parallelisms.zero import left_whole


def apply_precision(par) -> dict[str, torch.Tensor]:
    """Cast to the plan's compute dtype where it is bf16 or fp16; returns the full-precision values the
    parameters had, by their FQN (the optimizer's masters start from them)."""
    opts = par.compiled.options
    compute = getattr(torch, opts.precision.param)
    if compute not in (torch.bfloat16, torch.float16):
        return {}
    only = None
    if opts.zero >= 2:
        left = left_whole(par)
        only = {path for path, p in par.root.named_parameters() if id(p) in left}
    return par.canonical(cast_params(par.root, compute, only=only))


def cast_params(module: nn.Module, dtype: torch.dtype, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Replace the parameters by `dtype` copies; return their former values by path.

    New Parameter objects, not `p.data = ...`: a DTensor's `.data` assignment
    relabels its dtype but keeps the old local tensor.
    """
    out, new = {}, {}
    chosen = set()
    for path, p in module.named_parameters():
        if only is None or path in only:
            out[path] = p.data
            chosen.add(id(p))
    for mod in module.modules():
        for name, p in list(own_parameters(mod).items()):
            if p is None or id(p) not in chosen:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(p.data.to(dtype), requires_grad=p.requires_grad)
            own_parameters(mod)[name] = new[id(p)]
    return out


__all__ = ["apply_precision", "cast_params"]
