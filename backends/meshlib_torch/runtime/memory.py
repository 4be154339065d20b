"""Measuring model-state memory on a rank: parameters, gradients and optimizer state, in bytes."""

from __future__ import annotations

import torch

from ..torch_private import local_tensor


def model_state_bytes(par, opt) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (as they are now) and optimizer state.

    FSDP2 keeps the gradients as views into one flat buffer, so each tensor is
    counted by its own elements; a ZeRO-1 master that is a view into a
    full-precision parameter is counted as the parameter's (`opt.state_bytes`).
    """
    params = list(par.named_model_parameters().values())

    def size(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    return {
        "params": sum(size(p.data) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": opt.state_bytes(),
    }
