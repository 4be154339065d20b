"""The private parts of torch that meshlib uses, in one place, each with why.

torch has no public API for any of these. A torch release that moves one
breaks this module, and only this module: everything else imports from here.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as c10d
import torch.fx as fx
import torch.utils._pytree as pytree  # noqa: F401  (re-exported: leaf flattening of (args, kwargs))
from torch._ops import HigherOrderOperator, OpOverload  # noqa: F401  (re-exported: telling op kinds apart)

# A fake tensor has a shape, a dtype and a device but no data: tracing-time values of real models.
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

# DTensor's placement for a dim split in groups first (a fused qkv projection's whole heads, a
# ZeRO-1 master inside a tensor-parallel shard): the public `Shard` cannot say it.
from torch.distributed.tensor._utils import _get_shard_size_and_offsets as shard_size_and_offsets  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (the peak tracker sees every op)

# FSDP2's hooks for custom collectives (meshlib counts the bytes each moves); public since 2.9 in name only.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch
    AllGather = ReduceScatter = object

# The zero-bubble schedules' split backward, as torch's pipeline runs it: the dry run measures what a
# stage holds between its input-gradient (I) and weight-gradient (W) actions by running the same code.
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: F401


def pipeline_keeps_grad_buffers() -> bool:
    """Whether torch's pipeline stages allocate, when the schedule is set up, a buffer per microbatch for
    each output's gradient they receive, and keep them for the run (torch 2.13 does; later releases
    allocate each when its receive is posted and free it after, which `_RecvInfo.allocate_buffer` marks).
    The dry run's peak counts them where they are kept."""
    from torch.distributed.pipelining import stage

    return not hasattr(stage._RecvInfo, "allocate_buffer")


# torch.fx keeps a concrete (fixed) argument as a placeholder guarded by these asserts.
FX_ASSERTS = {torch._assert, fx._symbolic_trace._assert_is_none}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (its storage, written in place by collectives and optimizers; not
    `to_local()`'s differentiable view), or `t` when it is a plain tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def own_parameters(module: torch.nn.Module) -> dict:
    """The dict an `nn.Module` keeps its own parameters in: replacing an entry swaps a parameter in place,
    without `__setattr__`'s checks, so that a parameter two modules share stays shared."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict:
    """The dict an `nn.Module` keeps its own buffers in (see `own_parameters`)."""
    return module._buffers


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor `t` is a view of, or `t` itself: what owns its storage."""
    return t._base if t._base is not None else t


def storage_key(t: torch.Tensor) -> int:
    """An identity of `t`'s storage that views share and that holds on the meta device too (no data pointer)."""
    return t.untyped_storage()._cdata


def sac_saves_bypass_hooks(forward_context) -> None:
    """Tell torch's selective checkpointing that the tensors it saves bypass saved-tensor hooks around it,
    its behaviour before torch 2.15 asked (and warned): set on SAC's forward context, which `checkpoint`
    sets only when handed that context itself, not one that wraps it with others."""
    if hasattr(forward_context, "respect_saved_tensors_hooks"):
        forward_context.respect_saved_tensors_hooks = False


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (shapes, dtype and device; no data), as the compiler's tracing passes run on."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def version(t: torch.Tensor) -> int:
    """A tensor's version counter: bumped by every in-place write to it (or to a view of it)."""
    return t._version


def in_backward() -> bool:
    """True while autograd runs a backward pass (FSDP2's gathers are counted by phase)."""
    return torch._C._current_graph_task_id() != -1


def backward_id() -> int:
    """The running backward's graph task id (-1 outside backward): which backward a hook fires in."""
    return torch._C._current_graph_task_id()


def at_backward_end(fn) -> None:
    """Run `fn` once the running backward has finished (called during it): where DDP and FSDP2 wait for
    their last gradient reductions (`Variable._execution_engine.queue_callback`; torch has no public way)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def copy_codegen(src: fx.Graph, dst: fx.Graph) -> None:
    """Give `dst` the code generator of `src` (a graph copy keeps its calling convention)."""
    dst._codegen = src._codegen


def flatten_mesh(dm, axes: tuple[str, ...], backend_override):
    """The sub-mesh of several axes flattened into one (`DeviceMesh._flatten`: no public way to make a
    process group over several axes of a mesh with its own timeout)."""
    return dm[axes]._flatten("_".join(axes), backend_override=backend_override)


def forget_mesh_specs() -> None:
    """Clear DTensor's cache of sharding propagations. Its keys compare DeviceMeshes by value, so once a second
    mesh equal to an earlier one exists (the same axes, groups with another timeout) it hands back output specs
    on the earlier mesh object, and FSDP2 refuses such parameters ("different mesh objects"). No public API
    clears it; it refills as ops run."""
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    cache = getattr(propagator, "propagate_op_sharding", None)
    if hasattr(cache, "cache_clear"):
        cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's copy
    if native is not None:
        native()


def world_timeout(device_type: str) -> timedelta:
    """The timeout the world group was created with."""
    return c10d.group.WORLD._get_backend(torch.device(device_type)).options._timeout


def group_options(backend: str, limit: timedelta):
    """Options that make a new NCCL or gloo group with timeout `limit` (gloo's options class is private)."""
    options = c10d.ProcessGroupNCCL.Options() if backend == "nccl" else c10d.ProcessGroupGloo._Options()
    options._timeout = limit
    return options


def runtime_schedule(stages: list, microbatches: int, actions: dict, **kwargs):
    """torch's pipeline schedule runtime on our own per-rank action lists (ZB-H1 has no torch class):
    it adds the sends and receives itself."""
    from torch.distributed.pipelining import schedules

    sched = schedules._PipelineScheduleRuntime(stages, microbatches, **kwargs)
    rows = {
        r: [schedules._Action(a.stage, schedules._ComputationType(a.kind), a.microbatch) for a in row]
        for r, row in actions.items()
    }
    sched._prepare_schedule_with_comms(rows)
    return sched


# One matmul per group of rows, each group with its own weight (mixture-of-experts' grouped GEMM) in one kernel,
# differentiable. torch has it only as the private `torch._grouped_mm` (absent in older releases). Its CPU kernel in
# torch 2.13 takes float32, bfloat16 and float16 (not float64), int32 offsets (the groups' cumulative row counts,
# any values), and matrices whose last two dims have one unit stride and the other a multiple of 16 bytes;
# its meta kernel takes bfloat16 only. `experts.grouped` checks these before it calls it.
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def has_grouped_mm() -> bool:
    return _GROUPED_MM is not None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`a` (rows, k) times `b[g]` (k, n) for each group `g` of rows: `offs[g]` is where group g ends."""
    return _GROUPED_MM(a, b, offs=offs)


# CPU's fused attention kernel and its backward, called directly: the public scaled_dot_product_attention
# neither returns the log-sum-exp that merging blocks of keys needs (ring attention) nor takes the whole row's
# back for backward. Query head h reads key/value head h // (Hq/Hkv); `is_causal` hides key j from query i
# when j > i (top-left aligned). Both have meta kernels (the dry run). CUDA's kernels take another
# signature (a padded log-sum-exp, no float32 flash): not wired, so CUDA runs the eager tiles.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def has_flash_attention(device: torch.device) -> bool:
    return device.type in ("cpu", "meta")


def flash_attention(q, k, v, causal: bool, scale: float) -> tuple:
    """(out (B, Hq, L, D), lse (B, Hq, L)) of q (B, Hq, L, D) over k, v (B, Hkv, S, D)."""
    return _FLASH(q, k, v, 0.0, causal, scale=scale)


def flash_attention_grads(grad_out, q, k, v, out, lse, causal: bool, scale: float) -> tuple:
    """(dq, dk, dv), the probabilities taken as exp(scores - lse) and the softmax's shift as
    rowsum(grad_out * out): `out` and `lse` may be the whole row's, of which these keys are a part."""
    return _FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


def make_wrapper_subclass(cls, shape, *, dtype, device):
    """A tensor subclass instance with no storage of its own (DCP reads the pieces it describes)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


__all__ = [
    "AllGather", "FX_ASSERTS", "FakeTensorMode", "HigherOrderOperator", "OpOverload", "ReduceScatter",
    "StridedShard", "TorchDispatchMode", "copy_codegen", "flash_attention", "flash_attention_grads", "flatten_mesh",
    "group_options", "grouped_mm", "has_flash_attention", "has_grouped_mm", "in_backward", "is_fake",
    "local_tensor", "make_wrapper_subclass", "own_buffers", "own_parameters", "pipeline_keeps_grad_buffers",
    "pytree", "runtime_schedule", "sac_saves_bypass_hooks", "shard_size_and_offsets", "storage_key", "version",
    "view_base",
    "world_timeout",
]  # fmt: skip


def default_store():
    """The world group's key-value store (torchrun's rendezvous store), or None: the exit handshake
    (`runtime.dist`) meets there, outside gloo, whose last collective must not race a peer's teardown."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None
