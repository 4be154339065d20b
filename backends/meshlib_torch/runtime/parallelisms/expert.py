"""Expert parallelism's part of the step: the routers' token counts, and DeepSeek-V3's auxiliary-loss-free
balancing (arXiv:2412.19437, section 2.1.2).

The counts are each router's `tokens_per_expert` buffer, which its forward adds to: the compiler keeps
that write and sums the count over every rank that routes before it (`compiler/capture/effects.py`), so
every rank holds the same, global, counts; a recomputed block does not count twice
(`modules.recompute.write_buffer`). After each optimizer step `Routing` notes what the step added (the
router statistics `meshlib run` prints), then each balancing router's bias moves by `rate` against its
experts' load, bias += rate * sign(mean count - count), and its counts start again from zero: every
rank moves the bias the same way, so the biases stay bitwise equal.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...experts.routing import DROPPED

__all__ = ["Routing", "apply_expert"]


class Routing:
    """The routers of `par` this rank holds (with a pipeline: its stages'). Their buffers are looked up by
    name at each step: loading a checkpoint may replace them."""

    def __init__(self, par, routers: tuple[tuple[str, str, float], ...]):
        self.par, self.routers = par, routers
        self.last: dict[str, torch.Tensor] = {}  # tokens per expert in the last step, by counts buffer
        self._start: dict[str, torch.Tensor] = {}
        self.last_dropped = DROPPED.take()  # this rank's pairs capacity mode dropped in the last step
        self.capacity_factor = par.compiled.options.capacity_factor

    @torch.no_grad()
    def step(self) -> None:
        """After the update: note the step's counts and drops, move the balancing biases, restart their counts."""
        self.last_dropped = DROPPED.take()
        held = self.par.named_model_buffers()
        for counts, bias, rate in self.routers:
            if counts not in held:
                continue
            c = held[counts]
            self.last[counts] = c.detach().clone() - self._start.get(counts, 0)
            if bias and bias in held:
                b = held[bias]
                b += rate * torch.sign(c.mean() - c).to(b.dtype)
                c.zero_()
            self._start[counts] = c.detach().clone()

    def statistics(self) -> list[tuple[str, list[float], float]]:
        """Per router, `(counts buffer, tokens per expert in the last step, imbalance)`: the imbalance is the
        busiest expert's load over the mean (1 is even)."""
        out = []
        for name, c in self.last.items():
            mean = float(c.double().mean())
            out.append((name, [float(v) for v in c.double()], float(c.double().max()) / mean if mean else 0.0))
        return out

    def dropped(self) -> int | None:
        """The (token, expert) pairs capacity mode dropped in the last step, over every rank that routes (None:
        dropless). Each rank counts its own tokens' pairs in each of its layers: the count is summed over the
        world, and ranks that dispatch the same tokens (tensor-parallel ones) count once. One all-reduce over
        the world, when asked (not part of the step): call it on every rank."""
        if self.capacity_factor is None:
            return None
        c = self.par.compiled
        total = self.last_dropped.to(self.par.device).clone()
        dist.all_reduce(total)
        spread = set(c.data_axes) | ({c.pp_axis} if c.pipelined else set())
        same = math.prod(c.mesh.axis_size(a) for a in c.mesh.axis_names if a not in spread)
        return int(total) // same


def apply_expert(par) -> Routing | None:
    """The routing of the compiled model's routers (`compiler.capture.moe.balancing_routers`), if any."""
    c = par.compiled
    return Routing(par, c.routers) if c.routers or c.options.capacity_factor is not None else None
