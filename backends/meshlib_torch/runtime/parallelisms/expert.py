"""Expert parallelism's part of the step: DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437,
section 2.1.2). After each optimizer step, each balancing router's bias moves by `rate` against its
experts' load: bias += rate * sign(mean count - count), and its counts start again from zero.

The counts are the router's `tokens_per_expert` buffer, which its forward adds to: the compiler keeps
that write and sums the count over every rank that routes before it (`compiler/capture/effects.py`),
so every rank holds the same counts, moves the bias the same way, and the biases stay bitwise equal.
A recomputed block does not count twice (`modules.recompute.write_buffer`).
"""

from __future__ import annotations

import torch

__all__ = ["BalancingBias", "apply_expert"]


class BalancingBias:
    """The balancing routers this rank holds (with a pipeline: its stages'), updated by `step`."""

    def __init__(self, routers: list[tuple[torch.Tensor, torch.Tensor, float]]):
        self.routers = routers

    @torch.no_grad()
    def step(self) -> None:
        for counts, bias, rate in self.routers:
            bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)
            counts.zero_()


def apply_expert(par) -> BalancingBias | None:
    """The balancing biases of the compiled model's routers, found among this rank's buffers by name."""
    wanted = par.compiled.routers
    if not wanted:
        return None
    held = par.named_model_buffers()
    routers = [(held[c], held[b], rate) for c, b, rate in wanted if c in held and b in held]
    return BalancingBias(routers) if routers else None
