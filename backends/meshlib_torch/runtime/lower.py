"""Lower a program onto this rank: its parameters' shards, buffers, collectives, and the modules it runs.

A traced program's parameters are DTensors made directly in their shards on the
device mesh (plain tensors where FSDP2 alone shards them: `zero.plain_parameters`),
held by one root module under their canonical names with the buffers and the
bound collectives; each stage this rank runs (the whole graph, without a
pipeline) is a `GraphModule` on that root. A program cut by module FQN (no
tracer could follow the model) fills its stages' meta copies of the model with
whole parameters instead. Either way each value is this rank's part of the
model's own weight, or of what `init=` draws, and the model's whole copy is
released as soon as it is taken (`weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from ..compiler.attrs import has_attr, resolve, set_attr
from ..compiler.capture.blocks import split_graph
from ..compiler.capture.regions import apply_regions
from ..compiler.placement.placements import Pending
from ..compiler.program import EagerStages, TracedStages, buffer_dtype, deferred_loss, shard_axes, shard_ranks
from ..torch_private import copy_codegen, own_buffers, own_parameters
from . import dist as mdist
from . import weights
from .buffers import fill_meta_buffers
from .dtensor import torch_placements
from .parallelisms.zero import plain_parameters


@dataclass
class Lowered:
    root: nn.Module  # the parameters (canonical names), buffers and collectives
    modules: list[nn.Module]  # what this rank runs: one module per local stage (no pipeline: the graph)
    local_stages: list[int]  # their stage indices
    device: torch.device


def lower(compiled, dm, model: nn.Module, source: weights.Source) -> Lowered:
    """This rank's part of `compiled` on device mesh `dm`, its weights from `source` (call on every rank)."""
    device = torch.device("cuda", torch.cuda.current_device()) if mdist.device_type() == "cuda" else torch.device("cpu")
    coords = compiled.mesh.coords(torch.distributed.get_rank())
    local = _local_stages(compiled, coords)
    mine = set(compiled.traced.params)
    if compiled.pipelined:
        mine = set().union(*(compiled.stages.params[s] for s in local))
    if isinstance(compiled.program, EagerStages):
        return _lower_eager(compiled, model, mine, local, source, device=device)
    plain = plain_parameters(compiled)
    sizes, at = compiled.axes.sizes, [coords[a] for a in compiled.axes.names]

    def shard(name: str, p: torch.Tensor) -> nn.Parameter:
        layout = compiled.param_layouts[name]
        value = source.shard(name, p, layout, sizes, at).to(device)
        if not plain:
            value = DTensor.from_local(value, dm, torch_placements(layout), shape=p.shape, stride=_stride(p.shape))
        return nn.Parameter(value, requires_grad=p.requires_grad)

    real = real_buffers(model, compiled, source)  # before any collective: its errors are every rank's alike
    real |= _constants(compiled, set(real))
    root = _take(compiled, model, mine, shard, device, source)
    buffers = {}
    for name, b in real.items():
        buffers[name] = b.to(device, dtype=buffer_dtype(compiled, name, b))
        set_attr(root, name, buffers[name])
    orders = {n: compiled.param_rank_order(n) for n in mine}
    source.finish({n: p for n, p in root.named_parameters()}, buffers, {n: o for n, o in orders.items() if o})
    for spec in [*compiled.comms, *compiled.specials]:  # bound to process groups by the tensor step
        root.add_module(spec.name, Pending(spec))
    if isinstance(compiled.program, TracedStages):
        graphs = [compiled.stages.graphs[s] for s in local]
        grads = _unsummed_grads(compiled)
        modules = [_in_layers(compiled, fx.GraphModule(root, executable(g, device, plain, grads=grads)))
                   for g in graphs]  # fmt: skip
        return Lowered(nn.ModuleList(modules), modules, local, device)  # the stages hold the parameters now
    deferred = deferred_loss(compiled)  # the runtime sums the loss itself, beside backward
    skip = {deferred[0].name} if deferred is not None else set()
    graph = executable(compiled.graph, device, plain, skip=skip, grads=_unsummed_grads(compiled))
    gm = _in_layers(compiled, fx.GraphModule(root, graph))
    return Lowered(gm, [gm], local, device)


def _in_layers(compiled, gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` cut into `pre`, `layer_<i>` (those it runs) and `post`: the units FSDP2 shards and recompute
    wraps, and where a user's hooks see each layer (`Parallel.blocks`). A model without layers as it is."""
    if not compiled.layers:
        return gm
    return split_graph(gm, {n.name: k for n, k in compiled.parts.items()}, compiled.layers)


def _local_stages(compiled, coords: dict) -> list[int]:
    if not compiled.pipelined:
        return [0]
    pp_rank = coords[compiled.pp_axis]
    return [s for s, r in enumerate(compiled.schedule.placement) if r == pp_rank]


def _take(compiled, model: nn.Module, names: set[str], make, device, source: weights.Source) -> nn.Module:
    """A root holding `make(name, p)` for each parameter in `names`. With the model's own weights every
    whole copy is released once taken, and every rank's checksums of them compared."""
    root = nn.Module()
    held = [model] + ([compiled.traced.gm] if compiled.traced.gm is not None else [])
    holders = weights.Holders(*held) if source.kind == "model" else None
    sums = {}
    for name, p in list(compiled.traced.params.items()):
        if holders is not None:
            sums[name] = weights.checksum(p)
        if name in names:
            set_attr(root, name, make(name, p))
        if holders is not None:  # the whole copy goes as soon as this rank has its part
            compiled.traced.params[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            holders.release(p)
    weights.agree(sums, device)
    return root


def _lower_eager(compiled, model, names, local, source: weights.Source, *, device) -> Lowered:
    """The stages of a model cut by module FQN: each a meta copy filled with whole parameters (one
    `nn.Parameter` per name however many local stages hold it) and the model's buffers."""

    def whole(name: str, p: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(source.whole(name, p).to(device), requires_grad=p.requires_grad)

    canon = {id(b): n for n, b in model.named_buffers()}
    paths = {path: canon[id(b)] for path, b in model.named_buffers(remove_duplicate=False)}
    real = real_buffers(model, compiled, source)  # before any collective, as the traced path does
    root = _take(compiled, model, names, whole, device, source)
    source.finish(dict(root.named_parameters()), real)
    buffers = {path: real[n] for path, n in paths.items() if n in real}  # every name of a shared buffer
    params = dict(root.named_parameters())
    aliases = compiled.traced.aliases
    modules = [_fill(compiled.stages.modules[s], params, buffers, aliases, device, compiled) for s in local]
    # the stages hang under the root after its own FQN-named parameters: a cast or an update of the
    # root's reaches them, and the root's names come first for a parameter both hold
    root.add_module("pipeline_stages", nn.ModuleList(modules))
    return Lowered(root, modules, local, device)


def _fill(stage: nn.Module, params: dict, buffers: dict, aliases: dict, device, compiled) -> nn.Module:
    """Put the real parameters (by canonical FQN) and buffers into a stage's meta copy of the model."""
    for prefix, mod in stage.named_modules(remove_duplicate=False):
        for name, p in list(own_parameters(mod).items()):
            if p is not None:
                path = f"{prefix}.{name}" if prefix else name
                own_parameters(mod)[name] = params[aliases.get(path, path)]
        for name, b in list(own_buffers(mod).items()):
            path = f"{prefix}.{name}" if prefix else name
            if b is not None and path in buffers:
                real = buffers[path]
                own_buffers(mod)[name] = real.to(device, dtype=buffer_dtype(compiled, path, real))
    return stage


def _stride(shape) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


def real_buffers(model: nn.Module, compiled, source: weights.Source | None = None) -> dict[str, torch.Tensor]:
    """The buffers the program reads, with values: the checkpoint's where it holds them (a DCP checkpoint's
    are read into them by `Source.finish`), else the model's own, a meta one filled by the nearest init code
    that owns it (`buffers.fill_meta_buffers`; raises naming any none fills)."""
    held = source.buffer_keys if source is not None else {}
    bufs = dict(model.named_buffers())
    names = [n for n in compiled.buffers if n in bufs]
    fill_meta_buffers(model, [n for n in names if bufs[n].is_meta and n not in held], why=_why_meta(source))
    bufs = dict(model.named_buffers())
    out = {}
    for n in names:
        value = source.buffer(n) if source is not None else None
        if value is None and bufs[n].is_meta:  # a DCP checkpoint's: `finish` reads it in
            value = torch.empty(bufs[n].shape, dtype=bufs[n].dtype)
        out[n] = bufs[n] if value is None else value
    return out


def _why_meta(source: weights.Source | None) -> str:
    kind = source.kind if source is not None else "model"
    if kind == "file":
        return "weights= does not hold them"
    if kind == "init":
        return "init= draws parameters, not buffers"
    return "the model was given with them on the meta device"


def _constants(compiled, buffers: set[str]) -> dict[str, torch.Tensor]:
    """The tensors the traced graph reads that are neither parameters nor the model's `buffers`: constants
    torch.export lifted out of the forward (a KV cache's empty start, a tensor made from a Python list),
    with values. One made on the meta device has none unless it is empty: it raises, naming it."""
    out, unknown = {}, []
    for node in compiled.graph.nodes:
        name = node.target
        if node.op != "get_attr" or name in compiled.traced.params or name in buffers or name in out:
            continue
        value = resolve(compiled.traced.gm, name) if has_attr(compiled.traced.gm, name) else None
        if not torch.is_tensor(value) or isinstance(value, nn.Parameter):
            continue
        if value.is_meta and value.numel():
            unknown.append(name)
        out[name] = torch.empty(value.shape, dtype=value.dtype) if value.is_meta else value.detach()
    if unknown:
        raise ValueError(
            f"the traced forward reads constants made on the meta device, whose values are unknown: "
            f"{', '.join(unknown)}. Fix: make them buffers of their module, filled by its init_buffers(), or build "
            "the model on the CPU"
        )
    return out


def _unsummed_grads(compiled) -> dict[str, list]:
    """Per parameter whose gradient backward leaves unsummed over data axes (ZeRO-1's, which its
    optimizer step reduce-scatters), the DTensor placements that gradient has: the parameter's, Partial
    over those axes. So `p.grad` says what it is, and DTensor code reading it (`full_tensor`, torch's
    `clip_grad_norm_`) sums it first instead of reading one rank's share as the whole."""
    if compiled.options.zero != 1:
        return {}
    out = {}
    for name in compiled.traced.params:
        if shard_ranks(compiled, name) > 1:
            partial = set(shard_axes(compiled, name))
            layout = torch_placements(compiled.param_layouts[name])
            out[name] = [Partial() if a in partial else p for a, p in zip(compiled.axes.names, layout)]
    return out


def executable(
    graph: fx.Graph, device: torch.device, plain: bool = False, skip: set[str] = frozenset(), grads: dict | None = None
) -> fx.Graph:
    """A copy of a compiled graph to run on `device`: tensors it makes are made there, the ops of
    grad-mode and autocast regions run under their modes (`regions.apply_regions`), with `plain`
    parameters are read as they are (no DTensor to unwrap), the collectives named in `skip`
    are left to the runtime, and the parameters in `grads` (`_unsummed_grads`) read with their
    gradients' placements."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    copy_codegen(graph, new)
    here = lambda a: device if isinstance(a, torch.device) else a  # noqa: E731  (traced on meta, or elsewhere)
    for node in list(new.nodes):
        node.args, node.kwargs = fx.node.map_aggregate(node.args, here), fx.node.map_aggregate(node.kwargs, here)
        if (plain and node.op == "call_method" and node.target == "to_local") or (
            node.op == "call_module" and node.target in skip
        ):
            node.replace_all_uses_with(node.args[0])
            new.erase_node(node)
        elif node.op == "call_method" and node.target == "to_local" and node.args[0].op == "get_attr":
            if node.args[0].target in (grads or {}):
                node.kwargs = {**node.kwargs, "grad_placements": grads[node.args[0].target]}
    apply_regions(new)
    return new


__all__ = ["Lowered", "executable", "lower", "real_buffers"]
