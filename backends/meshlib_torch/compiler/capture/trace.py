"""Trace: an `nn.Module` to an fx graph that takes the call's tensors and returns the loss.

torch.fx's symbolic tracer is tried first; where it fails (data-dependent
control flow, an `assert` on a traced value, keyword inputs that land in
`**kwargs`, ...) torch.export takes over and the plan records which path was
used and why. When both fail, `trace` raises `Untraceable` with both reasons.
The graph is then normalized (`normalize.py`, `regions.py`) and every node
gets its global value (`values.py`).
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ...torch_private import FX_ASSERTS
from ..attrs import canonical_params
from .call import Call, LossChoiceError, describe, pick_loss
from .effects import eliminate_dead_code
from .normalize import (
    canonicalize_attrs,
    cat_filled_buffers,
    drop_device_moves,
    inline_leaf_modules,
    split_addmm,
    split_linear_bias,
    unflatten_matmuls,
)
from .regions import current_modes, inline_regions
from .shard_maps import restore_shard_maps
from .source import TORCH_DIR
from .source import reason as failure
from .values import annotate_values


@dataclass
class Traced:
    gm: fx.GraphModule
    path: str  # "fx" or "export"
    reason: str = ""  # why symbolic tracing failed, when path == "export"
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical FQN -> parameter
    aliases: dict[str, str] = field(default_factory=dict)  # every FQN -> canonical FQN
    call: Call | None = None  # the example call: graph inputs by name, constants, the loss output


class _Tracer(fx.Tracer):
    """fx's tracer, proxying buffers too, noting each node's innermost user frame (fx's own stack
    traces cost more than the rest of tracing together) and the grad and autocast modes it ran in."""

    proxy_buffer_attributes = True

    def __init__(self, model: nn.Module):
        super().__init__()
        self.modes = current_modes()  # a `no_grad` or `autocast` block of the forward differs from these
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        self._names: dict[int, str] = {}
        for name, t in named:
            self._names.setdefault(id(t), name)

    def getattr(self, attr: str, attr_val, parameter_proxy_cache: dict):
        # fx looks each parameter up by scanning all of them (quadratic on deep models)
        name = self._names.get(id(attr_val)) if torch.is_tensor(attr_val) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and TORCH_DIR.search(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["stack_trace"] = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}'
        modes = current_modes()
        if modes != self.modes:
            node.meta["region"] = modes
        return node


def trace(model: nn.Module, call: Call, /, *, count_flops: bool = False, compute: torch.dtype | None = None) -> Traced:
    """Trace `model` called as `call` (tensors of the global shape, any device); the graph returns the loss
    (`call.loss`, see `call.pick_loss`) and takes the call's tensors as inputs, by name. `compute`: the
    dtype the parameters compute in, when not the model's own (bf16 mixed precision)."""
    canon, aliases = canonical_params(model)
    subject = model
    try:
        gm = _fx(model, call)
        path, reason = "fx", ""
    except Exception as err:  # noqa: BLE001 - any tracer failure means: try export
        reason = failure(err)
        # torch.export writes down the dtypes it sees (`x.to(x_dtype)` becomes a cast to fp32 in an fp32
        # model): trace the model as it will compute, on meta copies of its tensors in `compute`
        subject = in_dtype(model, compute) if compute is not None else model
        try:
            gm = _export(subject, call)
        except LossChoiceError:
            raise
        except Exception as export_err:  # noqa: BLE001 - both paths failed: say why, once each
            if isinstance(export_err.__cause__, LossChoiceError):
                raise export_err.__cause__ from None
            raise Untraceable(reason, failure(export_err)) from export_err
        path = "export"
    inline_leaf_modules(gm, subject)
    inline_regions(gm)
    drop_device_moves(gm)
    canonicalize_attrs(gm, aliases)
    split_linear_bias(gm)
    split_addmm(gm)
    cat_filled_buffers(gm)
    gm.graph.lint()
    gm.recompile()
    annotate_values(gm, call, count_flops=count_flops)
    unflatten_matmuls(gm)
    if path == "fx":
        _select_output(gm, call)
    return Traced(gm, path, reason, canon, aliases, call)


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` itself when its floating tensors are all `dtype`; else a copy of its modules whose
    parameters and buffers are empty meta tensors, the floating ones in `dtype` (nothing is copied)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.dtype == dtype or not t.is_floating_point() for t in tensors):
        return model
    cast = lambda t: torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    memo = {id(p): nn.Parameter(cast(p), requires_grad=p.requires_grad) for p in model.parameters()}
    memo |= {id(b): cast(b) for b in model.buffers()}
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a module that cannot be copied is traced as it is
        return model


class Untraceable(ValueError):
    """Neither torch.fx nor torch.export could trace the model; `fx` and `export` say why (one line each).

    A pipeline then splits the eager model by module FQN instead (see `fqn_split`).
    """

    def __init__(self, fx: str, export: str):
        self.fx, self.export = fx, export
        super().__init__(
            f"the model cannot be traced.\n  fx: {fx}\n  torch.export: {export}\nFix: make its forward traceable "
            "(no Python branches on tensor values or data pointers, no calls torch.export cannot follow); a pipeline "
            "over a mesh with only dp and pp cuts the eager model into stages instead"
        )


def _fx(model: nn.Module, call: Call) -> fx.GraphModule:
    """torch.fx's symbolic trace, every non-tensor argument fixed to its value in `call`."""
    sig = call.signature
    if sig is None:
        raise TypeError("the forward has no signature to trace")
    params = sig.parameters
    var = [n for n in call.tensors if n not in params or params[n].kind is inspect.Parameter.VAR_POSITIONAL]
    if var:
        raise TypeError(f"inputs {var} go through *args or **kwargs, which fx cannot name")
    concrete = {}
    for name, p in params.items():
        if name in call.tensors or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        concrete[name] = call.constants.get(name, p.default)
    graph = _Tracer(model).trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(model, graph)
    _drop_fixed_inputs(gm, set(call.tensors))
    return gm


def _drop_fixed_inputs(gm: fx.GraphModule, tensors: set[str]) -> None:
    """fx keeps a fixed (concrete) argument as a placeholder guarded by asserts: drop both, using its value."""
    graph = gm.graph
    asserts = FX_ASSERTS
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.target not in tensors]:
        value = node.args[0] if node.args else None
        guarded = [u for u in node.users if u.target in asserts]
        chained = [u for u in node.users if any(v.target in asserts for v in u.users)]
        for g in guarded + [v for u in chained for v in u.users if v.target in asserts]:
            graph.erase_node(g)
        for u in chained:
            if not u.users:
                graph.erase_node(u)
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a, node=node, value=value: value if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, node=node, value=value: value if a is node else a)
        graph.erase_node(node)


def _select_output(gm: fx.GraphModule, call: Call) -> None:
    """Make the fx graph return the loss alone (`pick_loss` on the traced output's values)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    nodes = {}

    def val(a: fx.Node):
        v = a.meta.get("val")
        nodes[id(v)] = a
        return v

    structure = fx.node.map_arg(out.args[0], val)
    picked = pick_loss(structure, call.loss)
    if id(picked) not in nodes:
        raise ValueError(
            f"loss={call.loss!r} must pick one of the model's outputs ({describe(structure)}) when the model traces "
            "with torch.fx; compute anything else in the forward"
        )
    out.args = (nodes[id(picked)],)
    eliminate_dead_code(gm.graph)
    gm.recompile()


def _calling(model: nn.Module, call: Call) -> nn.Module:
    """`model` (its parameters, buffers and FQNs) with a forward that takes the call's tensors by name,
    passes the fixed values, and returns the loss: what torch.export traces."""
    cls = type(model)

    def forward(self, **tensors):
        args, kwargs = call.arguments(tensors)
        return pick_loss(cls.forward(self, *args, **kwargs), call.loss)

    view = copy.copy(model)  # shares the parameter and module dicts: same tensors, same names
    view.__class__ = type(f"{cls.__name__}Call", (cls,), {"forward": forward, "__module__": cls.__module__})
    return view


def _export(model: nn.Module, call: Call) -> fx.GraphModule:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # fresh tensors: export merges inputs that are the same tensor (ids passed as labels too)
    tensors = {n: torch.empty_like(x, device=device) for n, x in call.tensors.items()}
    ep = torch.export.export(_calling(model, call), (), tensors, strict=False)
    gm = ep.module()
    restore_shard_maps(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0]
    out.args = (flat[0] if isinstance(flat, (tuple, list)) and len(flat) == 1 else flat,)
    gm.graph.set_codegen(fx.graph.CodeGen())  # plain inputs in, the loss out (no pytree specs)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(holders, call.tensors, strict=True):
        node.target = name  # export may rename an input that shadows another name
    eliminate_dead_code(gm.graph)
    return gm


# -- normalization ---------------------------------------------------------------------


# -- values -------------------------------------------------------------------------------


