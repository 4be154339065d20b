"""The orchestrator: a model and a mesh in, a `Parallel` out, in this order.

1. compile (`compiler.compile_model`): trace, split stages (pp), place every value (tp, sp),
   insert the collectives: the whole plan, with no process yet, so every error is raised on
   every rank before any collective;
2. lower (`lower.py`): this rank's shards of the model's own weights (or of `init=`'s), the
   buffers, and the modules it runs (a stand-in for each collective);
3. precision (`precision.py`): bf16/fp16 parameters, full-precision values kept for masters;
4. tensor (`parallelisms/tensor.py`): the collectives and rank-dependent ops bound to the device
   mesh's process groups;
5. recompute (`recompute.py`): activation checkpointing of each block;
6. data and ZeRO (`parallelisms/data.py`, `parallelisms/zero.py`): the gradient sum over the
   data axes, FSDP2 for ZeRO-2/3;
7. schedule (`parallelisms/pipeline.py`): the stages under torch's pipeline schedule.
"""

from __future__ import annotations

import torch

from meshlib import Mesh
from meshlib.options import Parallelism, Pipelining, Running, gather

from ..compiler.compile import compile_model
from ..compiler.pipeline.compile import torch_refuses
from . import dist as mdist
from . import weights as weights_mod
from .lower import lower
from .parallel import Parallel
from .parallelisms.data import apply_data
from .parallelisms.expert import apply_expert
from .parallelisms.pipeline import apply_pipeline
from .parallelisms.tensor import apply_tensor
from .parallelisms.zero import apply_zero
from .precision import apply_precision
from .recompute import apply_recompute


def parallelize(
    model: torch.nn.Module, /, *, mesh: Mesh, rules, example_inputs: tuple | dict = (), example_kwargs=None,
    loss=None, compiled=None, parallelism: Parallelism | None = None, pipelining: Pipelining | None = None,
    running: Running | None = None, **options,
) -> Parallel:  # fmt: skip
    """Compile `model` for `mesh` and build this rank's part of it (call on every rank, under torchrun).

    The model is called as `model(*example_inputs, **example_kwargs)` on the global batch (see
    `compile_model`, which also says how `loss=` picks the loss); the result trains with
    `train_step(batch, opt)` on any mesh. The options are `Parallelism`'s, `Pipelining`'s and
    `Running`'s (`meshlib.options`), as keywords or as the values. Weights: a model with
    real parameters trains from them; each rank keeps its shard, the model's whole copy of each
    parameter is released as it is taken (the model is left on the meta device: a rank's peak
    while building is the model plus one parameter's shard), and every rank must be given the
    same weights, which is checked. A meta model takes `weights=` or `init=` (`Running`); either
    with real weights is an error. `compiled`: a program `compile_model` already made for it.
    """
    par, pipe, run = gather(options, parallelism, pipelining, running)
    weights_mod.check_source(model, run.init, run.weights)
    compiled = compiled or compile_model(
        model, mesh=mesh, rules=rules, example_inputs=example_inputs, example_kwargs=example_kwargs, loss=loss,
        parallelism=par, pipelining=pipe,
    )  # fmt: skip
    _check_runtime(compiled, run.offload)
    source = weights_mod.source(model, init=run.init, seed=run.seed, weights=run.weights, compiled=compiled)
    dm = mdist.start(compiled.mesh, timeout=run.timeout)
    torch.manual_seed(run.seed)  # ranks holding the same values draw the same dropout masks (as Megatron)
    par = Parallel(compiled, lower(compiled, dm, model, source), dm)
    par.fp32_init = apply_precision(par)
    apply_tensor(par)
    apply_recompute(par)
    par.target_counts, par.loss_sum, par.grad_sync = apply_data(par)
    par.fsdp_units, whole_sync = apply_zero(par, offload=run.offload, prefetch=run.prefetch)
    par.grad_sync = par.grad_sync or whole_sync  # ZeRO-0's, or the parameters FSDP2 leaves whole
    par.pipeline = apply_pipeline(par)
    par.routing = apply_expert(par)
    return par


def _check_runtime(compiled, offload: bool) -> None:
    """What the runtime cannot build, before any process group."""
    opts = compiled.options
    if opts.replicate_axes and opts.zero < 2:
        raise ValueError("replicate_axes (HSDP) needs zero=2 or 3, where FSDP2 shards over the other data axes")
    if offload and opts.zero < 2:
        raise ValueError("offload needs zero=2 or 3 (FSDP2's CPUOffloadPolicy)")
    if compiled.pipelined and (refused := torch_refuses(compiled.schedule, compiled.microbatches)) is not None:
        raise ValueError(refused)


__all__ = ["parallelize"]
