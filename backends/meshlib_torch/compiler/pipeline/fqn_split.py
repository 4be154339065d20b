"""Split by module FQN: pipeline stages cut from the eager model, when it cannot be traced.

When neither torch.fx nor torch.export can trace a model (`trace.Untraceable`),
the stages are cut from the model itself. The layers, their cost and the
partition are the traced path's (`layer_paths`, `layer_costs`, `stage_ranges`);
`layer_costs`' meta run also names the outermost modules that run before the
first layer (embeddings) and after the last (final norm, head, loss).

Each stage is a copy of the model on the meta device, its parameters under
their own FQNs: the layers of other stages return their first argument, and
on stages after the first, each module with parameters that runs before the
layers returns the activation received from the previous stage, which also
replaces the stage's first layer's input. A stage that is not the last stops at
its last layer: a forward hook raises `_StageOutput` with the layer's output,
and the stage's forward catches it. So the model's own forward runs on every
stage with all its glue (rotary tables, masks, reshapes, the loss), and
nothing here is model-specific.

Stage 0 takes the model's inputs and returns the hidden state and the inputs
later stages read; stage s > 0 takes the hidden state and the inputs it or a
later stage reads (a meta run notes which input tensors any torch function
touches, shapes and dtypes included); the last stage returns the loss. The
model must fit that shape: its layers take the hidden state as their first
positional argument and return it as a tensor, a module with parameters that
runs before the layers feeds only the first layer's input, and the forward
returns the loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshlib import Boundary, Collective, Mesh, P, Plan
from meshlib.options import Parallelism
from meshlib.sharding import UNEVEN_FIX

from ...torch_private import pytree
from ..attrs import canonical_params
from ..capture.call import Call, pick_loss
from ..capture.trace import Untraceable
from ..placement import annotate as _annotate
from ..placement.propagate import Axes
from ..placement.shapes import local_shape
from .costs import LayerCosts, meta_copy


@dataclass
class EagerStages:
    """The stages of an eager model (`StageGraphs` of a traced one), each on the meta device."""

    modules: list[nn.Module]
    layers: list[tuple[int, int]]  # layer range [start, stop) of each stage
    inputs: list[tuple[torch.Tensor, ...]]  # meta: what each stage receives for one microbatch on one rank
    outputs: list[tuple[torch.Tensor, ...]]  # ... and sends on (last: the loss)
    sends: list[tuple[Boundary, ...]] = field(default_factory=list)
    params: list[set[str]] = field(default_factory=list)  # canonical parameter FQNs each stage holds
    costs: list[float] = field(default_factory=list)
    balance: str = "flops"


class _StageOutput(Exception):
    """Raised by a stage's last layer (not the model's) to carry its output out of the model's forward."""

    def __init__(self, value):
        super().__init__("stage output")
        self.value = value


@dataclass(eq=False)
class _Cut:
    """Where a stage's copy of the model starts and stops, and what it receives and sends."""

    index: int
    last: bool
    absent: tuple  # meta stand-ins for the model inputs this stage does not receive
    call: Call  # how the model is called: its tensors by name, the fixed values, which output is the loss
    receives: tuple[int, ...] = ()  # the model inputs received after the hidden state (stage > 0)
    sends: tuple[int, ...] = ()  # the model inputs sent on after the hidden state (not the last stage)
    hidden: torch.Tensor | None = None  # the activation received, while the forward runs
    finish: Callable | None = None  # applied to the loss (the runtime's mean over data-parallel ranks)


class _Stage:
    """Mixed into the class of a stage's model copy (as `fully_shard` does): its forward is one stage's."""

    def forward(self, *args):
        cut = self.meshlib_cut
        inputs = list(args)
        if cut.index > 0:
            cut.hidden, inputs = args[0], list(cut.absent)
            for i, x in zip(cut.receives, args[1:], strict=True):
                inputs[i] = x
        call_args, call_kwargs = cut.call.arguments(dict(zip(cut.call.names, inputs)))
        try:
            out = super().forward(*call_args, **call_kwargs)
        except _StageOutput as stop:
            return (stop.value, *(inputs[i] for i in cut.sends))
        finally:
            cut.hidden = None
        if not cut.last:
            raise RuntimeError(
                f"pipeline stage {cut.index}: the model's forward returned before the stage's last layer ran"
            )
        out = pick_loss(out, cut.call.loss)
        return cut.finish(out) if cut.finish is not None else out


class _PassThrough(nn.Module):
    """A layer another stage runs (or a module after the layers, on a stage that stops before them)."""

    def forward(self, x=None, *args, **kwargs):
        return x


class _Received(nn.Module):
    """A module with parameters that runs before the layers, on a later stage: the received activation."""

    def __init__(self, cut: _Cut):
        super().__init__()
        self.cut = cut

    def forward(self, *args, **kwargs):
        return self.cut.hidden


def _take_received(cut: _Cut, path: str, mod, args):
    if not args:
        raise ValueError(f"layer {path!r} is called without positional arguments; the split by module FQN passes "
                         "the hidden state as a layer's first positional argument")  # fmt: skip
    return (cut.hidden, *args[1:])


def _stop(mod, args, out):
    raise _StageOutput(out)


_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"{cls.__name__}Stage", (_Stage, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def _swap(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def stage_modules(model: nn.Module, layers: list[str], ranges: list[tuple[int, int]], costs: LayerCosts, absent, call):
    """One meta copy of `model` per stage, cut to its layers (see the module docstring)."""
    owns = lambda path: any(True for _ in model.get_submodule(path).parameters())  # noqa: E731
    before, after = [p for p in costs.before if owns(p)], [p for p in costs.after if owns(p)]
    out = []
    for s, (a, b) in enumerate(ranges):
        stage, cut = meta_copy(model), _Cut(s, s == len(ranges) - 1, tuple(absent), call)
        for i, path in enumerate(layers):
            if not a <= i < b:
                _swap(stage, path, _PassThrough())
        # a stage without a layer (the embedding alone, or the head alone: `even_layers`) hooks the pass-through
        # layer next to where its layers would be
        first, last = layers[min(a, len(layers) - 1)], layers[max(b - 1, 0)]
        if s > 0:
            for path in before:
                _swap(stage, path, _Received(cut))
            stage.get_submodule(first).register_forward_pre_hook(partial(_take_received, cut, first))
        if not cut.last:
            for path in after:
                _swap(stage, path, _PassThrough())
            stage.get_submodule(last).register_forward_hook(_stop)
        stage.__class__ = _stage_class(type(model))
        stage.meshlib_cut = cut
        out.append(stage)
    return out


class _Touches(TorchFunctionMode):
    """Which of some tensors any torch function touches (ops, and `.shape`, `.device`, `.data_ptr()`, ...)."""

    def __init__(self, tensors: tuple):
        super().__init__()
        self.ids = {id(x): i for i, x in enumerate(tensors)}
        self.found: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in pytree.tree_leaves((args, kwargs)):
            if id(x) in self.ids:
                self.found.add(self.ids[id(x)])
        return func(*args, **kwargs)


def _meta_run(modules: list[nn.Module], layers: list[str], ranges, inputs: tuple):
    """Run the stages in turn on meta: each stage's hidden output (last: the loss), and the inputs it reads."""
    outs, reads, hidden = [], [], None
    for mod, (_, b) in zip(modules, ranges, strict=True):
        cut, b = mod.meshlib_cut, max(b, 1)
        cut.receives = tuple(range(len(inputs))) if cut.index else ()
        with _Touches(inputs) as seen, torch.no_grad():
            out = mod(*inputs) if cut.index == 0 else mod(hidden, *inputs)
        hidden = out if cut.last else out[0]
        if not torch.is_tensor(hidden) or (cut.last and (hidden.dim() or not hidden.is_floating_point())):
            what = "the model's forward must return the loss (a scalar)" if cut.last else f"layer {layers[b - 1]!r} "
            what += "" if cut.last else "must return the hidden state (a tensor)"
            raise ValueError(f"the split by module FQN: {what}, not {_describe(hidden)}")
        outs.append(hidden)
        reads.append(seen.found)
    return outs, reads


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__


def _boundary(name: str, t: torch.Tensor, grad: bool) -> Boundary:
    nbytes = math.prod(t.shape) * t.element_size()
    return Boundary(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes, grad)


def split_eager(
    model: nn.Module, /, *, reason: Untraceable, mesh: Mesh, call: Call, layers: list[str], ranges,
    costs: LayerCosts, options: Parallelism, pp_axis: str = "pp", microbatches: int = 1,
):  # fmt: skip
    """`(compiled, stages)` for an untraceable model: its `EagerStages` and a `Compiled` without a
    graph (what the runtime reads: parameters, layouts, inputs, options, the plan). `call` is the
    model's call on one global microbatch. Pure: every check runs here, before any process group exists."""
    from ..program import data_axes, input_layouts

    names = call.names
    try:
        in_layouts = input_layouts(call.tensors, options.in_specs, mesh, cp_layout=options.cp_layout)
    except ValueError as err:
        if options.uneven == "error":
            raise
        raise ValueError(
            f"{str(err).replace(UNEVEN_FIX, '')}. uneven={options.uneven!r} needs the traced graph: this model runs "
            "by module FQN, whose stages take even pieces only"
        ) from None
    data = data_axes(in_layouts, mesh)
    _check_supported(reason, mesh, pp_axis, data, options)
    own = next(model.parameters()).dtype
    precision = options.precision
    local = tuple(torch.empty(local_shape(tuple(x.shape), in_layouts[n], mesh.axis_sizes), dtype=x.dtype, device="meta")
                  for n, x in call.tensors.items())  # fmt: skip
    modules = stage_modules(model, layers, ranges, costs, local, call)
    compute = getattr(torch, precision.param)
    if compute != own:
        for mod in modules:
            mod.to(compute)  # the activations' dtype as the runtime computes them
    canon, aliases = canonical_params(model)
    stages = _stages(modules, layers, ranges, local, names, aliases)
    compiled = _compiled(model, reason, mesh, call, in_layouts, data, options, canon, aliases, stages)
    plan = compiled.plan
    plan = plan.replace(collectives=plan.collectives + _loss_mean(stages, data, mesh, microbatches))
    return dataclasses.replace(compiled, plan=plan), stages


def _compiled(model, reason: Untraceable, mesh: Mesh, call: Call, in_layouts, data, options, canon, aliases, stages):
    """The `Compiled` of an eager model: every parameter replicated, gradients summed over `data`."""
    from ..capture.moe import full_buffers
    from ..capture.trace import Traced
    from ..estimates.records import with_data_parallel
    from ..program import Compiled, EagerStages, model_state, persistent_buffers

    axes = Axes(mesh.axis_names, mesh.axis_sizes)
    layouts = {n: _annotate.spec_to_layout(P(), mesh) for n in canon}
    synced = {n for n, p in canon.items() if p.requires_grad} if data else set()
    traced = Traced(None, "eager", f"fx: {reason.fx}; torch.export: {reason.export}", canon, aliases, call)
    notes = {"trace": f"failed\nfx: {reason.fx}\nexport: {reason.export}", "sequence parallel": "off"}
    placements = {n: tuple(map(repr, lay)) for n, lay in layouts.items()}
    plan = Plan(mesh, specs={n: P() for n in canon}, notes=notes, placements=placements)
    plan = with_data_parallel(plan, data, options)
    compiled = Compiled(
        mesh=mesh, axes=axes, program=EagerStages(stages, None), traced=traced, comms=[], specials=[],
        param_specs=dict(plan.specs), param_layouts=layouts, input_layouts=in_layouts, input_names=call.names,
        plan=plan, options=options, buffers=dict(model.named_buffers()),
        persistent=persistent_buffers(model), data_axes=data, full_buffers=full_buffers(model),
        synced_params=frozenset(synced),
    )  # fmt: skip
    return dataclasses.replace(compiled, plan=plan.replace(memory=model_state(compiled)))


def _stages(modules, layers: list[str], ranges, local: tuple, names: list[str], aliases: dict) -> EagerStages:
    """Inputs, outputs, boundaries and parameters of each stage, from one meta run."""
    hidden, reads = _meta_run(modules, layers, ranges, local)
    n = len(modules)
    sent = [tuple(sorted(set().union(*reads[b + 1 :]))) for b in range(n - 1)]  # model inputs crossing boundary b
    for s, mod in enumerate(modules):
        mod.meshlib_cut.receives = sent[s - 1] if s else ()
        mod.meshlib_cut.sends = sent[s] if s < n - 1 else ()
    ins = [local] + [(hidden[b], *(local[i] for i in sent[b])) for b in range(n - 1)]
    outs = ins[1:] + [(hidden[-1],)]
    sends = [
        (_boundary(layers[max(ranges[b][1], 1) - 1], hidden[b], True),
         *(_boundary(names[i], local[i], False) for i in sent[b]))
        for b in range(n - 1)
    ] + [()]
    params = [{aliases.get(name, name) for name, _ in mod.named_parameters(remove_duplicate=False)} for mod in modules]
    return EagerStages(modules, list(ranges), ins, outs, sends, params)


def _check_supported(reason: Untraceable, mesh: Mesh, pp_axis: str, data, options: Parallelism):
    """The eager stages run pipeline and data parallelism only: anything else raises, naming both trace failures."""
    asked = [
        f"{a}={mesh.axis_size(a)}" for a in mesh.axis_names if a != pp_axis and a not in data and mesh.axis_size(a) > 1
    ]
    asked += [f"zero={options.zero}"] if options.zero >= 1 else []
    asked += ["sequence_parallel=True"] if options.sequence_parallel else []
    asked += [f"recompute={options.recompute!r}"] if options.recompute != "none" else []
    if asked:
        raise ValueError(
            f"the model cannot be traced (fx: {reason.fx}; torch.export: {reason.export}), so its pipeline stages are "
            f"cut from the eager model by module FQN, which runs pipeline and data parallelism only; this plan also "
            f"asks for {', '.join(asked)}. Fix: make the model traceable, e.g. no Python branches on tensor values or "
            "data pointers in forward and no calls torch.export cannot follow; or use a mesh with only dp and pp "
            "(zero=0, no sequence parallelism, no recompute)"
        )


def _loss_mean(stages: EagerStages, data: tuple[str, ...], mesh: Mesh, microbatches: int) -> tuple[Collective, ...]:
    """The last stage's loss, averaged over the data-parallel ranks in forward (every microbatch)."""
    if not data:
        return ()
    loss, group = stages.outputs[-1][0], math.prod(mesh.axis_size(a) for a in data)
    why = "mean over the data-parallel ranks"
    return (
        Collective("all_reduce", data, loss.element_size(), "loss", "loss", "", why, "forward", microbatches, group),
    )
