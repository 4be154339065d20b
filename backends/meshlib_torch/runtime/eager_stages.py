"""Running the stages of an untraceable model, cut by module FQN (`compiler.fqn_split`).

Each pp rank fills only its stages' meta copies of the model: every parameter
they hold is the model's own value, or is drawn by `init_full` under its
canonical FQN (the values the single-process reference draws), one
`nn.Parameter` per name however many local stages hold it, and the buffers
are the model's own. The model's whole copies are released once taken. The stages run
under torch's pipelining with the same schedules as the traced path
(`make_schedule`) and train with the same `Pipelined`: the loss comes from the
last stage, gradients are summed over the data-parallel ranks by `GradSync`,
and a parameter on stages of different pp ranks (tied embeddings) has its
gradient summed between them.

Data parallelism mirrors the traced path's cross-entropy, whose loss is a
partial sum over the data axes: the last stage averages its loss over the
data-parallel ranks in forward, and its backward gives each rank its share,
so the summed gradients are those of the global mean. That equals the
single-process loss when every rank's microbatch counts the same number of
targets (the eager model's own loss cannot be told about the other ranks').
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..compiler.fqn_split import EagerStages
from ..compiler.trace import _set_attr
from . import dist as mdist
from . import weights
from .comm import COUNTER
from .parallel import Parallel, _cast_params, _dtype, real_buffers
from .pipeline import Pipelined, count_sends, data_grad_sync, make_schedule, tied_groups


class _MeanOver(torch.autograd.Function):
    """The mean of each rank's loss over a group; backward hands each rank its 1/n share."""

    @staticmethod
    def forward(ctx, loss, group, n: int, axis: str):
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        COUNTER.record("forward", "all_reduce", axis, total.numel() * total.element_size(), "loss mean")
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n, None, None, None


def build_eager(model: nn.Module, compiled, stages: EagerStages, core, *, init, seed: int, microbatches: int,
                pp_axis: str, timeout: float | None) -> Pipelined:  # fmt: skip
    """This rank's stages of `stages` with their parameters, as a `Pipelined` (call on every rank)."""
    mesh = compiled.mesh
    dm = mdist.device_mesh(mesh, timeout=timeout)
    pp_rank = mesh.coords(dist.get_rank())[pp_axis]
    n = len(stages.modules)
    local = [s for s in range(n) if core.placement[s] == pp_rank]
    device = torch.device("cuda", torch.cuda.current_device()) if mdist.device_type() == "cuda" else torch.device("cpu")
    compute = _dtype(compiled.options.precision.param)
    root = _materialize(model, compiled, set().union(*(stages.params[s] for s in local)), init, seed, device)
    par = Parallel(compiled, root, dm)
    par.microbatches = microbatches
    if compute in (torch.bfloat16, torch.float16):
        par.fp32_init = _cast_params(root, compute)
    real_buffers(model, compiled)  # meta buffers made real (`init_buffers`), as the traced path does
    buffers = dict(model.named_buffers(remove_duplicate=False))
    params = dict(root.named_parameters())
    modules = [_fill(stages.modules[s], params, buffers, compiled.traced.aliases, device, compute) for s in local]
    data = compiled.data_axes
    if data and n - 1 in local:
        size = math.prod(mesh.axis_size(a) for a in data)
        group, axis = mdist.group(dm, data), "_".join(data)
        modules[local.index(n - 1)]._meshlib_cut.finish = lambda loss: _MeanOver.apply(loss, group, size, axis)
    data_grad_sync(par, dm)
    pp_group = mdist.group(dm, pp_axis)
    piped = [
        PipelineStage(mod, s, n, device, input_args=_zeros(stages.inputs[s], device, grad=s > 0),
                      output_args=_zeros(stages.outputs[s], device, grad=s < n - 1), group=pp_group)
        for s, mod in zip(local, modules, strict=True)
    ]  # fmt: skip
    count_sends(piped, pp_axis)
    sched = make_schedule(piped, core, microbatches, scale_grads=False)  # a tied parameter on two local stages
    pipe = Pipelined(par, stages, local, modules, sched, core, pp_group, microbatches)
    pipe.grad_divisor = microbatches
    pipe.tied_groups = tied_groups(stages, core, compiled, pp_axis)
    return pipe


def _materialize(model: nn.Module, compiled, names: set[str], init, seed: int, device) -> nn.Module:
    """A module holding the named parameters by canonical FQN: the model's values (whose whole copies
    are then released, and compared across ranks) or the reference's drawn ones."""
    root = nn.Module()
    holders = weights.Holders(model) if init is None else None
    sums = {}
    for name, p in list(compiled.traced.params.items()):
        if init is None:
            sums[name] = weights.checksum(p)
        if name in names:
            value = weights.full_value(name, p, init=init, seed=seed).to(device)
            _set_attr(root, name, nn.Parameter(value, requires_grad=p.requires_grad))
        if holders is not None:
            compiled.traced.params[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            holders.release(p)
    weights.agree(sums, device)
    return root


def _fill(stage: nn.Module, params: dict, buffers: dict, aliases: dict, device, compute) -> nn.Module:
    """Put the real parameters (by canonical FQN) and buffers into a stage's meta copy of the model."""
    for prefix, mod in stage.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None:
                path = f"{prefix}.{name}" if prefix else name
                mod._parameters[name] = params[aliases.get(path, path)]
        for name, b in list(mod._buffers.items()):
            path = f"{prefix}.{name}" if prefix else name
            if b is not None and path in buffers:
                real = buffers[path]
                mod._buffers[name] = real.to(device, dtype=compute if real.is_floating_point() else real.dtype)
    return stage


def _zeros(metas: tuple, device, *, grad: bool) -> tuple:
    """Tensors shaped like one microbatch's `metas` on `device`; the hidden state (first) needs grad."""
    out = []
    for i, t in enumerate(metas):
        wants = grad and i == 0 and t.is_floating_point() and t.dim() > 0
        out.append(torch.zeros(t.shape, dtype=t.dtype, device=device, requires_grad=wants))
    return tuple(out)
