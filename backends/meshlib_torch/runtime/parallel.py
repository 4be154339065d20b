"""Running a compiled model: DTensor parameters in their shards, the local graph, real collectives.

`parallelize(model, mesh=..., rules=..., example_inputs=...)` compiles the
model (which may live on the meta device), builds every parameter directly
in its shard as a DTensor, binds each inserted collective to its process
group, and returns a `Parallel` module. Its forward takes the global batch
(the same on every rank) and runs on this rank's part of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlib import Mesh, Precision

from ..compiler import placements as pl
from ..compiler.call import batch_call
from ..compiler.compile import Compiled, compile_model
from ..compiler.regions import apply_regions
from ..compiler.split import layer_paths, split_graph
from ..compiler.trace import _set_attr
from . import dist as mdist
from . import weights
from .comm import COUNTER, Comm, local_slice
from .fsdp import apply_fsdp, set_sync, unshardable
from .optim import GradSync, LossScaler, MeshAdamW
from .recompute import Recompute
from .special import CrossEntropy, VocabEmbedding


def torch_placements(layout: pl.Layout) -> list:
    """Our placements as DTensor's (a grouped shard is DTensor's `_StridedShard`)."""
    out = []
    for p in layout:
        if isinstance(p, pl.Shard):
            out.append(Shard(p.dim) if p.groups == 1 else _StridedShard(p.dim, split_factor=p.groups))
        elif isinstance(p, pl.Partial):
            out.append(Partial())
        else:
            out.append(Replicate())
    return out


class Parallel(nn.Module):
    """A compiled model on a DeviceMesh: call it on the global batch."""

    def __init__(self, compiled: Compiled, gm: nn.Module, device_mesh):
        super().__init__()
        self.compiled, self.gm, self.device_mesh = compiled, gm, device_mesh
        self._coords = compiled.mesh.coords(torch.distributed.get_rank())
        self.fsdp_units: list[nn.Module] = []
        self.grad_sync: GradSync | None = None
        self.fp32_init: dict[str, torch.Tensor] = {}  # fp32 values of bf16/fp16 parameters, for the masters
        self.microbatches = 1  # a pipeline's global batch holds this many of the compiled call's

    @property
    def plan(self):
        return self.compiled.plan

    @property
    def zero(self) -> int:
        return self.compiled.options.zero if self.compiled.options else 0

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters by their FQN in the original model (whatever wraps them here)."""
        names = set(self.compiled.traced.params)
        return {_canonical(path, names): p for path, p in self.gm.named_parameters()}

    def shard_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a global input."""
        layout = self.compiled.input_layouts[name]
        for axis, p, n in zip(self.compiled.axes.names, layout, self.compiled.axes.sizes):
            if isinstance(p, pl.Shard):
                x = local_slice(x, p, self._coords[axis], n)
        return x

    def local_inputs(self, args: tuple = (), kwargs: dict | None = None) -> list[torch.Tensor]:
        """This rank's parts of a call's tensors, in graph-input order (the call is checked first)."""
        call = self.compiled.traced.call
        tensors = call.bind(args, kwargs)
        for (name, want), x in zip(call.tensors.items(), tensors):
            want = (want.shape[0] * self.microbatches, *want.shape[1:]) if want.dim() else ()
            if tuple(x.shape) != tuple(want):
                raise ValueError(
                    f"input {name!r} has shape {tuple(x.shape)} but the model was compiled for {tuple(want)}. "
                    "Fix: recompile with example inputs of this shape"
                )
        return [self.shard_input(n, x) for n, x in zip(call.tensors, tensors)]

    def forward(self, *args, **kwargs):
        """The loss of the global batch, called as the model is (positional and keyword inputs)."""
        out = self.gm(*self.local_inputs(args, kwargs))
        if isinstance(out, (tuple, list)) and len(out) == 1:  # split_module's graph returns a 1-tuple
            out = out[0]
        out_dtype = _dtype(self.compiled.plan.precision.output)
        return out.to(out_dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradient accumulation: sum gradients over the data-parallel axes only when enabled."""
        if self.grad_sync is not None:
            self.grad_sync.enabled = enabled
        if self.fsdp_units:
            set_sync(self.fsdp_units, enabled)

    def optimizer(self, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> MeshAdamW:
        """AdamW for this model's zero level and precision (fp32 masters for bf16/fp16 parameters)."""
        c = self.compiled
        data = c.data_axes
        group = mdist.group(self.device_mesh, data) if data else None
        dp_size = math.prod(c.mesh.axis_size(a) for a in data) if data else 1
        dp_index = c.mesh.axis_coord(torch.distributed.get_rank(), data) if data else 0
        params = self.named_model_parameters()
        opt = MeshAdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, zero=self.zero,
            master=bool(self.fp32_init), dp_group=group, dp_axis="_".join(data) or "dp", dp_index=dp_index,
            dp_size=dp_size, layouts=c.param_layouts, mesh_axes=c.axes, fp32_init=self.fp32_init,
        )  # fmt: skip
        self.fp32_init = {}  # the optimizer owns the masters now
        if c.plan.precision.param == "float16":
            opt.scaler = LossScaler()
        return opt

    def train_step(self, microbatches: list, opt: MeshAdamW) -> float:
        """Forward and backward over `microbatches` (each a global batch of inputs: a tuple of positional
        inputs or a dict of keyword inputs), then one update.

        Gradients are summed over the data-parallel axes only after the last
        microbatch; each microbatch's loss is scaled by 1/k, so the step equals
        one over all of them together. Returns the mean loss.
        """
        k = len(microbatches)
        total = 0.0
        for i, inputs in enumerate(microbatches):
            self.set_gradient_sync(i == k - 1)
            args, kwargs = batch_call(inputs)
            loss = self(*args, **kwargs) / k
            total += float(loss.detach())
            (opt.scaler.scale_loss(loss) if opt.scaler else loss).backward()
        opt.step()
        opt.zero_grad()
        return total


def seed_alike(seed: int) -> None:
    """Seed torch's generator with `seed` on every rank: the local graphs run the same ops in the same
    order everywhere, so ranks that hold the same values (replicas over tp or dp) draw the same
    dropout masks, and a block recomputed in backward draws its forward's (checkpoint restores the
    generator). As Megatron by default, data-parallel ranks share the seed too."""
    torch.manual_seed(seed)


def _canonical(path: str, names: set[str]) -> str:
    """The original model's FQN inside a wrapped path (`layer_0.block.layers.0.w` -> `layers.0.w`)."""
    parts = path.split(".")
    for i in range(len(parts)):
        if ".".join(parts[i:]) in names:
            return ".".join(parts[i:])
    return path


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def parallelize(
    model: nn.Module,
    /,
    *,
    mesh: Mesh,
    rules,
    example_inputs: tuple | dict = (),
    example_kwargs: dict | None = None,
    loss=None,
    init: Callable[[str], tuple[str, float]] | None = None,
    seed: int = 0,
    sequence_parallel: bool = False,
    in_specs=None,
    zero: int | str = 0,
    precision: Precision | str | None = None,
    recompute: str = "none",
    replicate_axes: tuple[str, ...] = (),
    offload: bool = False,
    prefetch: bool = True,
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int | None = None,
    pp_axis: str = "pp",
    split_points: list[int] | None = None,
    balance: str = "flops",
    timeout: float | None = None,
    compiled: Compiled | None = None,
):
    """Compile `model` and build it on this rank's devices (call on every rank).

    The model is called as `model(*example_inputs, **example_kwargs)` (see `compile_model`,
    which also says how `loss=` picks the loss from its outputs); the result is called the same
    way, on the global batch, and returns the loss.

    Weights: a model with real parameters trains from them. Each rank keeps its shard and the
    model's whole copy of each parameter is released as it is taken (the model is left on the
    meta device), so a rank's peak while building is the model plus one parameter's shard;
    every rank must be given the same weights, which is checked. A model built on the meta
    device needs `init=` (name -> ("normal", std) | ("zeros", 0) | ("ones", 0)), whose values
    are the single process's with `seed`; `init=` with real weights is an error. `seed` also seeds
    torch's generator alike on every rank, so that random ops (dropout) draw the same numbers on
    ranks that hold the same values (`seed_alike`).

    Every check (mesh size against the world, rules, specs, input shapes)
    runs before the first collective, so bad input raises on every rank alike.
    `zero` shards optimizer state (1), gradients (2) and parameters (3) over the
    data-parallel axes; `precision` sets the parameter (compute), reduce and
    output dtypes; `recompute` is "none", "block" or "selective"; `offload`
    keeps FSDP's shards on the CPU (ZeRO-2/3).

    With a `pp_axis` in the mesh the model is cut into pipeline stages (see
    `runtime.pipeline.parallelize_pipeline`): `microbatches` per step, a
    `schedule` by name, `chunks` stages per rank (interleaved), optional
    `split_points` (the layers where stages begin) and `balance` by "flops"
    or "params". The result then trains with `train_step(batch, opt)`.
    `timeout` (seconds) bounds every collective and send/receive of this
    model's process groups (default: the world group's).
    """
    weights.check_source(model, init)
    mdist.init()
    seed_alike(seed)
    mesh.check_world_size(torch.distributed.get_world_size())
    if pp_axis in mesh and mesh.axis_size(pp_axis) > 1:
        from .pipeline import parallelize_pipeline

        return parallelize_pipeline(
            model, mesh=mesh, rules=rules, example_inputs=example_inputs, example_kwargs=example_kwargs, loss=loss,
            init=init, seed=seed,
            sequence_parallel=sequence_parallel, in_specs=in_specs, zero=zero, precision=precision, recompute=recompute,
            microbatches=microbatches, schedule=schedule, chunks=chunks, pp_axis=pp_axis, split_points=split_points,
            balance=balance, timeout=timeout,
        )  # fmt: skip
    if microbatches != 1:
        raise ValueError(
            f"microbatches={microbatches} without a pipeline: pass the microbatches to train_step instead "
            f"(gradient accumulation), or add a {pp_axis!r} axis to the mesh"
        )
    compiled = compiled or compile_model(
        model, mesh=mesh, rules=rules, example_inputs=example_inputs, example_kwargs=example_kwargs, loss=loss,
        in_specs=in_specs,
        sequence_parallel=sequence_parallel, zero=zero, precision=precision, recompute=recompute,
        replicate_axes=replicate_axes,
    )  # fmt: skip
    opts = compiled.options
    if opts.replicate_axes and opts.zero < 2:
        raise ValueError("replicate_axes (HSDP) needs zero=2 or 3, where FSDP2 shards over the other data axes")
    if offload and opts.zero < 2:
        raise ValueError("offload needs zero=2 or 3 (FSDP2's CPUOffloadPolicy)")
    dm = mdist.device_mesh(mesh, timeout=timeout)
    compute = _dtype(opts.precision.param)
    gm = lower(compiled, dm, model, init=init, seed=seed, buffer_dtype=compute)
    par_fp32 = {}
    if opts.zero < 2 and compute in (torch.bfloat16, torch.float16):
        par_fp32 = _cast_params(gm, compute)  # bf16/fp16 parameters, fp32 masters in the optimizer
    layers = len(layer_paths(model))
    if opts.zero >= 2 or opts.recompute != "none":
        gm = split_graph(gm, {n.name: k for n, k in compiled.parts.items()}, layers)
    blocks = [f"layer_{i}" for i in range(layers)]
    if opts.recompute != "none":
        for name in blocks:
            setattr(gm, name, Recompute(getattr(gm, name), opts.recompute))
    par = Parallel(compiled, gm, dm)
    par.fp32_init = par_fp32
    data = compiled.data_axes
    if opts.zero >= 2:
        if compute in (torch.bfloat16, torch.float16):  # what FSDP2 leaves whole computes in bf16 too
            whole_paths = {path for path, p in gm.named_parameters() if any(p is q for q in unshardable(gm))}
            names = set(compiled.traced.params)
            par.fp32_init = {_canonical(k, names): v for k, v in _cast_params(gm, compute, only=whole_paths).items()}
        left = {id(p) for p in unshardable(gm)}  # before fully_shard replaces the parameters
        shard = tuple(a for a in data if a not in opts.replicate_axes)
        par.fsdp_units = apply_fsdp(
            gm, [getattr(gm, b) for b in blocks], dm, zero=opts.zero, shard_axes=shard,
            replicate_axes=opts.replicate_axes, param_dtype=compute, reduce_dtype=_dtype(opts.precision.reduce),
            output_dtype=None, offload=offload, prefetch=prefetch,
        )  # fmt: skip
        whole = {n: p for n, p in par.named_model_parameters().items() if id(p) in left}
        if whole:
            par.grad_sync = GradSync(whole, mdist.group(dm, data), "_".join(data), _dtype(opts.precision.reduce))
    elif opts.zero == 0 and data:
        synced = {n: p for n, p in par.named_model_parameters().items() if n in compiled.synced_params}
        par.grad_sync = GradSync(synced, mdist.group(dm, data), "_".join(data), _dtype(opts.precision.reduce))
    return par


def _cast_params(gm: nn.Module, dtype: torch.dtype, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Replace the parameters by `dtype` copies; return their fp32 values by path.

    New Parameter objects, not `p.data = ...`: a DTensor's `.data` assignment
    relabels its dtype but keeps the old local tensor.
    """
    out, new = {}, {}
    chosen = set()
    for path, p in gm.named_parameters():
        if only is None or path in only:
            out[path] = p.data
            chosen.add(id(p))
    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or id(p) not in chosen:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(p.data.to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]
    return out


def lower(compiled: Compiled, dm, model: nn.Module, *, init, seed: int, buffer_dtype=None, only=None) -> fx.GraphModule:
    """The local GraphModule for this rank: parameters (the names in `only`, else all), buffers,
    collectives and special ops.

    Each parameter is this rank's shard of the model's own value, or of the values `init` draws
    (`weights`). The model's whole copy of each parameter is released as soon as it is taken,
    and then every rank's checksums of the model's weights are compared (one small all-reduce)."""
    mesh, axes = compiled.mesh, compiled.axes
    device = (
        torch.device(mdist.device_type(), torch.cuda.current_device())
        if mdist.device_type() == "cuda"
        else torch.device("cpu")
    )
    rank = torch.distributed.get_rank()
    coords = mesh.coords(rank)
    groups = {a: mdist.group(dm, a) for a in mesh.axis_names}
    root = nn.Module()
    holders = weights.Holders(model, compiled.traced.gm) if init is None else None
    sums = {}
    for name, p in list(compiled.traced.params.items()):
        if init is None:
            sums[name] = weights.checksum(p)
        if only is None or name in only:
            layout = compiled.param_layouts[name]
            local = weights.local_value(
                name, p, layout, axes.sizes, [coords[a] for a in axes.names], init=init, seed=seed
            )
            dt = DTensor.from_local(
                local.to(device), dm, torch_placements(layout), shape=p.shape, stride=_stride(p.shape)
            )
            _set_attr(root, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        if holders is not None:  # the whole copy goes as soon as this rank has its shard
            compiled.traced.params[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            holders.release(p)
    weights.agree(sums, device)
    for name, b in real_buffers(model, compiled).items():
        b = b.to(buffer_dtype) if buffer_dtype is not None and b.is_floating_point() else b
        _set_attr(root, name, b.to(device))
    for spec in compiled.comms:
        root.add_module(spec.name, Comm(spec, axes, groups, coords))
    for spec in compiled.specials:
        cls = VocabEmbedding if spec.kind == "vocab_embedding" else CrossEntropy
        axis = spec.args.get("axis")
        root.add_module(spec.name, cls(**spec.args, rank=coords.get(axis, 0), groups=groups, ranks=coords))
    graph = executable(compiled.graph, device)
    if only is not None:
        return root  # the pipeline builds each stage's graph on this root
    return fx.GraphModule(root, graph)


def _stride(shape) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


def real_buffers(model: nn.Module, compiled: Compiled) -> dict[str, torch.Tensor]:
    """Buffers with values: meta buffers are re-made on CPU and filled by `model.init_buffers()`."""
    names = set(compiled.buffers)
    bufs = dict(model.named_buffers())
    if any(b.is_meta for n, b in bufs.items() if n in names):
        for _mod_name, mod in model.named_modules():
            for bname, b in list(mod.named_buffers(recurse=False)):
                if b.is_meta:
                    setattr(mod, bname, torch.empty_like(b, device="cpu"))
        if not hasattr(model, "init_buffers"):
            raise ValueError("the model's buffers are on the meta device; give it an init_buffers() that fills them")
        model.init_buffers()
        bufs = dict(model.named_buffers())
    return {n: bufs[n] for n in names if n in bufs}


def executable(graph: fx.Graph, device: torch.device) -> fx.Graph:
    """A copy of a compiled graph to run on `device`: tensors it makes are made there, and the ops of
    grad-mode and autocast regions run under their modes (`regions.apply_regions`)."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    new._codegen = graph._codegen
    for node in new.nodes:
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": device}
    apply_regions(new)
    return new


__all__ = ["Parallel", "parallelize", "lower", "torch_placements", "COUNTER"]
