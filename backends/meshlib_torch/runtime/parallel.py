"""`Parallel`: a compiled program running on a DeviceMesh, whatever the mesh (one type, one training loop).

Every rank calls it on the global batch (the same on every rank): a tuple of
positional inputs or a dict of keyword inputs, as the model is called. It takes
its part (`local_inputs`), runs it through its modules (the graph, or with a
pipeline its stages under the schedule) one microbatch after another, and sums
gradients over the data-parallel axes once per step.

    loss = par.train_step(batch, opt)     # forward, backward and one update: the step's mean loss
    loss = par.evaluate(batch)            # forward only
    loss = par(*args, **kwargs)           # without a pipeline: the loss, to call backward on yourself
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..compiler.capture.call import batch_call
from ..compiler.placement import placements as pl
from ..compiler.program import shard_axes
from ..compiler.zero1_buckets import DataGroup
from ..torch_private import local_tensor
from . import dist as mdist
from .comm import local_slice
from .dtensor import gather_whole
from .optim import LossScaler, MeshOptimizer
from .parallelisms.zero import set_sync


class Parallel(nn.Module):
    """A compiled program on a DeviceMesh; see the module docstring. Built by `parallelize`."""

    def __init__(self, compiled, lowered, device_mesh):
        super().__init__()
        self.compiled, self.device_mesh, self.device = compiled, device_mesh, lowered.device
        self.root = lowered.root
        self.stage_modules = nn.ModuleList(lowered.modules)
        self.local_stages = lowered.local_stages
        self._coords = compiled.mesh.coords(dist.get_rank())
        self.pipeline = None  # a `PipelineRun`, with a pipeline axis
        self.grad_sync = None  # a `GradSync` over what the data axes sum
        self._sync = True  # `set_gradient_sync`'s
        self._zero1 = weakref.WeakSet()  # the `Zero1Sync`s of this model's optimizers (their reduce-scatters)
        self.loss_sum = None  # a `LossSum`: the loss's sum over a data axis, run beside backward
        self.target_counts = []  # `TargetCounts`: losses that count their targets from the whole batch
        self.fsdp_units: list[nn.Module] = []
        self.fp32_init: dict[str, torch.Tensor] = {}  # full-precision values of bf16/fp16 parameters (masters)
        self.track_grad_norm = False  # note `last_grad_norm` before every update (one more collective)
        self.last_grad_norm: float | None = None
        self.routing = None  # `Routing`: the routers' token counts, and balancing biases that follow them

    # -- what it holds ------------------------------------------------------------------------------
    @property
    def plan(self):
        return self.compiled.plan

    @property
    def zero(self) -> int:
        return self.compiled.options.zero

    @property
    def gm(self) -> nn.Module:
        """The graph module (without a pipeline), split into `pre`, `layer_<i>`, `post` for FSDP2 or recompute."""
        return self.stage_modules[0]

    def blocks(self, module: nn.Module | None = None) -> list[nn.Module]:
        """The layers `module` (the graph, or a stage) runs, in order, when it is cut into layers."""
        module = self.gm if module is None else module
        found = {int(n.removeprefix("layer_")): m for n, m in module.named_children() if n.startswith("layer_")}
        return [found[i] for i in sorted(found)]

    def canonical(self, by_path: dict) -> dict:
        """Re-key a dict by path under the root (`layer_0.layers.0.w`) by the model's FQN (`layers.0.w`)."""
        names = set(self.compiled.traced.params)
        return {_canonical(path, names): v for path, v in by_path.items()}

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their FQN in the original model (whatever wraps them here). Most are
        DTensors in their layout; one split in unequal parts over an axis (a fused qkv under grouped-query
        attention) holds its rows in rank order, which DTensor can describe (see `runtime.dtensor`): read
        it whole with `whole`, not `full_tensor()`."""
        return self.canonical(dict(self.root.named_parameters()))

    def named_model_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers by their FQN in the original model (those of its stages, with a pipeline)."""
        names = set(self.compiled.buffers)
        return {_canonical(path, names): b for path, b in self.root.named_buffers()}

    def whole(self, name: str, t: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter `name` whole, in the model's order, on every rank that holds a part of it (a
        collective over those ranks); or `t`, a tensor laid out as that parameter (its gradient, fp32
        master, optimizer state)."""
        t = self.named_model_parameters()[name] if t is None else t
        return gather_whole(t, self.compiled.param_rank_order(name))

    # -- inputs ---------------------------------------------------------------------------------------
    def shard_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a global input."""
        layout = self.compiled.input_layouts[name]
        for axis, p, n in zip(self.compiled.axes.names, layout, self.compiled.axes.sizes):
            if isinstance(p, pl.Shard):
                x = local_slice(x, p, self._coords[axis], n)
        return x

    def local_inputs(self, args: tuple = (), kwargs: dict | None = None) -> list[torch.Tensor]:
        """This rank's parts of a global batch's tensors, in graph-input order (the call is checked first)."""
        call = self.compiled.traced.call
        tensors = call.bind(args, kwargs)
        for counts in self.target_counts:  # every rank holds the whole batch: count the targets here
            counts.set(dict(zip(call.tensors, tensors)))
        m = self.compiled.microbatches
        for (name, want), x in zip(call.tensors.items(), tensors):
            want = (want.shape[0] * m, *want.shape[1:]) if want.dim() else ()
            if tuple(x.shape) != tuple(want):
                raise ValueError(
                    f"input {name!r} has shape {tuple(x.shape)} but the model was compiled for {tuple(want)}. "
                    "Fix: recompile with example inputs of this shape"
                )
        return [self.shard_input(n, x) for n, x in zip(call.tensors, tensors)]

    # -- running -------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The loss of the global batch (no pipeline): the mean over its microbatches."""
        if self.pipeline is not None:
            raise TypeError(
                "a pipelined model runs its stages under a schedule on every pp rank together: use "
                "train_step(batch, opt) or evaluate(batch), not a forward call"
            )
        chunks = _microbatches(self.local_inputs(args, kwargs), self.compiled.microbatches)
        loss = sum(self._loss(c) for c in chunks) / len(chunks)
        return self.loss_sum(loss) if self.loss_sum is not None else loss

    def _loss(self, local: list[torch.Tensor]) -> torch.Tensor:
        out = self.gm(*local)
        if isinstance(out, (tuple, list)) and len(out) == 1:  # split_module's graph returns a 1-tuple
            out = out[0]
        dtype = getattr(torch, self.compiled.plan.precision.output)
        return out.to(dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    def train_step(self, batch, opt: MeshOptimizer, *, max_norm: float | None = None) -> float:
        """Forward and backward over the global `batch`'s microbatches, then one update; the mean loss.

        The gradients of all microbatches are summed before they are summed over the data-parallel
        axes (once), and each microbatch counts 1/m, so the step equals one over the whole batch.
        `max_norm`: clip the gradients to that global norm first (`clip_grad_norm_`); the norm before
        clipping is `last_grad_norm`."""
        check_max_norm(max_norm)
        local = self.local_inputs(*batch_call(batch))
        if self.pipeline is not None:
            self.set_gradient_sync(False)
            loss = self.pipeline.run(local, train=True)
            self.pipeline.finish_gradients(self.named_model_parameters())
            self.set_gradient_sync(True)
            if self.grad_sync is not None:
                self.grad_sync.flush()
        else:
            loss = self._accumulate(local, opt)
        if max_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(max_norm, scale=opt.scaler.scale if opt.scaler else 1.0, opt=opt)
        elif self.track_grad_norm:
            self.last_grad_norm = self.grad_norm(opt) / (opt.scaler.scale if opt.scaler else 1.0)
        opt.step()
        opt.zero_grad()
        if self.routing is not None:  # router statistics, and DeepSeek-V3's balancing bias from them
            self.routing.step()
        return loss

    def _accumulate(self, local: list[torch.Tensor], opt) -> float:
        chunks = _microbatches(local, self.compiled.microbatches)
        sums = []
        for i, chunk in enumerate(chunks):
            self.set_gradient_sync(i == len(chunks) - 1)
            loss = self._loss(chunk) / len(chunks)
            sums.append(self.loss_sum.start(loss) if self.loss_sum is not None else (loss.detach(), None))
            (opt.scaler.scale_loss(loss) if opt.scaler else loss).backward()
        return sum(_waited(value, work) for value, work in sums)

    @torch.no_grad()
    def evaluate(self, batch) -> float:
        """The global batch's mean loss, forward only (every rank gets it)."""
        local = self.local_inputs(*batch_call(batch))
        if self.pipeline is not None:
            return self.pipeline.run(local, train=False)
        chunks = _microbatches(local, self.compiled.microbatches)
        total = sum(self._loss(c) for c in chunks) / len(chunks)
        return float(self.loss_sum(total) if self.loss_sum is not None else total)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradient accumulation: sum gradients over the data-parallel axes only when enabled (in the backward
        that sums: ZeRO-0's all-reduces, ZeRO-1's reduce-scatters, ZeRO-2/3's; ZeRO-1 reduce-scatters in the
        optimizer step where no backward did)."""
        self._sync = enabled
        for buckets in self._zero1:
            buckets.enabled = enabled
        if self.grad_sync is not None:
            self.grad_sync.enabled = enabled
        if self.fsdp_units:
            set_sync(self.fsdp_units, enabled)

    # -- the update ----------------------------------------------------------------------------------
    def optimizer(self, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, /, **options) -> MeshOptimizer:
        """`optimizer` (any torch.optim class, AdamW by default) with `options` (its arguments: `lr=...`),
        over this rank's parameters, for the zero level and precision: fp32 masters for bf16/fp16
        parameters, and under ZeRO-1 its state sharded over the data axes."""
        c = self.compiled
        params = self.named_model_parameters()
        opt = MeshOptimizer(
            params, optimizer, zero=self.zero, master=bool(self.fp32_init), groups=self.data_groups(params),
            layouts=c.param_layouts, mesh_axes=c.axes, fp32_init=self.fp32_init,
            reduce_dtype=getattr(torch, c.options.precision.reduce), order=list(c.traced.params), **options,
        )  # fmt: skip
        self.fp32_init = {}  # the optimizer owns the masters now
        if opt.buckets is not None:
            opt.buckets.enabled = self._sync
            self._zero1.add(opt.buckets)
        if c.plan.precision.param == "float16":
            opt.scaler = LossScaler()
        return opt

    def data_groups(self, params) -> dict[str, DataGroup | None]:
        """Per parameter, the data-parallel ranks its gradient is summed over and ZeRO shards its state over
        (`shard_axes`: every data axis, but `ep` for an expert weight), as a `DataGroup`; None: none."""
        c, rank, made = self.compiled, dist.get_rank(), {}
        out = {}
        for name in params:
            axes = shard_axes(c, name)
            if axes and axes not in made:
                size = math.prod(c.mesh.axis_size(a) for a in axes)
                made[axes] = DataGroup(mdist.group(self.device_mesh, axes), axes, c.mesh.axis_coord(rank, axes), size)
            out[name] = made.get(axes)
        return out

    def grad_norm(self, opt: MeshOptimizer | None = None) -> float:
        """The global gradient norm, of the whole model's gradients summed over every data axis: the
        gradients `opt` will apply (`MeshOptimizer.reduce_gradients`: under ZeRO-1 its reduce-scattered
        pieces, which this sums first), or without `opt` each parameter's `.grad` (ZeRO-1's are Partial over
        the data axes, and are all-reduced here one by one). Each rank adds the squares of the values it
        holds, each value counted once over the ranks that hold copies of it, and one all-reduce of that
        scalar sums them over the mesh; a parameter two pipeline stages share counts on its owner's."""
        params = self.named_model_parameters()
        grads = opt.reduce_gradients() if opt is not None else {n: p.grad for n, p in params.items()}
        holders = dist.get_world_size() // (self.compiled.mesh.axis_size(self.compiled.pp_axis) if self.pipeline else 1)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, g in grads.items():
            if g is None or (self.pipeline is not None and not self.pipeline.owns(name)):
                continue
            local, pieces = _held_values(g)
            total += torch.linalg.vector_norm(local, dtype=_norm_dtype(local)).double() ** 2 * pieces / holders
        dist.all_reduce(total)
        return float(total.sqrt())

    def clip_grad_norm_(self, max_norm: float, *, scale: float = 1.0, opt: MeshOptimizer | None = None) -> float:
        """Scale every gradient so that their global norm is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does on one process (by max_norm / (norm + 1e-6) where that is
        below 1); returns the norm before clipping. Call it between backward and `opt.step()`, on every
        rank. The norm is `grad_norm`'s, over every axis and stage, so it is right on every layout
        (torch's own function reads one pipeline stage's norm as the whole model's). With `opt` (as
        `train_step(max_norm=)` passes it) it reads and scales what `opt` will apply: under ZeRO-1 the
        reduce-scattered pieces, as Megatron's distributed optimizer clips, so the norm costs one scalar
        all-reduce. `scale`: the loss scale the gradients carry (fp16): the norm is of the unscaled ones. A
        norm that is not finite clips nothing (fp16's loss scaling then skips the step)."""
        check_max_norm(max_norm)
        norm = self.grad_norm(opt) / scale
        coef = max_norm / (norm + 1e-6)
        if math.isfinite(norm) and coef < 1.0:
            params = self.named_model_parameters().values()
            grads = opt.reduce_gradients().values() if opt is not None else [p.grad for p in params]
            for g in grads:
                if g is not None:
                    local_tensor(g).mul_(coef)  # a sum of scaled (Partial) gradients is the scaled sum
        return norm


def _held_values(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The values of gradient `g` this rank holds, and into how many distinct pieces its mesh cuts the
    whole (1: a plain tensor, whole on every rank). A Partial gradient is summed first (an all-reduce)."""
    if not isinstance(g, DTensor):
        return g, 1
    if any(p.is_partial() for p in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    pieces = math.prod(n for n, p in zip(g.device_mesh.shape, g.placements) if not p.is_replicate())  # strided too
    return local_tensor(g), pieces


def _norm_dtype(t: torch.Tensor) -> torch.dtype | None:
    """Accumulate a half-precision gradient's norm in fp32 (torch's own norm keeps fp32 and fp64)."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None


def check_max_norm(max_norm: float | None) -> None:
    """Refuse a clipping norm that is not a positive number (before any collective)."""
    number = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
    if max_norm is not None and not (number and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r}: clip to a positive, finite gradient norm (e.g. 1.0), or pass None")


def _waited(value: torch.Tensor, work) -> float:
    if work is not None:
        work.wait()
    return float(value)


def _microbatches(local: list[torch.Tensor], m: int) -> list[list[torch.Tensor]]:
    """This rank's inputs cut into `m` microbatches along dim 0."""
    if m == 1:
        return [local]
    return [list(parts) for parts in zip(*(x.chunk(m) for x in local), strict=True)]


def _canonical(path: str, names: set[str]) -> str:
    """The original model's FQN inside a wrapped path (`layer_0.block.layers.0.w` -> `layers.0.w`)."""
    parts = path.split(".")
    for i in range(len(parts)):
        if ".".join(parts[i:]) in names:
            return ".".join(parts[i:])
    return path


__all__ = ["Parallel"]
