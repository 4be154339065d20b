"""The experts' compute: each local expert's MLP on its own consecutive group of rows.

The math is transformers v5's Mixtral experts (`MixtralExperts.forward`): for expert `e` and its rows
`r`, `[g, u] = r @ gate_up_proj[e].T` split in halves (gate first), `down_proj[e] @ (silu(g) * u)`.

Two ways, the same numbers: one grouped GEMM per projection (`torch._grouped_mm`, through
`torch_private.grouped_mm`) where torch's kernel takes the inputs, else a loop over the experts with
`split` (float64 always: the kernel has no float64). Measured on torch 2.13's CPU build: the kernel runs
float32, bfloat16 and float16, with int32 offsets of any values (zero-row groups included), on matrices
whose last two dims have one unit stride and the other a multiple of 16 bytes (float32: hidden and
intermediate sizes multiples of 4; 16-bit: of 8), forward and backward; its meta kernel takes bfloat16
only, and a broadcast (stride 0) cotangent is refused. Here it is used on CPU only, where this was
verified; elsewhere (and on meta tensors) the loop runs.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..torch_private import grouped_mm, has_grouped_mm

__all__ = ["expert_mlp", "grouped_gemm_runs"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor, step: int) -> bool:
    """torch's rule for a grouped GEMM operand: of its last two dims, one has stride 1 and the other a stride
    that is a multiple of `step` elements (16 bytes)."""
    rows, cols = t.stride()[-2:]
    return (cols == 1 and rows % step == 0) or (rows == 1 and cols % step == 0)


def grouped_gemm_runs(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands, forward and backward (see the module docstring)."""
    if not has_grouped_mm() or rows.device.type != "cpu":
        return False
    if rows.dtype not in _KERNEL_DTYPES or not rows.dtype == gate_up_proj.dtype == down_proj.dtype:
        return False
    step = 16 // rows.element_size()
    hidden, inner = gate_up_proj.shape[-1], down_proj.shape[-1]
    weights = (gate_up_proj.transpose(-2, -1), down_proj.transpose(-2, -1))
    return hidden % step == 0 and inner % step == 0 and all(_aligned(w, step) for w in weights)


def _act(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_mlp(
    rows: torch.Tensor, group_rows: list[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
    grouped: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Expert `e`'s MLP on its `group_rows[e]` consecutive rows of `rows` (R, H), for every local expert:
    (R, H). `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I). `grouped`: None picks the grouped GEMM where
    it runs (`grouped_gemm_runs`), True insists on it, False loops. An expert with no rows gives none, and
    its weights get an exact zero gradient."""
    if len(group_rows) != gate_up_proj.shape[0] or sum(group_rows) != rows.shape[0]:
        raise ValueError(
            f"expert_mlp: group_rows {list(group_rows)} must give each of the {gate_up_proj.shape[0]} experts its "
            f"rows and sum to the {rows.shape[0]} rows"
        )
    runs = grouped_gemm_runs(rows, gate_up_proj, down_proj)
    if grouped and not runs:
        raise ValueError(
            f"expert_mlp(grouped=True): torch._grouped_mm does not take {rows.dtype} rows of width {rows.shape[1]} "
            f"on {rows.device} with intermediate size {down_proj.shape[-1]} here (see experts.grouped). Fix: "
            "grouped=None picks the loop"
        )
    if runs if grouped is None else grouped:
        return _grouped(rows, group_rows, gate_up_proj, down_proj)
    return _looped(rows, group_rows, gate_up_proj, down_proj)


def _grouped(rows, group_rows, gate_up_proj, down_proj) -> torch.Tensor:
    ends = torch.tensor(list(itertools.accumulate(group_rows)), dtype=torch.int32, device=rows.device)
    h = grouped_mm(rows.contiguous(), gate_up_proj.transpose(-2, -1), ends)
    return grouped_mm(_act(h).contiguous(), down_proj.transpose(-2, -1), ends)


def _looped(rows, group_rows, gate_up_proj, down_proj) -> torch.Tensor:
    groups = rows.split(list(group_rows))
    return torch.cat([_act(r @ gu.T) @ d.T for r, gu, d in zip(groups, gate_up_proj, down_proj)])
