"""Pass 1, trace: an `nn.Module` to a normalized fx graph with global shapes.

torch.fx's symbolic tracer is tried first; where it fails (data-dependent
control flow, an `assert` on a traced value, ...) torch.export takes over and
the plan records which path was used and why. When both fail, `trace` raises
`Untraceable` with both reasons.

The graph is then normalized so that later passes see one vocabulary:
- leaf modules (Linear, Embedding, LayerNorm, RMSNorm, activations, Dropout)
  become functional calls on `get_attr` parameters;
- a Linear's bias becomes its own `add`, so that a row-parallel matmul can
  add it once, after the reduction;
- parameters are named by their canonical FQN (tied weights share one name);
- every node carries `meta["val"]`: a fake tensor with the global shape and
  dtype, or the Python value of a shape computation.
"""

from __future__ import annotations

import operator
import re
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

_TORCH_DIR = re.compile(r"[/\\](torch|meshlib_torch[/\\]compiler)[/\\]")


@dataclass
class Traced:
    gm: fx.GraphModule
    path: str  # "fx" or "export"
    reason: str = ""  # why symbolic tracing failed, when path == "export"
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical FQN -> parameter
    aliases: dict[str, str] = field(default_factory=dict)  # every FQN -> canonical FQN


class _Tracer(fx.Tracer):
    """fx's tracer, proxying buffers too, and noting each node's innermost user frame
    (fx's own stack traces cost more than the rest of tracing together)."""

    proxy_buffer_attributes = True

    def __init__(self, model: nn.Module):
        super().__init__()
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
        while frame is not None and _TORCH_DIR.search(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["stack_trace"] = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}'
        return node


def trace(model: nn.Module, example_inputs: tuple, /) -> Traced:
    """Trace `model` called on `example_inputs` (tensors of the global shape, any device)."""
    canon, aliases = _canonical_params(model)
    try:
        graph = _Tracer(model).trace(model)
        gm = fx.GraphModule(model, graph)
        path, reason = "fx", ""
    except Exception as err:  # noqa: BLE001 - any tracer failure means: try export
        reason = _reason(err)
        try:
            gm = _export(model, example_inputs)
        except Exception as export_err:  # noqa: BLE001 - both paths failed: say why, once each
            raise Untraceable(reason, _reason(export_err)) from export_err
        path = "export"
    _inline_leaf_modules(gm, model)
    _canonicalize_attrs(gm, aliases)
    _split_linear_bias(gm)
    gm.graph.lint()
    gm.recompile()
    annotate_values(gm, example_inputs)
    return Traced(gm, path, reason, canon, aliases)


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


def _reason(err: BaseException) -> str:
    """`Type: first line of the message at file.py:LINE`."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{_where(err)}"


def _where(err: BaseException) -> str:
    """` at file.py:LINE`: the last frame of user code in the traceback."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not _TORCH_DIR.search(f.filename)]
    return f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""


def _canonical_params(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    first: dict[int, str] = {}
    canon: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        main = first.setdefault(id(p), name)
        aliases[name] = main
        if main == name:
            canon[name] = p
    return canon, aliases


def _export(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args = tuple(torch.empty_like(x, device=device) if torch.is_tensor(x) else x for x in example_inputs)
    ep = torch.export.export(model, args, strict=False)
    gm = ep.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return gm


# -- normalization ---------------------------------------------------------------------
def _get_attr(graph: fx.Graph, node: fx.Node, prefix: str, name: str) -> fx.Node | None:
    with graph.inserting_before(node):
        return graph.get_attr(f"{prefix}.{name}" if prefix else name)


def _module_call(graph: fx.Graph, node: fx.Node, mod: nn.Module) -> tuple | None:
    """(function, args, kwargs) replacing a call to leaf module `mod`, or None to drop it."""
    x, prefix = node.args[0], node.target
    attr = lambda name: _get_attr(graph, node, prefix, name)  # noqa: E731
    if isinstance(mod, nn.Linear):
        return F.linear, (x, attr("weight"), attr("bias") if mod.bias is not None else None), {}
    if isinstance(mod, nn.Embedding):
        return F.embedding, (x, attr("weight")), {"padding_idx": mod.padding_idx}
    if isinstance(mod, nn.LayerNorm):
        w = attr("weight") if mod.weight is not None else None
        b = attr("bias") if mod.bias is not None else None
        return F.layer_norm, (x, tuple(mod.normalized_shape), w, b, mod.eps), {}
    if isinstance(mod, nn.RMSNorm):
        w = attr("weight") if mod.weight is not None else None
        return F.rms_norm, (x, tuple(mod.normalized_shape), w, mod.eps), {}
    if isinstance(mod, nn.Dropout):
        return (F.dropout, (x, mod.p, mod.training), {}) if mod.p > 0 and mod.training else None
    if isinstance(mod, nn.Identity):
        return None
    simple = {nn.GELU: F.gelu, nn.SiLU: F.silu, nn.ReLU: F.relu, nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid}
    for cls, fn in simple.items():
        if type(mod) is cls:
            kwargs = {"approximate": mod.approximate} if cls is nn.GELU else {}
            return fn, (x,), kwargs
    raise NotImplementedError(
        f"module {prefix!r} of type {type(mod).__name__} is a tracing leaf the compiler has no rule for. "
        "Fix: write it with torch functions the compiler knows, or file an issue with the module"
    )


def _inline_leaf_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = model.get_submodule(node.target)
        call = _module_call(graph, node, mod)
        if call is None:
            node.replace_all_uses_with(node.args[0])
        else:
            fn, args, kwargs = call
            with graph.inserting_before(node):
                new = graph.call_function(fn, args, kwargs)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
        graph.erase_node(node)
    # get_attr targets on the original model (fx path) must exist on gm
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_attr(gm, node.target):
            _set_attr(gm, node.target, _resolve(model, node.target))


def _has_attr(mod: nn.Module, target: str) -> bool:
    try:
        _resolve(mod, target)
        return True
    except AttributeError:
        return False


def _resolve(mod: nn.Module, target: str):
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod


def _set_attr(root: nn.Module, target: str, value) -> None:
    *parents, last = target.split(".")
    mod = root
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(last, value)
    elif torch.is_tensor(value):
        mod.register_buffer(last, value)
    else:
        setattr(mod, last, value)


def _canonicalize_attrs(gm: fx.GraphModule, aliases: dict[str, str]) -> None:
    """One get_attr node per parameter, named by its canonical FQN."""
    seen: dict[str, fx.Node] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        target = aliases.get(node.target, node.target)
        if target in seen:
            node.replace_all_uses_with(seen[target])
            graph.erase_node(node)
            continue
        if target != node.target:
            if not _has_attr(gm, target):
                _set_attr(gm, target, _resolve(gm, node.target))
            node.target = target
        node.meta["param"] = target in aliases.values()
        seen[target] = node


def _split_linear_bias(gm: fx.GraphModule) -> None:
    graph = gm.graph
    linears = {F.linear, torch.ops.aten.linear.default}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in linears:
            args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
            bias = args[2]
            if bias is None:
                continue
            node.args, node.kwargs = (args[0], args[1]), {}
            with graph.inserting_after(node):
                add = graph.call_function(operator.add, (node, bias))
            add.meta = {k: v for k, v in node.meta.items() if k != "val"}
            node.replace_all_uses_with(add, delete_user_cb=lambda user, add=add: user is not add)


# -- values -------------------------------------------------------------------------------
class _Recorder(fx.Interpreter):
    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def annotate_values(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Run `gm` on fake tensors; every node gets `meta["val"]` (global shapes)."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    if tensors and all(t.is_meta for t in tensors):
        # meta kernels alone are several times faster than fake tensors
        metas = tuple(torch.empty_like(x, device="meta") if torch.is_tensor(x) else x for x in example_inputs)
        _Recorder(gm).run(*metas)
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = tuple(mode.from_tensor(x.to(device)) if torch.is_tensor(x) else x for x in example_inputs)
        _Recorder(gm).run(*fakes)


def source_line(node: fx.Node) -> str:
    """`file.py:LINE` of the user code that made `node` (outside torch itself)."""
    if node.op == "output":
        return "(graph output)"
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    user = [(f, ln) for f, ln in frames if not _TORCH_DIR.search(f)]
    if not user:
        return ""
    path, line = user[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"
