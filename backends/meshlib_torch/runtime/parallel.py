"""Running a compiled model: DTensor parameters in their shards, the local graph, real collectives.

`parallelize(model, mesh=..., rules=..., example_inputs=...)` compiles the
model (which may live on the meta device), builds every parameter directly
in its shard as a DTensor, binds each inserted collective to its process
group, and returns a `Parallel` module. Its forward takes the global batch
(the same on every rank) and runs on this rank's part of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlib import Mesh

from ..compiler import placements as pl
from ..compiler.compile import Compiled, compile_model
from ..compiler.trace import _set_attr
from . import dist as mdist
from .comm import COUNTER, Comm, local_slice
from .materialize import init_local
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

    def __init__(self, compiled: Compiled, gm: fx.GraphModule, device_mesh):
        super().__init__()
        self.compiled, self.gm, self.device_mesh = compiled, gm, device_mesh
        mesh = compiled.mesh
        coords = mesh.coords(torch.distributed.get_rank())
        self._coords = coords

    @property
    def plan(self):
        return self.compiled.plan

    def shard_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a global input."""
        layout = self.compiled.input_layouts[name]
        for axis, p, n in zip(self.compiled.axes.names, layout, self.compiled.axes.sizes):
            if isinstance(p, pl.Shard):
                x = local_slice(x, p, self._coords[axis], n)
        return x

    def forward(self, *inputs: torch.Tensor):
        names = self.compiled.input_names
        if len(inputs) != len(names):
            raise TypeError(f"the compiled model takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
        for name, x in zip(names, inputs):
            want = tuple(self.compiled.traced.gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"].shape)
            if tuple(x.shape) != want:
                raise ValueError(
                    f"input {name!r} has shape {tuple(x.shape)} but the model was compiled for {want}. "
                    "Fix: recompile with example inputs of this shape"
                )
        local = [self.shard_input(n, x) for n, x in zip(names, inputs)]
        return self.gm(*local)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Turn the backward all-reduces of partial gradients (dp sync) on or off (accumulation)."""
        for mod in self.gm.modules():
            if isinstance(mod, Comm):
                mod.sync = enabled


def parallelize(
    model: nn.Module,
    /,
    *,
    mesh: Mesh,
    rules,
    example_inputs: tuple,
    init: Callable[[str], tuple[str, float]],
    seed: int = 0,
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    in_specs=None,
    compiled: Compiled | None = None,
) -> Parallel:
    """Compile `model` and build it on this rank's devices (call on every rank).

    Every check (mesh size against the world, rules, specs, input shapes)
    runs before the first collective, so bad input raises on every rank alike.
    """
    mdist.init()
    mesh.check_world_size(torch.distributed.get_world_size())
    compiled = compiled or compile_model(
        model, mesh=mesh, rules=rules, example_inputs=example_inputs, in_specs=in_specs, sequence_parallel=sequence_parallel
    )
    dm = mdist.device_mesh(mesh)
    gm = lower(compiled, dm, model, init=init, seed=seed, dtype=dtype)
    return Parallel(compiled, gm, dm)


def lower(compiled: Compiled, dm, model: nn.Module, *, init, seed: int, dtype=None) -> fx.GraphModule:
    """The local GraphModule for this rank: parameters, buffers, collectives and special ops."""
    mesh, axes = compiled.mesh, compiled.axes
    device = torch.device(mdist.device_type(), torch.cuda.current_device()) if mdist.device_type() == "cuda" else torch.device("cpu")
    rank = torch.distributed.get_rank()
    coords = mesh.coords(rank)
    groups = {a: mdist.group(dm, a) for a in mesh.axis_names}
    root = nn.Module()
    for name, p in compiled.traced.params.items():
        layout = compiled.param_layouts[name]
        pdtype = dtype or p.dtype
        local = init_local(name, tuple(p.shape), pdtype, layout, axes.sizes, [coords[a] for a in axes.names], init, seed)
        dt = DTensor.from_local(local.to(device), dm, torch_placements(layout), shape=p.shape, stride=_stride(p.shape))
        _set_attr(root, name, nn.Parameter(dt, requires_grad=p.requires_grad))
    for name, b in _real_buffers(model, compiled).items():
        _set_attr(root, name, b.to(device))
    for spec in compiled.comms:
        root.add_module(spec.name, Comm(spec, axes, groups, coords))
    for spec in compiled.specials:
        cls = VocabEmbedding if spec.kind == "vocab_embedding" else CrossEntropy
        axis = spec.args.get("axis")
        root.add_module(spec.name, cls(**spec.args, rank=coords.get(axis, 0), groups=groups, ranks=coords))
    graph = _retarget_devices(compiled.graph, device)
    return fx.GraphModule(root, graph)


def _stride(shape) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


def _real_buffers(model: nn.Module, compiled: Compiled) -> dict[str, torch.Tensor]:
    """Buffers with values: meta buffers are re-made on CPU and filled by `model.init_buffers()`."""
    names = set(compiled.buffers)
    bufs = dict(model.named_buffers())
    if any(b.is_meta for n, b in bufs.items() if n in names):
        for mod_name, mod in model.named_modules():
            for bname, b in list(mod.named_buffers(recurse=False)):
                if b.is_meta:
                    setattr(mod, bname, torch.empty_like(b, device="cpu"))
        if not hasattr(model, "init_buffers"):
            raise ValueError("the model's buffers are on the meta device; give it an init_buffers() that fills them")
        model.init_buffers()
        bufs = dict(model.named_buffers())
    return {n: bufs[n] for n in names if n in bufs}


def _retarget_devices(graph: fx.Graph, device: torch.device) -> fx.Graph:
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    new._codegen = graph._codegen  # export graphs unflatten their outputs with a pytree codegen
    for node in new.nodes:
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": device}
    return new


__all__ = ["Parallel", "parallelize", "lower", "torch_placements", "COUNTER"]
