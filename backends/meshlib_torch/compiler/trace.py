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

import contextlib
import copy
import inspect
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

from .call import Call, LossChoiceError, describe, pick_loss
from .regions import current_modes, inline_regions, run_node_in_region

_TORCH_DIR = re.compile(r"[/\\](torch|meshlib_torch[/\\]compiler)[/\\]")


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
        while frame is not None and _TORCH_DIR.search(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["stack_trace"] = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}'
        modes = current_modes()
        if modes != self.modes:
            node.meta["region"] = modes
        return node


def trace(model: nn.Module, call: Call, /, *, count_flops: bool = False) -> Traced:
    """Trace `model` called as `call` (tensors of the global shape, any device); the graph returns the loss
    (`call.loss`, see `call.pick_loss`) and takes the call's tensors as inputs, by name."""
    canon, aliases = _canonical_params(model)
    try:
        gm = _fx(model, call)
        path, reason = "fx", ""
    except Exception as err:  # noqa: BLE001 - any tracer failure means: try export
        reason = _reason(err)
        try:
            gm = _export(model, call)
        except LossChoiceError:
            raise
        except Exception as export_err:  # noqa: BLE001 - both paths failed: say why, once each
            if isinstance(export_err.__cause__, LossChoiceError):
                raise export_err.__cause__ from None
            raise Untraceable(reason, _reason(export_err)) from export_err
        path = "export"
    _inline_leaf_modules(gm, model)
    inline_regions(gm)
    _canonicalize_attrs(gm, aliases)
    _split_linear_bias(gm)
    _split_addmm(gm)
    gm.graph.lint()
    gm.recompile()
    annotate_values(gm, call, count_flops=count_flops)
    _unflatten_matmuls(gm)
    if path == "fx":
        _select_output(gm, call)
    return Traced(gm, path, reason, canon, aliases, call)


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
    asserts = {torch._assert, fx._symbolic_trace._assert_is_none}
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
    gm.graph.eliminate_dead_code()
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
                add = graph.call_function(operator.add, (node, _autocast_bias(graph, node, bias)))
            add.meta = {k: v for k, v in node.meta.items() if k != "val"}
            node.replace_all_uses_with(add, delete_user_cb=lambda user, add=add: user is not add)


def _autocast_bias(graph: fx.Graph, op: fx.Node, bias: fx.Node) -> fx.Node:
    """The bias an op split from its bias adds: under autocast the fused op ran in the autocast dtype,
    so the bias is cast to it (else the add would promote the result back to fp32)."""
    dtype = next((m[2] for m in op.meta.get("region", ()) if m[0] == "autocast" and m[3]), None)
    if dtype is None:
        return bias
    with graph.inserting_before(op):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (bias,), {"dtype": dtype})
    cast.meta = {k: v for k, v in op.meta.items() if k != "val"}
    return cast


def _split_addmm(gm: fx.GraphModule) -> None:
    """`addmm(bias, x, w)` (Hugging Face's Conv1D) becomes `mm(x, w) + bias`: the bias is added once,
    after a row-parallel product's sum, as with a Linear's."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.addmm, torch.ops.aten.addmm.default):
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            continue
        bias, x, w = node.args
        with graph.inserting_before(node):
            mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
            mm.meta = {k: v for k, v in node.meta.items() if k != "val"}
            add = graph.call_function(torch.ops.aten.add.Tensor, (mm, _autocast_bias(graph, mm, bias)))
        add.meta = dict(mm.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)


def _unflatten_matmuls(gm: fx.GraphModule) -> None:
    """`x.view(-1, k) @ w (+ b)`, viewed back to `(*x.shape[:-1], n)` (Hugging Face's Conv1D), becomes
    `x @ w (+ b)` on `x` as it is: flattening batch and sequence into one dim would make a sequence
    shard (sequence parallelism) unsplittable, and gather it for nothing."""
    mms = {torch.ops.aten.mm.default, torch.mm}
    adds = {torch.ops.aten.add.Tensor, operator.add, torch.add}
    graph = gm.graph
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in mms]:
        flat, w = mm.args
        if not (isinstance(flat, fx.Node) and len(flat.users) == 1 and _is_view(flat) and len(mm.users) == 1):
            continue
        x = flat.args[0]
        shape = tuple(x.meta["val"].shape)
        if len(shape) < 3:
            continue
        last, add = next(iter(mm.users)), None
        if last.op == "call_function" and last.target in adds and len(last.users) == 1:
            add, last = last, next(iter(last.users))
        if not (_is_view(last) and tuple(last.meta["val"].shape)[:-1] == shape[:-1]):
            continue
        with graph.inserting_before(last):
            new = graph.call_function(torch.ops.aten.matmul.default, (x, w))
            new.meta = {**mm.meta, "val": last.meta["val"]}
            if add is not None:
                bias = add.args[1] if add.args[0] is mm else add.args[0]
                new = graph.call_function(torch.ops.aten.add.Tensor, (new, bias))
                new.meta = {**add.meta, "val": last.meta["val"]}
        last.replace_all_uses_with(new)
        for old in (last, add, mm, flat):
            if old is not None:
                graph.erase_node(old)
    graph.lint()
    gm.recompile()


def _is_view(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in (
        torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
        "view", "reshape", torch.reshape,
    )  # fmt: skip


# -- values -------------------------------------------------------------------------------
class _Recorder(fx.Interpreter):
    """Runs the graph, noting each node's value and, with a `FlopCounterMode`, its forward FLOPs."""

    def __init__(self, gm: fx.GraphModule, flops=None, fake: FakeTensorMode | None = None):
        super().__init__(gm)
        self.flops, self.fake = flops, fake

    def fetch_attr(self, target: str):
        # a fake copy of a real weight: the values recorded never reach (or keep alive) the weights
        attr = super().fetch_attr(target)
        return self.fake.from_tensor(attr) if self.fake is not None and torch.is_tensor(attr) else attr

    def run_node(self, n: fx.Node):
        before = self.flops.get_total_flops() if self.flops is not None else 0
        out = run_node_in_region(n, lambda: super(_Recorder, self).run_node(n))
        n.meta["val"] = out
        if self.flops is not None:
            n.meta["flops"] = self.flops.get_total_flops() - before
        return out


def annotate_values(gm: fx.GraphModule, call: Call, *, count_flops: bool = False) -> None:
    """Run `gm` on meta or fake tensors: every node gets `meta["val"]` (global shapes) and, with
    `count_flops`, `meta["flops"]` (its forward FLOPs, by torch's FlopCounterMode: the pipeline's
    stage cost, counted from shapes alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    tensors = list(gm.parameters()) + list(gm.buffers())
    inputs = list(call.tensors.values())
    counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    if tensors and all(t.is_meta for t in tensors):
        # meta kernels alone are several times faster than fake tensors (autocast regions: see regions.py)
        with counter:
            _Recorder(gm, counter if count_flops else None).run(*(torch.empty_like(x, device="meta") for x in inputs))
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, counter:
        fakes = [mode.from_tensor(torch.empty_like(x, device=device)) for x in inputs]
        _Recorder(gm, counter if count_flops else None, mode).run(*fakes)


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
