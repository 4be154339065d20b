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
    """The balancing routers of `par` this rank holds (with a pipeline: its stages'), updated by `step`.
    Their buffers are looked up by name at each step: loading a checkpoint may replace them."""

    def __init__(self, par, routers: tuple[tuple[str, str, float], ...]):
        self.par, self.routers = par, routers

    @torch.no_grad()
    def step(self) -> None:
        held = self.par.named_model_buffers()
        for counts, bias, rate in self.routers:
            if counts in held and bias in held:
                c, b = held[counts], held[bias]
                b += rate * torch.sign(c.mean() - c).to(b.dtype)
                c.zero_()


def apply_expert(par) -> BalancingBias | None:
    """The balancing of the compiled model's routers (`compiler.capture.moe.balancing_routers`), if any."""
    return BalancingBias(par, par.compiled.routers) if par.compiled.routers else None
