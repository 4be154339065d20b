"""The op vocabulary: every fx target the compiler knows, bound to canonical names.

torch.fx's symbolic tracer gives torch-level calls (`F.linear`, `x.view(...)`,
`operator.add`); torch.export gives ATen overloads (`aten.linear.default`).
`bind(node)` maps either to one `OpView`: a canonical kind, the tensor inputs
in a fixed order, and the other arguments by name. The rules in `ops.py` and
the rewrites in `localize.py` only ever see `OpView`s.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...spmd.mapped import ShardMapped

aten = torch.ops.aten


@dataclass
class OpView:
    node: fx.Node
    kind: str
    p: dict[str, Any] = field(default_factory=dict)  # bound arguments by canonical name
    tensors: list[fx.Node] = field(default_factory=list)  # tensor inputs, in rule order
    # while a rule runs for one mesh axis: the inputs' and the output's shapes on a rank after the
    # earlier axes' shards (a shard's groups count in those); None: the global shapes
    local: tuple[list[tuple[int, ...]], tuple[int, ...]] | None = None
    axis: int = -1  # while a rule runs: the index of the mesh axis it runs for

    @property
    def out(self):
        return self.node.meta.get("val")

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.out.shape)

    def shape(self, x: fx.Node) -> tuple[int, ...]:
        return tuple(x.meta["val"].shape)


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and torch.is_tensor(x.meta.get("val"))


# kind -> ([(target, argument names in positional order)], tensor argument names in rule order)
_SPECS: dict[str, tuple[list[tuple[Any, tuple[str, ...]]], tuple[str, ...]]] = {}
_TABLE: dict[Any, tuple[str, tuple[str, ...]]] = {}


def _method(name: str) -> tuple[str, str]:
    return ("method", name)


def _register(kind: str, tensors: tuple[str, ...], *targets: tuple[Any, tuple[str, ...]]) -> None:
    _SPECS[kind] = (list(targets), tensors)
    for target, names in targets:
        _TABLE[target] = (kind, names)


X = ("x",)
_BINARY = ("x", "y", "alpha")
for _kind, _fns in {
    "add": (operator.add, torch.add, aten.add.Tensor, aten.add.Scalar, _method("add"), operator.iadd, aten.add_.Tensor),
    "sub": (operator.sub, torch.sub, aten.sub.Tensor, aten.sub.Scalar, _method("sub")),
    "mul": (operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar, _method("mul"), operator.imul),
    "div": (operator.truediv, torch.div, aten.div.Tensor, aten.div.Scalar, _method("div"), aten.div_.Tensor),
}.items():  # torch.export keeps `x /= y` as `aten.div_`, later reads of x naming its node: it is `div` here
    _register(_kind, ("x", "y"), *((fn, _BINARY) for fn in _fns))

_UNARY_NONLINEAR = {
    "gelu": (F.gelu, aten.gelu.default),
    "silu": (F.silu, aten.silu.default),
    "relu": (F.relu, torch.relu, aten.relu.default),
    "tanh": (torch.tanh, aten.tanh.default, _method("tanh")),
    "sigmoid": (torch.sigmoid, aten.sigmoid.default, _method("sigmoid")),
    "exp": (torch.exp, aten.exp.default, _method("exp")),
    "log": (torch.log, aten.log.default, _method("log")),
    "rsqrt": (torch.rsqrt, aten.rsqrt.default, _method("rsqrt")),
    "sqrt": (torch.sqrt, aten.sqrt.default, _method("sqrt")),
    "pow": (torch.pow, aten.pow.Tensor_Scalar, _method("pow"), operator.pow),
    "abs": (torch.abs, aten.abs.default, _method("abs")),
    "cos": (torch.cos, aten.cos.default, _method("cos")),
    "sin": (torch.sin, aten.sin.default, _method("sin")),
    "erf": (torch.erf, aten.erf.default, _method("erf")),
    "log1p": (torch.log1p, aten.log1p.default, _method("log1p")),
    "reciprocal": (torch.reciprocal, aten.reciprocal.default, _method("reciprocal")),
    "square": (torch.square, aten.square.default, _method("square")),
    "sign": (torch.sign, aten.sign.default, _method("sign")),
    "rounding": (torch.floor, torch.ceil, torch.round, aten.floor.default, aten.ceil.default, aten.round.default),
    "clamp": (
        torch.clamp, aten.clamp.default, _method("clamp"), aten.clamp_min.default, aten.clamp_max.default,
        _method("clamp_min"), _method("clamp_max"),
    ),
    "softplus": (F.softplus, aten.softplus.default),
    "not": (
        torch.logical_not, aten.logical_not.default, _method("logical_not"), torch.bitwise_not,
        aten.bitwise_not.default, _method("bitwise_not"), operator.invert, torch.isnan, aten.isnan.default,
    ),
}
for _kind, _fns in _UNARY_NONLINEAR.items():
    _register("unary", X, *((fn, ("x", "a1", "a2")) for fn in _fns))

_register(
    "linear_unary",
    X,
    *(
        (fn, ("x", "a1", "a2", "a3"))
        for fn in (
            operator.neg, torch.neg, aten.neg.default, _method("neg"),
            _method("contiguous"), aten.contiguous.default, _method("clone"), torch.clone, aten.clone.default,
            _method("detach"), aten.detach.default, _method("float"), _method("double"), _method("half"),
            _method("bfloat16"), _method("to"), aten._to_copy.default, aten.to.dtype, aten.alias.default,
            aten.to.dtype_layout, aten.to.device, aten.to.other, aten.detach_.default, _method("type_as"),
            aten.type_as.default, _method("detach_"),
        )
    ),
)  # fmt: skip
# elementwise ops of several tensors that are not linear in any of them: comparisons, logic, min/max
_register(
    "pointwise",
    ("x", "y"),
    *(
        (fn, ("x", "y"))
        for fn in (
            operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
            torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.maximum, torch.minimum,
            torch.logical_and, torch.logical_or, torch.bitwise_and, torch.bitwise_or,
            _method("eq"), _method("ne"), _method("lt"), _method("le"), _method("gt"), _method("ge"),
            aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
            aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
            aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
            aten.logical_and.default, aten.logical_or.default, aten.maximum.default, aten.minimum.default,
            aten.pow.Tensor_Tensor, aten.rsub.Scalar, aten.rsub.Tensor,
        )
    ),
)  # fmt: skip
_register(
    "scan",
    X,
    (torch.cumsum, ("x", "dim", "dtype")), (_method("cumsum"), ("x", "dim", "dtype")),
    (aten.cumsum.default, ("x", "dim", "dtype")),
)  # fmt: skip
_register(
    "diff",
    ("x", "prepend", "append"),
    (torch.diff, ("x", "n", "dim", "prepend", "append")), (_method("diff"), ("x", "n", "dim", "prepend", "append")),
    (aten.diff.default, ("x", "n", "dim", "prepend", "append")),
)  # fmt: skip
_register(
    "pad",
    X,
    (F.pad, ("x", "pad", "mode", "value")), (aten.pad.default, ("x", "pad", "mode", "value")),
    (aten.constant_pad_nd.default, ("x", "pad", "value")),
)  # fmt: skip
_register(
    "new",
    X,
    *(
        (fn, ("x", "size"))
        for fn in (
            _method("new_ones"), _method("new_zeros"), _method("new_full"), _method("new_empty"), _method("new_tensor"),
            aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
        )
    ),
)  # fmt: skip
_register(
    "gather",
    ("x", "index"),
    (torch.gather, ("x", "dim", "index")), (_method("gather"), ("x", "dim", "index")),
    (aten.gather.default, ("x", "dim", "index")),
)  # fmt: skip
_register(
    "index_select",
    ("x", "index"),
    (torch.index_select, ("x", "dim", "index")), (_method("index_select"), ("x", "dim", "index")),
    (aten.index_select.default, ("x", "dim", "index")),
)  # fmt: skip
_register("index_tensor", (), (aten.index.Tensor, ("x", "indices")))
_register("stack", (), (torch.stack, ("tensors", "dim")), (aten.stack.default, ("tensors", "dim")))
_register(
    "unbind",
    X,
    (torch.unbind, ("x", "dim")), (_method("unbind"), ("x", "dim")), (aten.unbind.int, ("x", "dim")),
)  # fmt: skip
_register(
    "scatter",
    ("x", "index", "src"),
    *((fn, ("x", "dim", "index", "src")) for fn in (
        torch.scatter, _method("scatter"), _method("scatter_"), torch.scatter_add, _method("scatter_add"),
        _method("scatter_add_"), aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_.src,
        aten.scatter_.value, aten.scatter_add_.default,
    )),
)  # fmt: skip
_register(
    "histc",
    X,
    *((fn, ("x", "bins", "min", "max")) for fn in (torch.histc, _method("histc"), aten.histc.default)),
)  # fmt: skip
_register(
    "topk",
    X,
    (torch.topk, ("x", "k", "dim", "largest", "sorted")), (_method("topk"), ("x", "k", "dim", "largest", "sorted")),
    (aten.topk.default, ("x", "k", "dim", "largest", "sorted")),
)  # fmt: skip
_register("dropout", X, (F.dropout, ("x", "p", "training")), (aten.dropout.default, ("x", "p", "training")))
_register(
    "where",
    ("cond", "x", "y"),
    *((fn, ("cond", "x", "y")) for fn in (torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)),
)
_register(
    "masked_fill",
    ("x", "mask", "value"),
    (_method("masked_fill"), ("x", "mask", "value")),
    (aten.masked_fill.Scalar, ("x", "mask", "value")),
    (aten.masked_fill.Tensor, ("x", "mask", "value")),
)
for _name, _fns in {
    "sum": (torch.sum, aten.sum.dim_IntList, _method("sum")),
    "mean": (torch.mean, aten.mean.dim, _method("mean")),
}.items():
    _register(_name, X, *((fn, ("x", "dim", "keepdim", "dtype")) for fn in _fns))
_SPECS["sum"][0].append((aten.sum.default, ("x", "dtype")))
_SPECS["mean"][0].append((aten.mean.default, ("x", "dtype")))
_TABLE[aten.sum.default] = ("sum", ("x", "dtype"))
_TABLE[aten.mean.default] = ("mean", ("x", "dtype"))
_register(
    "softmax",
    X,
    (F.softmax, ("x", "dim", "_stacklevel", "dtype")),
    (torch.softmax, ("x", "dim", "dtype")),
    (_method("softmax"), ("x", "dim", "dtype")),
    (aten.softmax.int, ("x", "dim", "dtype")),
    (aten._softmax.default, ("x", "dim", "half_to_float")),
    (F.log_softmax, ("x", "dim", "_stacklevel", "dtype")),
    (aten.log_softmax.int, ("x", "dim", "dtype")),
    (aten._log_softmax.default, ("x", "dim", "half_to_float")),
)
_register(
    "norm",
    ("x", "weight", "bias"),
    (F.layer_norm, ("x", "normalized_shape", "weight", "bias", "eps")),
    (aten.layer_norm.default, ("x", "normalized_shape", "weight", "bias", "eps")),
    (F.rms_norm, ("x", "normalized_shape", "weight", "eps")),
    (aten.rms_norm.default, ("x", "normalized_shape", "weight", "eps")),
)
_register(
    "embedding",
    ("ids", "weight"),
    (F.embedding, ("ids", "weight", "padding_idx", "max_norm")),
    (aten.embedding.default, ("weight", "ids", "padding_idx")),
)
_register("linear", ("x", "w"), (F.linear, ("x", "w", "bias")), (aten.linear.default, ("x", "w", "bias")))
_register(
    "matmul",
    ("x", "y"),
    *(
        (fn, ("x", "y"))
        for fn in (
            torch.matmul, operator.matmul, _method("matmul"), aten.matmul.default,
            torch.bmm, aten.bmm.default, torch.mm, aten.mm.default,
        )
    ),
)
_register("einsum", (), (torch.einsum, ("equation",)), (aten.einsum.default, ("equation", "operands")))
_register(
    "sdpa",
    ("q", "k", "v", "attn_mask"),
    *(
        (fn, ("q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
        for fn in (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
    ),
)
_register(
    "cross_entropy",
    ("logits", "target"),
    (
        F.cross_entropy,
        ("logits", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"),
    ),
    (
        aten.cross_entropy_loss.default,
        ("logits", "target", "weight", "reduction", "ignore_index", "label_smoothing"),
    ),
)
_VIEWS = (
    _method("view"), _method("reshape"), torch.reshape, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, _method("flatten"), torch.flatten, aten.flatten.using_ints, _method("unflatten"),
    torch.unflatten, aten.unflatten.int,
    _method("unsqueeze"), torch.unsqueeze, aten.unsqueeze.default, _method("squeeze"), torch.squeeze,
    aten.squeeze.dim, aten.squeeze.default, _method("view_as"), _method("reshape_as"),
)  # fmt: skip
_register("view", X, *((fn, ("x", "a1", "a2", "a3", "a4", "a5", "a6")) for fn in _VIEWS))
_register(
    "transpose",
    X,
    (_method("transpose"), ("x", "d0", "d1")),
    (torch.transpose, ("x", "d0", "d1")),
    (aten.transpose.int, ("x", "d0", "d1")),
    (_method("t"), ("x",)),
    (aten.t.default, ("x",)),
)
_register(
    "permute",
    X,
    (_method("permute"), ("x", "a1", "a2", "a3", "a4", "a5")),
    (torch.permute, ("x", "dims")),
    (aten.permute.default, ("x", "dims")),
)
_register(
    "expand",
    X,
    (_method("expand"), ("x", "a1", "a2", "a3", "a4", "a5")),
    (aten.expand.default, ("x", "size")),
    (_method("expand_as"), ("x", "other")),
)
_register(
    "repeat_interleave",
    X,
    (_method("repeat_interleave"), ("x", "repeats", "dim")),
    (torch.repeat_interleave, ("x", "repeats", "dim")),
    (aten.repeat_interleave.self_int, ("x", "repeats", "dim")),
)
_register(
    "split",
    X,
    (_method("split"), ("x", "size", "dim")),
    (torch.split, ("x", "size", "dim")),
    (aten.split.Tensor, ("x", "size", "dim")),
    (aten.split_with_sizes.default, ("x", "size", "dim")),
    (_method("chunk"), ("x", "chunks", "dim")),
    (torch.chunk, ("x", "chunks", "dim")),
    (aten.chunk.default, ("x", "chunks", "dim")),
)
_register("cat", (), (torch.cat, ("tensors", "dim")), (aten.cat.default, ("tensors", "dim")))
_register(
    "slice",
    X,
    (aten.slice.Tensor, ("x", "dim", "start", "end", "step")),
    (_method("narrow"), ("x", "dim", "start", "length")),
)
_register("select", X, (aten.select.int, ("x", "dim", "index")))
_register(
    "tri",
    X,
    *(
        (fn, ("x", "diagonal"))
        for fn in (torch.tril, torch.triu, aten.tril.default, aten.triu.default, _method("tril"), _method("triu"))
    ),
)
_register(
    "like",
    X,
    *(
        (fn, ("x", "a1", "a2"))
        for fn in (
            torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
            aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
        )
    ),
)
_register(
    "create",
    (),
    *(
        (fn, ())
        for fn in (
            torch.arange, aten.arange.start, aten.arange.default, aten.arange.start_step, torch.zeros, torch.ones,
            torch.full, torch.empty, torch.tensor, aten.zeros.default, aten.ones.default, aten.full.default,
            aten.empty.memory_format, aten.scalar_tensor.default, aten.lift_fresh_copy.default, torch.eye,
            aten.eye.default, torch.linspace, aten.linspace.default,
        )
    ),
)  # fmt: skip
_DROP = {aten._assert_tensor_metadata.default, aten.sym_constrain_range_for_size.default, aten._assert_scalar.default}


def bind(node: fx.Node) -> OpView:
    """The canonical view of `node` (kind "scalar" for shape arithmetic, "unknown" otherwise)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return OpView(node, node.op)
    target = _method(node.target) if node.op == "call_method" else node.target
    if target in _DROP:
        return OpView(node, "drop")
    val = node.meta.get("val")
    if node.op == "call_function" and target is operator.getitem:
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if isinstance(src, (list, tuple)) and not isinstance(src, torch.Size):
            return OpView(node, "item", {"index": node.args[1]}, [node.args[0]])
        if torch.is_tensor(src):
            return OpView(node, "index", {"index": node.args[1]}, [node.args[0]])
    if not torch.is_tensor(val) and not (isinstance(val, (list, tuple)) and val and torch.is_tensor(val[0])):
        return OpView(node, "scalar")
    if isinstance(target, ShardMapped):  # a region of per-shard code: its specs are its rule
        return OpView(node, "shard_map", {"fn": target}, [a for a in node.args if is_tensor_node(a)])
    if target not in _TABLE:
        return OpView(node, "unknown", {}, [a for a in node.all_input_nodes if is_tensor_node(a)])
    kind, names = _TABLE[target]
    p = dict(zip(names, node.args))
    p.update(node.kwargs)
    p["_target"] = target
    tensor_names = _SPECS[kind][1]
    if kind == "einsum":
        ops = p.get("operands", node.args[1:])
        ops = ops[0] if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else ops
        return OpView(node, kind, p, list(ops))
    if kind in ("cat", "stack"):
        return OpView(node, kind, p, [t for t in p["tensors"] if is_tensor_node(t)])
    if kind == "index_tensor":
        return OpView(node, kind, p, [p["x"]] + [i for i in p["indices"] if is_tensor_node(i)])
    if kind == "linear_unary" and target in (_method("type_as"), aten.type_as.default):
        p.pop("a1", None)
    if kind == "add" and p.get("alpha") not in (None, 1):
        kind = "unknown"
    tensors = [p[name] for name in tensor_names if is_tensor_node(p.get(name))]
    if kind in ("add", "sub", "mul", "div"):
        p["scalar_operand"] = len(tensors) < 2
    return OpView(node, kind, p, tensors)


def dims_arg(p: dict, ndim: int) -> tuple[int, ...] | None:
    """The `dim` argument of a reduction as non-negative ints (None: all dims)."""
    d = p.get("dim")
    if d is None:
        return None
    dims = (d,) if isinstance(d, int) else tuple(d)
    return tuple(x % ndim for x in dims) if dims else None


def numel(shape) -> int:
    return math.prod(shape)
