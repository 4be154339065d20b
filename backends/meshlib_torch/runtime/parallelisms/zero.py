"""ZeRO-2 and ZeRO-3 with FSDP2's `fully_shard`, on the compiled model's blocks (ZeRO-1 is the optimizer's).

Each layer of the split model is one FSDP unit, the rest (embeddings, head)
is the root's. On a mesh with more than the data axes the parameters are
DTensors on the whole mesh, so `dp_mesh_dims` tells FSDP which axes are
data-parallel (and which of those only replicate: HSDP). On a mesh of one
data axis they are plain tensors sharded by FSDP over it, exactly as
`fully_shard` by hand: nothing wraps them on the way into the compiled graph.
Gradients are summed, not averaged, over the data axes (the compiled loss is
already each rank's share of the global mean). Every all-gather and
reduce-scatter goes through meshlib's counter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from ...compiler.program import fsdp_whole, shard_axes
from ...torch_private import AllGather, ReduceScatter, StridedShard, in_backward
from ..comm import COUNTER, CommCounter
from .data import GradSync, sync_groups

try:  # torch >= 2.13: parameters already on a full SPMD mesh
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - older torch
    DataParallelMeshDims = None


class _Alloc:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_Alloc, AllGather):
    def __init__(self, axis: str, counter: CommCounter):
        self.axis, self.counter = axis, counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        phase = "backward" if in_backward() else "forward"
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


def apply_zero(par, *, offload: bool, prefetch: bool) -> tuple[list, GradSync | None]:
    """ZeRO-2/3: FSDP2 on each block and the root (with a pipeline: of each of this rank's stages); a
    parameter FSDP2 leaves whole (`left_whole`) has its gradient summed by a `GradSync` instead. Returns
    the FSDP2 units and that `GradSync`."""
    compiled = par.compiled
    opts, data = compiled.options, compiled.data_axes
    if opts.zero < 2:
        return [], None
    reduce = getattr(torch, opts.precision.reduce)
    left = left_whole(par)  # before fully_shard replaces the parameters
    kinds = dict(
        zero=opts.zero, plain=plain_parameters(compiled),
        shard_axes=tuple(a for a in data if a not in opts.replicate_axes), replicate_axes=opts.replicate_axes,
        param_dtype=getattr(torch, opts.precision.param), reduce_dtype=reduce, offload=offload, prefetch=prefetch,
    )  # fmt: skip
    axes = {id(p): shard_axes(compiled, n) for n, p in par.named_model_parameters().items()}
    units = []
    for module in par.stage_modules:
        ignored = [p for p in module.parameters() if id(p) in left]
        own = regions_holding(module, {i for i, a in axes.items() if a != kinds["shard_axes"] and i not in left})
        for region in own:  # before their layers: a unit nested in another is not the outer one's
            region_axes = {axes[id(p)] for p in region.weights.parameters()}
            if len(region_axes) != 1:  # one FSDP2 unit shards over one set of axes
                raise ValueError(
                    f"ZeRO-2/3: a shard_map region reads weights sharded over different data axes "
                    f"({sorted(region_axes)}), which one FSDP2 unit cannot hold. Fix: use zero=0 or 1"
                )
            units += apply_fsdp(
                region, [], par.device_mesh, keep_gathered=compiled.pipelined,
                **(kinds | {"shard_axes": region_axes.pop(), "plain": False}),
            )  # fmt: skip
        units += apply_fsdp(
            module, par.blocks(module), par.device_mesh, ignored=ignored, keep_gathered=compiled.pipelined,
            **kinds,
        )  # fmt: skip
    whole = {n: p for n, p in par.named_model_parameters().items() if id(p) in left}
    sync = GradSync(whole, sync_groups(par, whole), reduce, order=list(compiled.traced.params)) if whole else None
    return units, sync


def regions_holding(module: nn.Module, ids: set[int]) -> list[nn.Module]:
    """Make the regions of per-shard code in `module`'s graphs hold the parameters in `ids` they read
    (`RegionModule.hold`); returns those regions. Each such parameter must be read by one region alone:
    its ZeRO-2/3 unit is that region (an expert weight: FSDP2 shards it over the data axes besides ep,
    its layer's other weights over all of them). Raises naming any other use."""
    from ...compiler.attrs import resolve
    from ...modules.special import RegionModule

    out, found = [], set()
    for gm in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(gm.graph.nodes):
            region = resolve(gm, node.target) if node.op == "call_module" else None
            if not isinstance(region, RegionModule):
                continue
            given = 0  # the position among the arguments the graph gives
            for arg in list(node.args):
                read = _param_read(gm, arg, ids)
                if read is None:
                    given += 1
                    continue
                attr, local = read
                param = resolve(gm, attr.target)
                region.hold(given, attr.target, param, *(() if local is None else (local.args[1:], local.kwargs)))
                node.args = tuple(a for a in node.args if a is not arg)
                for dead in (local, attr):
                    if dead is not None and not dead.users:
                        gm.graph.erase_node(dead)
                *parent, last = attr.target.split(".")
                delattr(resolve(gm, ".".join(parent)) if parent else gm, last)
                found.add(id(param))
                if region not in out:
                    out.append(region)
            gm.recompile()
    missing = [n for n, p in module.named_parameters() if id(p) in ids and id(p) not in found]
    if missing:
        raise ValueError(
            f"ZeRO-2/3: {', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} sharded over fewer data "
            "axes than the rest of the model (split over ep) but not read by a shard_map region alone, so FSDP2 "
            "has no unit to gather it in. Fix: read it only inside the region (expert weights), or use zero=0 or 1"
        )
    return out


def _param_read(gm: fx.GraphModule, arg, ids: set[int]):
    """`(get_attr, to_local or None)` when `arg` is a parameter in `ids` read by nothing else."""
    from ...compiler.attrs import has_attr, resolve

    if not isinstance(arg, fx.Node):
        return None
    local = arg if arg.op == "call_method" and arg.target == "to_local" else None
    attr = local.args[0] if local is not None else arg
    if not isinstance(attr, fx.Node) or attr.op != "get_attr" or not has_attr(gm, attr.target):
        return None
    if id(resolve(gm, attr.target)) not in ids or len(arg.users) != 1 or len(attr.users) != 1:
        return None
    return attr, local


def left_whole(par) -> set[int]:
    """The ids of the parameters FSDP2 leaves whole (the compiler's `fsdp_whole`: a fused projection's
    bias split in groups over tp, and those two pipeline stages share)."""
    whole = fsdp_whole(par.compiled)
    return {id(p) for n, p in par.named_model_parameters().items() if n in whole}


def plain_parameters(compiled) -> bool:
    """ZeRO-2/3 on a mesh of one data axis: the parameters are plain tensors (FSDP2 alone makes them
    DTensors, as `fully_shard` by hand does), and the compiled graph reads them as they are. Not when
    that axis splits a parameter (an expert weight on `ep`): that one is a DTensor of its own layout."""
    return (
        compiled.options.zero >= 2 and len(compiled.mesh.axis_names) == 1 and bool(compiled.data_axes)
        and not fsdp_whole(compiled)
    )  # fmt: skip


def apply_fsdp(
    top: nn.Module,
    layers: list[nn.Module],
    device_mesh,
    *,
    zero: int,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    plain: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    offload: bool = False,
    prefetch: bool = True,
    ignored: list[nn.Parameter] = (),
    keep_gathered: bool = False,
    counter: CommCounter = COUNTER,
) -> list[nn.Module]:
    """Shard `layers` and then `top` (the root); returns the FSDP units, layers first. `plain`: the
    parameters are plain tensors and the mesh is the data axis alone. `ignored` stay whole.
    `keep_gathered`: ZeRO-3 keeps what it gathered until backward ends (pipeline stages, see
    `compiler.pipeline.GATHERED`)."""
    if DataParallelMeshDims is None and not plain:
        raise RuntimeError("ZeRO-2/3 on a model that is also tensor-parallel needs torch>=2.13 (DataParallelMeshDims)")
    dims = None if plain else DataParallelMeshDims(
        shard=shard_axes[0] if len(shard_axes) == 1 else shard_axes,
        replicate=(replicate_axes[0] if len(replicate_axes) == 1 else replicate_axes) if replicate_axes else None,
    )  # fmt: skip
    strided = any(_shard_placement(p) is not None for p in top.parameters())
    if strided and replicate_axes:
        raise ValueError(
            "HSDP (replicate_axes) with a fused projection split in groups over tp is not supported by FSDP2 "
            "(per-parameter shard placements need a pure sharding mesh). Fix: drop replicate_axes, or unfuse"
        )
    kwargs = dict(
        ignored_params=set(unshardable(top)) | set(ignored) or None,
        shard_placement_fn=_shard_placement if strided else None,
        mesh=device_mesh,
        reshard_after_forward=zero == 3 and not keep_gathered,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy(),
        **({} if plain else {"dp_mesh_dims": dims}),
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
        if p.dim() == 1 and any(isinstance(q, StridedShard) for q in getattr(p, "placements", ())):
            out.append(p)
    return out


def _shard_placement(param: torch.Tensor):
    """FSDP splits dim 0 unless a tensor-parallel placement already splits it in groups (a fused
    projection's strided shard): DTensor cannot nest FSDP's shard inside that, so take dim 1."""
    placements = getattr(param, "placements", ())
    if any(isinstance(p, StridedShard) and p.dim == 0 for p in placements) and param.dim() > 1:
        return Shard(1)
    return None


def set_sync(units: list[nn.Module], enabled: bool) -> None:
    """Gradient accumulation: no reduce-scatter until the last microbatch."""
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


__all__ = ["apply_fsdp", "apply_zero", "left_whole", "plain_parameters", "regions_holding", "set_sync", "unshardable"]
