"""The orchestrator: a model and a mesh in, a `Parallel` out, in this order.

1. compile (`compiler.compile_model`): trace, split stages (pp), place every value (tp, sp),
   insert the collectives: the whole plan, with no process yet, so every error is raised on
   every rank before any collective;
2. lower (`lower.py`): this rank's shards of the model's own weights (or of `init=`'s), the
   buffers and the collectives bound to the device mesh's process groups;
3. precision (`precision.py`): bf16/fp16 parameters, full-precision values kept for masters;
4. recompute (`recompute.py`): activation checkpointing of each block;
5. data and ZeRO (`parallelisms/data.py`, `parallelisms/zero.py`): the gradient sum over the
   data axes, FSDP2 for ZeRO-2/3;
6. schedule (`parallelisms/pipeline.py`): the stages under torch's pipeline schedule.
"""

from __future__ import annotations

import torch

from meshlib import Mesh, Precision

from ..compiler.compile import compile_model
from . import dist as mdist
from . import weights as weights_mod
from .lower import lower
from .parallel import Parallel
from .parallelisms.data import apply_data
from .parallelisms.pipeline import apply_pipeline
from .parallelisms.zero import apply_zero
from .precision import apply_precision
from .recompute import apply_recompute


def parallelize(
    model: torch.nn.Module, /, *, mesh: Mesh, rules, example_inputs: tuple | dict = (), example_kwargs=None,
    loss=None, weights=None, init=None, seed: int = 0, sequence_parallel: bool = False, in_specs=None,
    zero: int | str = 0, precision: Precision | str | None = None, recompute: str = "none",
    replicate_axes: tuple[str, ...] = (), offload: bool = False, prefetch: bool = True, microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int | None = None, pp_axis: str = "pp", split_points: list[int] | None = None, balance: str = "flops",
    timeout: float | None = None, allow_data_gather: bool = False, idle_axes: tuple[str, ...] = (),
    uneven: str = "error", compiled=None,
) -> Parallel:  # fmt: skip
    """Compile `model` for `mesh` and build this rank's part of it (call on every rank, under torchrun).

    The model is called as `model(*example_inputs, **example_kwargs)` on the global batch (see
    `compile_model`, which also says how `loss=` picks the loss and what the other options do);
    the result trains with `train_step(batch, opt)` on any mesh. Weights: a model with real
    parameters trains from them; each rank keeps its shard, the model's whole copy of each
    parameter is released as it is taken (the model is left on the meta device: a rank's peak
    while building is the model plus one parameter's shard), and every rank must be given the
    same weights, which is checked. A meta model takes `weights=` (a safetensors file, a directory
    saved by `save_pretrained`, or a DCP checkpoint: each rank reads only its shards) or `init=`
    (name -> ("normal", std) | ("zeros", 0) | ("ones", 0)), whose values are the single process's
    with `seed`; either with real weights is an error. `seed` also seeds torch's generator alike on every rank
    (dropout draws the same masks on replicas). `offload` keeps FSDP2's shards on the CPU,
    `timeout` (seconds) bounds every collective and send/receive of this model's groups.
    """
    weights_mod.check_source(model, init, weights)
    compiled = compiled or compile_model(
        model, mesh=mesh, rules=rules, example_inputs=example_inputs, example_kwargs=example_kwargs, loss=loss,
        in_specs=in_specs, sequence_parallel=sequence_parallel, zero=zero, precision=precision,
        recompute=recompute, replicate_axes=replicate_axes, microbatches=microbatches, schedule=schedule,
        chunks=chunks, pp_axis=pp_axis, split_points=split_points, balance=balance,
        allow_data_gather=allow_data_gather, idle_axes=idle_axes, uneven=uneven,
    )  # fmt: skip
    _check_runtime(compiled, offload)
    source = weights_mod.source(model, init=init, seed=seed, weights=weights, compiled=compiled)
    dm = mdist.start(compiled.mesh, timeout=timeout)
    torch.manual_seed(seed)  # ranks holding the same values draw the same dropout masks (as Megatron)
    par = Parallel(compiled, lower(compiled, dm, model, source), dm)
    apply_precision(par)
    apply_recompute(par)
    apply_data(par)
    apply_zero(par, offload=offload, prefetch=prefetch)
    apply_pipeline(par)
    return par


def _check_runtime(compiled, offload: bool) -> None:
    """What the runtime cannot build, before any process group."""
    opts = compiled.options
    if opts.replicate_axes and opts.zero < 2:
        raise ValueError("replicate_axes (HSDP) needs zero=2 or 3, where FSDP2 shards over the other data axes")
    if offload and opts.zero < 2:
        raise ValueError("offload needs zero=2 or 3 (FSDP2's CPUOffloadPolicy)")


__all__ = ["parallelize"]
