"""What a rank computes, counted op by op in the dry run: the plan's compute per pass, for the time model.

`OpCounter` is a dispatch mode: every aten op the dry run dispatches on meta tensors is one op of the pass it
runs in (forward; backward; recompute, while a checkpointed layer replays its forward; weight, a zero-bubble
schedule's weight pass). An op with a FLOP formula in torch's registry (`torch.utils.flop_counter`: matrix
products, attention kernels, convolutions) is a matrix product of that many FLOPs, reading and writing its
inputs and outputs. CPU's fused attention kernel (`dryrun.cpu_attention`; torch's registry has no formula
for it) is a fused attention call (`Compute.attention`), its FLOPs as `meshlib.transformer_work` counts a fused
kernel: 2·(batch·heads)·s_q·s_k·(d + d_v), halved with the causal mask (the kernel skips the masked blocks),
2.5 times that in backward (which recomputes the scores); the time model prices each call at the profile's
`attention_fraction` of its query length and head dim. Every other op
moves its inputs' and outputs' bytes (a view moves none). The counts are `meshlib.Compute` values, one per
pass, of one microbatch on one rank.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.flop_counter import flop_registry

from meshlib import Compute

from ...modules.recompute import replaying
from ...modules.repeat import times
from ...torch_private import TorchDispatchMode, in_backward, pytree

__all__ = ["OpCounter"]

# ops that allocate or describe without moving data; `_unsafe_view` returns its input's storage reshaped (as
# `view` does, but its schema does not say it aliases, so `func.is_view` is False: matmul's reshapes of its
# operands and result run through it)
_FREE = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias", "lift_fresh",
         "_to_copy_meta", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense",
         "_unsafe_view"}  # fmt: skip


def _fused_attention(args, backward: bool) -> tuple[float, int, int, bool]:
    """One call of CPU's flash attention kernel (forward or backward) as `Compute.attention` keys it: its FLOPs,
    as the closed form counts them, its query rows and its head dim."""
    q, k, v = args[1:4] if backward else args[:3]
    causal = args[7] if backward else (args[4] if len(args) > 4 else False)
    call = Compute.attention_call(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                                  causal=bool(causal), backward=backward)  # fmt: skip
    return call[:4]


_FUSED = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: False,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: True}  # fmt: skip


def _nbytes(values) -> int:
    total = 0
    for t in pytree.tree_flatten(values)[0]:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


class OpCounter(TorchDispatchMode):
    """Count the ops dispatched under it, by pass; `phase` forces one (the weight pass), else it is read
    from autograd and recompute. `computes()` gives `{pass: Compute}`."""

    def __init__(self):
        super().__init__()
        self.phase: str | None = None
        self._matmuls: dict[str, dict[tuple[float, float], int]] = defaultdict(lambda: defaultdict(int))
        self._other: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
        self._attention: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))

    def _pass(self) -> str:
        if self.phase is not None:
            return self.phase
        if replaying():
            return "recompute"
        return "backward" if in_backward() else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        name = packet.__name__
        where, n = self._pass(), times()  # an op standing for n alike (`modules.repeat`)
        if not n:
            return out
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            self._matmuls[where][(flops, float(_nbytes((args, kwargs)) + _nbytes(out)))] += n
        else:
            other = self._other[where]
            other[2] += n
            if packet in _FUSED:
                self._attention[where][_fused_attention(args, _FUSED[packet])] += n
            if name not in _FREE and not func.is_view:
                other[1] += n * (_nbytes((args, kwargs)) + _nbytes(out))
        return out

    def computes(self) -> dict[str, Compute]:
        passes = set(self._matmuls) | set(self._other)
        return {
            p: Compute(
                tuple((f, b, n) for (f, b), n in self._matmuls.get(p, {}).items()),
                *self._other.get(p, [0.0, 0.0, 0]),
                attention=tuple((*key, n) for key, n in self._attention.get(p, {}).items()),
            )
            for p in passes
        }  # fmt: skip
