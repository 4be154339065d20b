"""ZeRO-2 and ZeRO-3 with FSDP2's `fully_shard`, on the compiled model's blocks.

Each layer of the split model is one FSDP unit, the rest (embeddings, head)
is the root's. The parameters are already DTensors on the whole mesh, so
`dp_mesh_dims` tells FSDP which axes are data-parallel (and which of those
only replicate: HSDP). Gradients are summed, not averaged, over those axes
(the compiled loss is already each rank's share of the global mean). Every
all-gather and reduce-scatter goes through meshlib's counter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .comm import COUNTER, CommCounter

try:  # torch >= 2.13: parameters already on a full SPMD mesh
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - older torch
    DataParallelMeshDims = None

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover
    AllGather = ReduceScatter = object


class _Alloc:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_Alloc, AllGather):
    def __init__(self, axis: str, counter: CommCounter):
        self.axis, self.counter = axis, counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.counter.record(
            phase, "all_gather", self.axis, output_tensor.numel() * output_tensor.element_size(), "fsdp"
        )
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(_Alloc, ReduceScatter):
    def __init__(self, axis: str, counter: CommCounter):
        self.axis, self.counter = axis, counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.record(
            "backward", "reduce_scatter", self.axis, input_tensor.numel() * input_tensor.element_size(), "fsdp"
        )
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def apply_fsdp(
    top: nn.Module,
    layers: list[nn.Module],
    device_mesh,
    *,
    zero: int,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    offload: bool = False,
    prefetch: bool = True,
    counter: CommCounter = COUNTER,
) -> list[nn.Module]:
    """Shard `layers` and then `top` (the root); returns the FSDP units, layers first."""
    if DataParallelMeshDims is None:
        raise RuntimeError("ZeRO-2/3 on a model that is also tensor-parallel needs torch>=2.13 (DataParallelMeshDims)")
    dims = DataParallelMeshDims(
        shard=shard_axes[0] if len(shard_axes) == 1 else shard_axes,
        replicate=(replicate_axes[0] if len(replicate_axes) == 1 else replicate_axes) if replicate_axes else None,
    )
    strided = any(_shard_placement(p) is not None for p in top.parameters())
    if strided and replicate_axes:
        raise ValueError(
            "HSDP (replicate_axes) with a fused projection split in groups over tp is not supported by FSDP2 "
            "(per-parameter shard placements need a pure sharding mesh). Fix: drop replicate_axes, or unfuse"
        )
    kwargs = dict(
        ignored_params=set(unshardable(top)) or None,
        shard_placement_fn=_shard_placement if strided else None,
        mesh=device_mesh,
        reshard_after_forward=zero == 3,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy(),
        dp_mesh_dims=dims,
    )
    units = [fully_shard(layer, **kwargs) for layer in layers]
    units.append(fully_shard(top, **kwargs))
    axis = "_".join(shard_axes)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # the loss is already each rank's share of the global mean
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        unit.set_custom_all_gather(CountedAllGather(axis, counter))
        unit.set_custom_reduce_scatter(CountedReduceScatter(axis, counter))
    if prefetch:
        for i, unit in enumerate(units[:-1]):
            if i + 1 < len(units) - 1:
                unit.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                unit.set_modules_to_backward_prefetch([units[i - 1]])
    return units


def unshardable(module: nn.Module) -> list[nn.Parameter]:
    """1-D parameters split in groups over tensor parallelism (a fused projection's bias): FSDP
    cannot shard them without breaking their DTensor layout, so they stay whole on every
    data-parallel rank and their gradients are all-reduced (a few bytes per layer)."""
    out = []
    for p in module.parameters():
        if p.dim() == 1 and any(isinstance(q, _StridedShard) for q in getattr(p, "placements", ())):
            out.append(p)
    return out


def _shard_placement(param: torch.Tensor):
    """FSDP splits dim 0 unless a tensor-parallel placement already splits it in groups (a fused
    projection's strided shard): DTensor cannot nest FSDP's shard inside that, so take dim 1."""
    placements = getattr(param, "placements", ())
    if any(isinstance(p, _StridedShard) and p.dim == 0 for p in placements) and param.dim() > 1:
        return Shard(1)
    return None


def set_sync(units: list[nn.Module], enabled: bool) -> None:
    """Gradient accumulation: no reduce-scatter until the last microbatch."""
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)
