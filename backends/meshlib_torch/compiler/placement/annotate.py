"""Annotate: parameter specs from the core's rules, input specs from the user.

A `P` becomes a layout, one placement per mesh axis. A dim split over several
axes in mesh order is a nested shard (the first axis major), as DTensor and
JAX both lay it out. Axes named out of mesh order, as in `P(('tp', 'dp'))` on
a `(dp, tp)` mesh, become strided shards so the per-rank blocks still equal
JAX's. A Linear whose output is cut into parts (a fused qkv projection) is
split part by part: `k` equal parts give a `k`-way strided shard, unequal ones
(grouped-query attention's q, k and v) a shard in parts, so that every rank
holds whole heads of each part and the cut needs no gather.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from meshlib import Mesh, P, PatternRules, apply_rules, tree_shardings

from .bind import bind
from .parts import cut_sizes
from .placements import PARTIAL, Layout, R, Shard


def spec_to_layout(spec: P, mesh: Mesh) -> Layout:
    """The per-axis placements of `spec` (JAX's block order on every rank). An axis of size 1 splits and
    sums nothing: Replicate there, so no collective is ever placed on it."""
    out = []
    for m, axis in enumerate(mesh.axis_names):
        placement = R
        if mesh.axis_size(axis) == 1:
            out.append(R)
            continue
        for d, entry_axes in enumerate(spec.dim_axes(i) for i in range(len(spec))):
            if axis in entry_axes:
                i = entry_axes.index(axis)
                stride = math.prod(mesh.axis_size(a) for a in entry_axes[:i] if mesh.axis_index(a) > m)
                placement = Shard(d, stride)
        if axis in spec.unreduced:
            placement = PARTIAL
        out.append(placement)
    return tuple(out)


def layout_to_spec(layout: Layout, mesh: Mesh, ndim: int) -> P:
    """The `P` of a layout (strided shards become tuple entries in JAX's order)."""
    dims: list[list[tuple[int, str]]] = [[] for _ in range(ndim)]
    unreduced = []
    for axis, p in zip(mesh.axis_names, layout):
        if isinstance(p, Shard):
            dims[p.dim].append((p.groups, axis))
        elif p == PARTIAL:
            unreduced.append(axis)
    entries = []
    for group in dims:
        # a larger stride means more axes precede this one in JAX's order (stable: mesh order)
        axes = tuple(a for _, a in sorted(group, key=lambda t: t[0]))
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries, unreduced=unreduced)


def param_specs(
    params: dict[str, torch.Tensor], rules, mesh: Mesh, aliases: dict[str, str] | None = None, uneven: str = "error"
) -> dict[str, P]:
    """Apply the rules; every spec is checked against the mesh and the parameter's shape.

    A tied parameter (`aliases`: every FQN -> its canonical one) has one layout: the rules see it
    under each of its names, and those must agree (an embedding tied to a head written as
    `lm_head.weight` gets that name's spec; two different specs raise, naming both)."""
    aliases = aliases or {n: n for n in params}
    names = {alias: params[canon] for alias, canon in aliases.items() if canon in params}
    if callable(rules):
        every = apply_rules(names, rules)
    else:
        every = {n: s for n, s in dict(rules).items() if n in names}
    # a pattern table's default is no statement about a name: only names a pattern matched count
    stated = (lambda a: bool(rules.matches(a))) if isinstance(rules, PatternRules) else (lambda a: a in every)
    specs: dict[str, P] = {}
    conflicts = []
    for canon in params:
        given = {a: every[a] for a, c in aliases.items() if c == canon and a in every and stated(a)}
        distinct = set(given.values())
        if len(distinct) > 1:
            conflicts.append(", ".join(f"{spec!r} as {a}" for a, spec in sorted(given.items())))
        elif distinct:
            specs[canon] = distinct.pop()
        elif canon in every:
            specs[canon] = every[canon]
    if conflicts:
        raise ValueError(
            f"tied parameters get different specs under their names: {'; '.join(conflicts)}. A tied parameter has "
            "one layout: give every name of it the same spec"
        )
    missing = sorted(set(params) - set(specs))
    if missing:
        raise ValueError(f"no spec for parameters {missing}; give every parameter a spec or a rule default")
    tree_shardings(params, {n: specs[n] for n in params}, mesh, uneven=uneven)  # raises, naming every misfit
    for name, p in params.items():
        check_single_axis_uneven(mesh, specs[name], tuple(p.shape), uneven, f"parameter {name!r}")
    return specs


def check_single_axis_uneven(mesh: Mesh, spec: P, shape: tuple[int, ...], uneven: str, what: str) -> None:
    """Under `uneven="chunk"`, an uneven dim may be split over one mesh axis only: over several, DTensor
    cuts a chunk of a chunk (nested Shards) while the core's NamedSharding cuts one chunk of the axes'
    product, so the two would disagree on what each rank holds. (Under "error" nothing is uneven.)"""
    if uneven == "error":
        return
    for dim, size in enumerate(shape):
        axes = spec.dim_axes(dim)
        if len(axes) > 1 and size % mesh.axis_size(axes):
            raise ValueError(
                f"{what}: dim {dim} of shape {shape} is split unevenly over several mesh axes {axes} by "
                f"{spec!r}; uneven='chunk' splits an uneven dim over one axis only. Fix: make dim {dim} a "
                f"multiple of {mesh.axis_size(axes)}, or split it over one axis"
            )


def fuse_groups(gm: fx.GraphModule) -> dict[str, tuple[int, int | tuple[int, ...]]]:
    """Parameters of a projection whose output is cut into parts along its last dim (a fused qkv)
    -> (the parameter's output dim, k for k equal parts, or the parts' sizes where they differ, as
    grouped-query attention's q, k and v do). The projection is a Linear (`x @ W.T`, output dim 0 of
    W) or a matmul by the weight (`x @ W`, Hugging Face's Conv1D: output dim 1), maybe with its bias
    added and the result reshaped (the last dim kept) before the cut: one `split`/`chunk` into the
    parts, or slices of the last dim that tile it (`qkv[..., :q]`, `qkv[..., q:q + kv]`, ...)."""
    out: dict[str, tuple[int, int | tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        view = bind(node)
        if view.kind not in ("linear", "matmul") or len(view.tensors) != 2 or not _is_param(view.tensors[1]):
            continue
        w = view.tensors[1]
        if view.kind == "matmul" and len(view.shape(w)) != 2:
            continue
        params = [(w.target, 0 if view.kind == "linear" else 1)]
        cur, users = node, list(node.users)
        while len(users) == 1:
            nxt = bind(users[0])
            if nxt.kind == "add":
                other = [a for a in nxt.tensors if a is not cur]
                if not (other and _is_param(other[0]) and len(view.shape(other[0])) == 1):
                    break
                params.append((other[0].target, 0))
            elif not (nxt.kind == "view" and nxt.out_shape[-1:] == tuple(cur.meta["val"].shape)[-1:]):
                break
            cur, users = users[0], list(users[0].users)
        sizes = cut_sizes(cur, users)
        if sizes is not None:
            for name, dim in params:
                out[name] = (dim, len(sizes) if len(set(sizes)) == 1 else tuple(sizes))
    return out


def _is_param(node: fx.Node) -> bool:
    return node.op == "get_attr" and bool(node.meta.get("param"))


def with_groups(layout: Layout, group: tuple[int, int | tuple[int, ...]], mesh: Mesh, shape) -> Layout:
    """A fused projection's layout: a shard of its output dim holds a block of every part (`Shard(dim, k)`
    for k equal parts, `Shard(dim, parts=...)` for unequal ones, their sizes in lowest terms). Where the
    parts do not divide over the axes that split them (4 heads' q, k and v over tp=3), or unequal parts
    are split over more than one axis, the layout is kept as declared, a plain shard: the parts are
    then gathered before the cut."""
    dim, k = group
    on_dim = [n for p, n in zip(layout, mesh.axis_sizes) if isinstance(p, Shard) and p.dim == dim and p.plain]
    ways = math.prod(on_dim)
    if isinstance(k, int):
        if (shape[dim] // k) % ways:
            return layout
        fused = Shard(dim, k)
    else:
        if len(on_dim) != 1 or ways < 2 or sum(k) != shape[dim] or any(size % ways for size in k):
            return layout
        unit = math.gcd(*k)
        fused = Shard(dim, parts=tuple(size // unit for size in k))
    return tuple(fused if isinstance(p, Shard) and p.dim == dim and p.plain else p for p in layout)
