"""Propagate: a layout for every value, the cheapest the op rules allow.

Nodes are visited in order. On each mesh axis, every strategy the op's rule
lists is priced by the bytes its input changes would move (`placements.cost`)
and the cheapest is taken; ties go to the strategy listed first. A layout an
earlier consumer already asked for is free to reuse. Parameters keep the
layouts their specs declare: only activations are redistributed, unless an op
has no other way (then the weight is gathered, and the plan shows it). The result
is, per node, the layout of its output and the layout each input must have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .bind import OpView, bind
from .ops import RULES, Strategy
from .placements import INF, PARTIAL, Layout, Partial, R, Shard, cost
from .shapes import chunked_groups, dim_ways, divides


@dataclass
class NodePlan:
    view: OpView
    out: Layout | tuple[Layout, ...] | None  # None for shape arithmetic
    need: list[Layout]  # required layout of each tensor input, in view.tensors order
    replicated_fallback: bool = False


@dataclass(frozen=True)
class Axes:
    """What propagation knows of the mesh: axis names and sizes, and where new shards may start."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    slice_dims: tuple[tuple[str, Shard, int], ...] = ()  # (axis, shard of a dim, its size): outputs may start one
    uneven: bool = False  # a dim that does not divide may be cut in torch.chunk's sizes (uneven="chunk")


# Moving a parameter (all-gathering a weight every step) is the last resort: it is
# what a strategy costs when its declared layout leaves an op no other way.
PARAM_MOVE_PENALTY = 1e6


def _bytes(val) -> float:
    return math.prod(val.shape) * val.element_size()


def _full_bytes(val, layout: Layout, axes: Axes, axis_i: int) -> float:
    """Bytes of the value on one rank if axis `axis_i` did not shard it."""
    ways = math.prod(n for i, (p, n) in enumerate(zip(layout, axes.sizes)) if i != axis_i and isinstance(p, Shard))
    return _bytes(val) / ways


def _choose(view: OpView, cur: list[Layout], axes: Axes, i: int, shape_after: list, avail: dict, cut=None) -> Strategy:
    n, name = axes.sizes[i], axes.names[i]
    cur_i = [lay[i] for lay in cur]
    shape = tuple(view.out.shape) if torch.is_tensor(view.out) else ()
    hint = [s for a, s, size in axes.slice_dims if a == name and len(shape) > s.dim and shape[s.dim] == size]
    best, best_cost = None, INF
    for strat in RULES.get(view.kind, RULES["unknown"])(view, cur_i, hint):
        if not fits(view, strat, n, shape_after, axes.uneven, cut):
            continue
        total = 0.0
        # a new activation shard may start only where the op's output lands on a slice dim
        slice_ok = strat.output in hint
        for k, (x, src, dst) in enumerate(zip(view.tensors, cur_i, strat.inputs)):
            if dst in avail.get((x, i), ()):
                continue  # an earlier consumer already made this layout
            val = x.meta["val"]
            step = cost(src, dst, _full_bytes(val, cur[k], axes, i), n, slice_ok=slice_ok, grad=val.requires_grad)
            if x.meta.get("param") and dst != src:
                step *= PARAM_MOVE_PENALTY  # declared parameter layouts are kept; activations move instead
            total += step
        if hint and isinstance(strat.output, Partial):
            total += _partial_debt(view, hint[0], n)
        if total < best_cost:
            best, best_cost = strat, total
    if best is None and view.kind == "shard_map":
        from ..capture.source import source_line

        shapes = ", ".join(str(tuple(x.meta["val"].shape)) for x in view.tensors)
        raise ValueError(
            f"{view.p['fn']!r} called at {source_line(view.node)}: its arguments' shapes ({shapes}) do not split "
            f"evenly over axis {name!r} ({n} ways) as its in_specs place them, and a region takes equal shards, as "
            f"JAX's shard_map does (uneven='chunk' does not reach inside one). Fix: make those dims multiples of "
            f"{n} (for experts: the tokens per step a multiple of the data ranks)"
        )
    if best is None:
        raise AssertionError(f"no strategy fits {view.node} on axis {name}")
    return best


def _partial_debt(view: OpView, shard: Shard, n: int) -> float:
    """What a partial sum on a sequence-parallel axis will cost: every consumer that is not linear in
    it reduce-scatters it to the sequence shard (Megatron's g-bar), forward and backward. Charged where
    the partial is made, so that a sum already reduce-scattered (the residual stream) stays the shard,
    with the other summand reduce-scattered into it, rather than staying partial at full size: the same
    bytes move, but a layer then keeps and sends 1/n of the activation, as in Megatron."""
    out = view.out
    shape = view.local[1] if view.local is not None else tuple(out.shape)
    return cost(PARTIAL, shard, math.prod(shape) * out.element_size(), n, slice_ok=True, grad=out.requires_grad)


def fits(view: OpView, strat: Strategy, n: int, shape_after: list, uneven: bool = False, cut=None) -> bool:
    """Every shard in the strategy divides its (already locally sharded) dim evenly. With `uneven`, a
    plain shard of a dim that no earlier axis cut may take torch.chunk's sizes where the op computes
    each position of that dim alone (`_chunk_safe`). `cut`, per input then the output: the dims earlier
    axes cut, each mapped to whether they cut it evenly. An uneven dim is cut by one axis only, so that
    every rank of a collective over it holds pieces of the same whole."""
    outs = strat.output if isinstance(strat.output, tuple) else (strat.output,)
    out_vals = view.out if isinstance(view.out, (list, tuple)) else [view.out]
    ins = list(zip(strat.inputs, shape_after[: len(strat.inputs)]))
    even_out = all(divides(tuple(v.shape), p, n) for p, v in zip(outs, out_vals))
    if even_out and all(divides(shape, p, n) for p, shape in ins):
        return True
    if not uneven:
        return False
    local_out = view.local[1] if view.local is not None else None
    pairs = ins + [(p, local_out or tuple(v.shape)) for p, v in zip(outs, out_vals)]
    cut = cut or [{}]
    for k, (p, shape) in enumerate(pairs):
        before = cut[min(k, len(cut) - 1)].get(p.dim) if isinstance(p, Shard) else None
        if before is False:
            return False  # a dim an earlier axis cut unevenly is cut no further
        if divides(shape, p, n) or (before is None and divides(shape, p, n, uneven=True)):
            continue
        if not (before and chunked_groups(p, shape[p.dim], n)):  # groups of an even cut, each cut unevenly
            return False
    return _chunk_safe(view, strat, shape_after)


def _chunk_safe(view: OpView, strat: Strategy, shape_after: list) -> bool:
    """An uneven shard is right only where the op keeps the sharded dim as it is: a view may not merge
    or split it (torch.chunk's pieces of a merged dim are not the merged pieces), and repeat_interleave
    may not repeat along it. Every other rule keeps a shard on a dim of the same size."""
    if view.kind == "view":
        s, o = strat.inputs[0], strat.output
        if not isinstance(s, Shard):
            return True
        src, dst = shape_after[0], view.local[1] if view.local else view.out_shape
        if not isinstance(o, Shard):
            return False
        if src[s.dim] == dst[o.dim] and math.prod(src[: s.dim]) == math.prod(dst[: o.dim]):
            return True
        return _groups_kept(src, dst, s, o)
    if view.kind == "repeat_interleave":
        dim = view.p.get("dim")
        return not any(isinstance(s, Shard) and s.dim == dim % len(view.out_shape) for s in strat.inputs)
    return True


def _groups_kept(src, dst, s: Shard, o: Shard) -> bool:
    """A view that merges dims before an uneven one into it, or splits them off again ((B, S) <-> B*S rows,
    S cut in torch.chunk's pieces): right when the uneven dim is the last of the dims the view merges on
    either side, so each rank's rows are its piece of every group, and the groups' unit is the same."""
    from .shapes import view_groups

    runs = view_groups(src, dst) or []
    last = any(s.dim == gi[-1] and o.dim == gj[-1] for gi, gj in runs if s.dim in gi and o.dim in gj)
    return last and src[s.dim] * o.groups == dst[o.dim] * s.groups


def _local_shapes(view: OpView, cur: list[Layout], axes: Axes, upto: int) -> list:
    out = []
    for x, lay in zip(view.tensors, cur):
        shape = list(x.meta["val"].shape)
        for p, n in zip(lay[:upto], axes.sizes[:upto]):
            if isinstance(p, Shard) and p.dim < len(shape):
                shape[p.dim] = -(-shape[p.dim] // n)  # the largest piece, torch.chunk's first
        out.append(tuple(shape))
    return out


def propagate(
    gm: fx.GraphModule,
    axes: Axes,
    *,
    params: dict[str, Layout],
    inputs: dict[str, Layout],
    outputs: Layout | None = None,
) -> dict[fx.Node, NodePlan]:
    plans: dict[fx.Node, NodePlan] = {}
    avail: dict[tuple[fx.Node, int], set] = {}  # placements each value already has or was given
    rep: Layout = (R,) * len(axes.names)
    for node in gm.graph.nodes:
        view = bind(node)
        if view.kind in ("scalar", "drop"):
            plans[node] = NodePlan(view, None, [])
        elif view.kind == "placeholder":
            lay = inputs.get(node.target, rep) if torch.is_tensor(node.meta.get("val")) else None
            plans[node] = NodePlan(view, lay, [])
        elif view.kind == "get_attr":
            plans[node] = NodePlan(view, params.get(node.target, rep), [])
        elif view.kind == "item":
            src = plans[view.tensors[0]].out
            plans[node] = NodePlan(view, src[view.p["index"]], [src])
        elif view.kind == "output":
            outs = [a for a in node.all_input_nodes if torch.is_tensor(a.meta.get("val"))]
            view.tensors = outs
            plans[node] = NodePlan(view, None, [outputs or rep for _ in outs])
        else:
            plans[node] = _plan_op(view, plans, axes, avail)
    return plans


def _cut(shape: tuple[int, ...], layout, axes: Axes) -> dict[int, bool]:
    """The dims the (first axes') placements of `layout` cut, each mapped to: evenly?"""
    return {d: shape[d] % w == 0 for d, w in dim_ways(layout, axes.sizes).items() if d < len(shape)}


def _shrunk(shape: tuple[int, ...], layout, axes: Axes) -> tuple[int, ...]:
    """`shape` after the shards of `layout` (the first axes' placements)."""
    out = list(shape)
    for p, n in zip(layout, axes.sizes):
        if isinstance(p, Shard) and p.dim < len(out):
            out[p.dim] = -(-out[p.dim] // n)
    return tuple(out)


def _plan_op(view: OpView, plans: dict, axes: Axes, avail: dict) -> NodePlan:
    cur = [plans[x].out for x in view.tensors]
    multi = isinstance(view.out, (list, tuple))
    need = [list(lay) for lay in cur]
    out_per_axis = []
    for i, n in enumerate(axes.sizes):
        if n == 1:
            out_per_axis.append((R,) * len(view.out) if multi else R)
            for lay in need:
                lay[i] = R
            continue
        shapes = _local_shapes(view, [tuple(x) for x in need], axes, i)
        if not multi:
            view.local = (shapes, _shrunk(tuple(view.out.shape), out_per_axis, axes))
        view.axis = i
        cut = None
        if axes.uneven:
            cut = [_cut(tuple(x.meta["val"].shape), lay[:i], axes) for x, lay in zip(view.tensors, need)]
            cut.append({} if multi else _cut(tuple(view.out.shape), out_per_axis, axes))
        strat = _choose(view, cur, axes, i, shapes, avail, cut)
        view.local = None
        for x, lay, p in zip(view.tensors, need, strat.inputs):
            lay[i] = p
            avail.setdefault(
                (x, i), {lay_i for lay_i in (plans[x].out[i],)} if not isinstance(plans[x].out[0], tuple) else set()
            ).add(p)
        out_per_axis.append(strat.output)
    if multi:
        out = tuple(tuple(o[k] for o in out_per_axis) for k in range(len(view.out)))
    else:
        out = tuple(out_per_axis)
    fallback = view.kind == "unknown"
    return NodePlan(view, out, [tuple(lay) for lay in need], fallback)
