"""The rank-dependent ops: ops whose local form depends on the rank, one registry entry each.

An entry says everything the compiler needs of its kind: which nodes become it (`select`, by the
view's kind and its placements), its arguments (`args`, a `SpecialSpec`'s, from the node's
placements), and the collectives it runs, for the plan (`records`). The module that runs it on a
rank, in a real step or a dry run, is built from the same kind by `modules.special.special_module`.
A new rank-dependent op is one entry here and one builder there:

- `vocab_embedding`: an embedding whose table is split by rows over an axis its ids are not
  (Megatron's vocab-parallel embedding); its output is a partial sum there;
- `cross_entropy`: a loss over logits split by classes (loss-parallel) and/or rows;
- `shard_map`: a region of per-shard code (`meshlib_torch.shard_map`) traced as one node.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .bind import aten, bind
from .placements import Partial, Shard
from .propagate import Axes, NodePlan
from .shapes import local_shape


@dataclass(frozen=True)
class SpecialSpec:
    """A rank-dependent op of the compiled graph (`kind`: a key of `RANK_OPS`), built with the process
    groups at run time."""

    name: str
    kind: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RankOp:
    view: str  # the op kind (`bind`'s) a node has to become this op
    select: Callable[[NodePlan], bool]
    args: Callable[[NodePlan, Axes, tuple], dict]  # (plan, axes, data axes) -> the SpecialSpec's args
    records: Callable[[SpecialSpec, Axes], list[dict]]


def rank_op(plan: NodePlan) -> str | None:
    """The rank-dependent op a node becomes, or None."""
    return next((name for name, op in RANK_OPS.items() if op.view == plan.view.kind and op.select(plan)), None)


def _sizes(axes: Axes) -> dict[str, int]:
    return dict(zip(axes.names, axes.sizes))


# -- vocab-parallel embedding ------------------------------------------------------------------------
def _vocab_args(plan: NodePlan, axes: Axes, data=()) -> dict:
    axis = next(a for a, i, w in zip(axes.names, *plan.need) if w == Shard(0) and not isinstance(i, Shard))
    vocab = plan.view.shape(plan.view.tensors[1])[0]
    return {"axis": axis, "vocab": vocab, "ways": _sizes(axes)[axis], "padding_idx": padding_row(plan.view, vocab)}


def padding_row(view, vocab: int) -> int | None:
    """The row an embedding's `padding_idx` names (its gradient stays zero), or None. `F.embedding` counts
    a negative one from the end, as `nn.Embedding` does; ATen's `embedding` takes -1 for none (F.embedding
    normalises before calling it) and never matches another negative one."""
    pad = view.p.get("padding_idx")
    if pad is None or pad < 0 and view.p.get("_target") is aten.embedding.default:
        return None
    return pad + vocab if pad < 0 else pad


def _ce_args(plan: NodePlan, axes: Axes, data=()) -> dict:
    logits = plan.need[0]
    reduction = plan.view.p.get("reduction", "mean")
    reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    vocab = [a for a, p in zip(axes.names, logits) if p == Shard(1)]
    rows = [a for a, p in zip(axes.names, logits) if isinstance(p, Shard) and p.dim == 0]
    n_classes = plan.view.shape(plan.view.tensors[0])[1]
    vocab_size = math.prod(_sizes(axes)[a] for a in vocab)
    local = local_shape(plan.view.shape(plan.view.tensors[0]), logits, axes.sizes)
    val = plan.view.tensors[0].meta["val"]
    return {
        "rows_local": local[0],
        "itemsize": 4 if val.dtype in (torch.float16, torch.bfloat16) else val.element_size(),
        "vocab_axis": vocab[0] if vocab else None,
        "rows_axes": tuple(rows),
        "classes": n_classes,
        "vocab_ways": vocab_size,
        "reduction": reduction,
        "ignore_index": plan.view.p.get("ignore_index", -100),
        "output_partial": tuple(a for a, p in zip(axes.names, plan.out) if isinstance(p, Partial)),
        "count_from": count_recipe(plan.view.tensors[1]) if reduction == "mean" and rows else None,
    }


def count_recipe(target: fx.Node) -> dict | None:
    """How the loss's targets come from an input, when only views, casts, pads and slices of other dims
    than the batch's stand between: `{"input": name, "steps": [...]}`. Every rank holds the whole
    batch, so it counts the targets of every rank itself, with no all-reduce; None otherwise."""
    steps = []
    node = target
    while node.op != "placeholder":
        if node.op == "call_module" and node.meta.get("comm") is not None:  # moves rows, not their values
            node = node.args[0]
            continue
        view = bind(node)
        if view.kind == "pad" and len(view.p["pad"]) // 2 < len(view.shape(view.tensors[0])):
            steps.append(("pad", tuple(view.p["pad"]), view.p.get("value", 0)))
        elif (
            view.kind == "slice"
            and view.p.get("_target") is aten.slice.Tensor
            and view.p.get("dim", 0) % len(view.out_shape)
        ):
            p = view.p
            steps.append(("slice", p.get("dim", 0), p.get("start"), p.get("end"), p.get("step", 1)))
        elif view.kind not in ("view", "linear_unary") or not _integral(node):
            return None
        if not view.tensors:
            return None
        node = view.tensors[0]
    return {"input": node.target, "steps": tuple(reversed(steps))}


def _integral(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return torch.is_tensor(val) and not val.is_floating_point()


def _ce_records(spec: SpecialSpec, axes: Axes) -> list[dict]:
    """The loss-parallel cross-entropy's all-reduces: the row max, then the sum of exponentials and the
    target logit; and the global count of targets where the batch cannot give it."""
    sizes = dict(zip(axes.names, axes.sizes))
    rows = spec.args.get("rows_local", 0)
    out = []

    def record(axis, n_bytes, reason):
        return dict(
            kind="all_reduce", axes=(axis,), bytes=n_bytes, node=spec.name, op="cross_entropy", source="",
            reason=reason, phase="forward", group=sizes[axis], bus=0,
        )  # fmt: skip

    if axis := spec.args["vocab_axis"]:
        out.append(record(axis, rows * spec.args["itemsize"], "loss-parallel max"))
        out.append(record(axis, rows * spec.args["itemsize"] * 2, "loss-parallel sum-exp and target logit"))
    if spec.args["reduction"] == "mean" and not spec.args.get("count_from"):  # else counted from the batch
        out += [record(axis, 8, "global count of targets") for axis in spec.args["rows_axes"]]
    return out


# -- a region of per-shard code ------------------------------------------------------------------------
TENSOR = "<tensor>"  # a region's argument slot the graph fills with a tensor (the others are constants)


def check_regions(gm: fx.GraphModule, axes: Axes) -> None:
    """Every region of per-shard code in `gm` maps over the mesh the model is compiled for (before
    placement: a region's specs name that mesh's axes)."""
    from ...spmd.mapped import ShardMapped
    from ..capture.source import source_line

    for node in gm.graph.nodes:
        fn = node.target
        if isinstance(fn, ShardMapped) and (fn.mesh.axis_names, fn.mesh.axis_sizes) != (axes.names, axes.sizes):
            raise ValueError(
                f"{fn!r} called at {source_line(node)}: its mesh {fn.mesh!r} is not the one the model is "
                f"compiled for ({dict(zip(axes.names, axes.sizes))}). Fix: give shard_map the mesh you give "
                "compile_model"
            )


def _region_args(plan: NodePlan, axes: Axes, data: tuple) -> dict:
    """The region's function, the places of its tensor arguments, and its collectives per rank (from one
    run on meta tensors of its inputs' shards); refused here, at compile time, where the runtime would
    run it wrong."""
    from ..capture.source import source_line

    fn, node = plan.view.p["fn"], plan.view.node
    where = f"{fn!r} called at {source_line(node)}"
    if set(node.all_input_nodes) - set(plan.view.tensors) or node.kwargs:
        raise ValueError(
            f"{where}: inside a compiled model a region takes tensors and constants as "
            "positional arguments, not tensors in containers, keywords or values computed from tensors. "
            "Fix: pass each tensor as its own argument, and compute sizes inside the region"
        )
    from ...spmd.plan import region_collectives
    from ..capture.values import run_dtype

    shapes = [(tuple(x.meta["val"].shape), run_dtype(x)) for x in plan.view.tensors]
    template = tuple(TENSOR if isinstance(a, fx.Node) else a for a in node.args)
    local = iter(
        torch.empty(local_shape(shape, need, axes.sizes), dtype=dtype, device="meta")
        for (shape, dtype), need in zip(shapes, plan.need)
    )  # fmt: skip
    args = tuple(next(local) if a is TENSOR else a for a in template)
    run = region_collectives(
        fn.f, mesh=fn.mesh, in_specs=fn.in_specs, out_specs=fn.out_specs, args=args, check_vma=fn.check_vma,
        deferred=frozenset(data),
    )  # fmt: skip
    # an exchange (all-to-all, ppermute) moves rows between data ranks and adds nothing up: expert
    # parallelism's dispatch runs over `ep`, a data axis; so does gathering them (context parallelism's keys
    # and values over `cp`), whose backward sums each rank's share of their gradient back to its owner (a
    # reduce-scatter, the gather's transpose). A sum in forward over one is the runtime's
    moves = {("forward", "all_gather"), ("backward", "reduce_scatter")}
    owned = [
        r for r in run.records
        if set(r.axes) & set(data) and r.kind not in ("all_to_all", "send_recv") and (r.phase, r.kind) not in moves
    ]  # fmt: skip
    if owned:
        r = owned[0]
        raise ValueError(
            f"{where}: lax.{r.op} at {r.source} sums over {list(r.axes)}, which the compiled "
            f"model keeps for data parallelism ({list(data)}): their gradient sums belong to the runtime, once per "
            "step, and a region's sum there would count them again or miss them. Fix: keep the region's sums on "
            f"the other axes (the batch stays split over {list(data)} through it; exchanges such as all_to_all, "
            "ppermute and all_gather may run over them)"
        )
    return {"fn": fn, "deferred": tuple(data), "template": template, "records": run.records}


def _region_records(spec: SpecialSpec, axes: Axes) -> list[dict]:
    """What the region's own collectives move per rank, forward and backward (`spmd.region_collectives`)."""
    fn = spec.args["fn"]
    return [
        dict(
            kind=r.kind, axes=r.axes, bytes=r.bytes, node=spec.name, op=f"lax.{r.op}", source=r.source,
            reason=f"shard_map {fn.__name__}" + ("" if r.priced == "exact" else f", priced from its {r.priced}"),
            phase=r.phase, group=r.group, bus=0,
        )
        for r in spec.args["records"]
    ]  # fmt: skip


RANK_OPS: dict[str, RankOp] = {
    "vocab_embedding": RankOp(
        "embedding",
        lambda plan: any(w == Shard(0) and not isinstance(i, Shard) for i, w in zip(*plan.need)),
        _vocab_args,
        lambda spec, axes: [],
    ),
    "cross_entropy": RankOp(
        "cross_entropy", lambda plan: any(isinstance(p, Shard) for p in plan.need[0]), _ce_args, _ce_records
    ),
    "shard_map": RankOp("shard_map", lambda plan: True, _region_args, _region_records),
}


__all__ = ["RANK_OPS", "TENSOR", "RankOp", "SpecialSpec", "check_regions", "count_recipe", "padding_row", "rank_op"]
