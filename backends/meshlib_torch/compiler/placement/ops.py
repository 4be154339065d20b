"""Per-op sharding rules on one mesh axis.

A rule looks at an `OpView` and the placements its tensor inputs have now on
one axis, and lists the strategies that are valid: the placement each input
must have and the placement the output then has. `propagate` prices each
strategy by the bytes its input changes would move and takes the cheapest;
the first listed wins a tie, so rules list the strategy that keeps the inputs
as they are first.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bind import OpView, dims_arg
from .parts import index_slice, part_taken, slice_bounds, view_dims
from .placements import PARTIAL, Partial, Placement, R, Replicate, Shard, part_sizes, zigzag
from .shapes import index_dim_map, view_shards

Out = Placement | tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Placement, ...]
    output: Out


def _shards(cur: list[Placement]) -> list[Shard]:
    seen: list[Shard] = []
    for p in cur:
        if isinstance(p, Shard) and p not in seen:
            seen.append(p)
    return seen


# -- pointwise -------------------------------------------------------------------------
def _aligned(v: OpView, x, out_dim: int) -> int | None:
    """The dim of input `x` that broadcasts into output dim `out_dim` (None: broadcast)."""
    shape, out = v.shape(x), v.out_shape
    d = out_dim - (len(out) - len(shape))
    return d if d >= 0 and shape[d] == out[out_dim] else None


def _input_dim_to_out(v: OpView, x, d: int) -> int:
    return d + len(v.out_shape) - len(v.shape(x))


def pointwise(
    v: OpView, cur: list[Placement], hint: list[Shard] = (), *, partial: list[tuple[Placement, ...]] = ()
) -> list[Strategy]:
    """Output sharded like its inputs (or like a `hint`, an output shard worth trying);
    whole; or, from the input tuples in `partial`, a partial sum."""
    out_shards = [
        s.at(_input_dim_to_out(v, v.tensors[i], s.dim)) for i, s in enumerate(cur) if isinstance(s, Shard)
    ]
    out: list[Strategy] = []
    for o in out_shards + [h for h in hint if h.dim < len(v.out_shape)]:
        ins = []
        for x in v.tensors:
            d = _aligned(v, x, o.dim)
            ins.append(o.at(d) if d is not None else R)
        cand = Strategy(tuple(ins), o)
        if cand not in out:
            out.append(cand)
    out.append(Strategy((R,) * len(cur), R))
    return out + [Strategy(ins, PARTIAL) for ins in partial]


def binary(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    n = len(v.tensors)
    if v.kind in ("add", "sub"):
        partial = [(PARTIAL,) * n] if not v.p["scalar_operand"] else []
    elif v.kind == "mul":
        partial = [tuple(PARTIAL if j == i else R for j in range(n)) for i in range(n)]
    else:  # div: numerator only
        first_is_num = v.tensors[0] is v.p.get("x")
        partial = [(PARTIAL,) + (R,) * (n - 1)] if first_is_num else []
    ordered = sorted(partial, key=lambda ins: sum(a != b for a, b in zip(ins, cur)))
    return pointwise(v, cur, hint, partial=ordered)


def unary(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    return pointwise(v, cur, hint)


def linear_unary(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    return pointwise(v, cur, hint, partial=[(PARTIAL,)])


def dropout(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    if not v.p.get("p") or v.p.get("training") is False:
        return linear_unary(v, cur, hint)
    return pointwise(v, cur, hint)


# -- reductions and normalizations -----------------------------------------------------------
def reduction(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    nd = len(v.shape(v.tensors[0]))
    dims = dims_arg(v.p, nd) or tuple(range(nd))
    keep = bool(v.p.get("keepdim"))
    out = []
    for s in _shards(cur):
        if s.dim in dims:
            out.append(Strategy((s,), PARTIAL))
        else:
            od = s.dim if keep else s.dim - sum(d < s.dim for d in dims)
            out.append(Strategy((s,), s.at(od)))
    out += [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]
    return out


def softmax(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    dim = v.p["dim"] % len(v.out_shape)
    return [Strategy((s,), s) for s in _shards(cur) if s.dim != dim] + [Strategy((R,), R)]


def norm(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    k = len(v.p["normalized_shape"])
    nd = len(v.out_shape)
    extra = (R,) * (len(v.tensors) - 1)
    shards = _shards(cur[:1]) + [h for h in hint if h not in cur[:1]]
    return [Strategy((s,) + extra, s) for s in shards if s.dim < nd - k] + [Strategy((R,) * len(v.tensors), R)]


# -- matmuls -----------------------------------------------------------------------------------
def linear(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    nd = len(v.out_shape)
    out = [Strategy((s, R), s) for s in _shards(cur[:1]) if s.dim < nd - 1]
    w = cur[1]
    if isinstance(w, Shard) and w.dim == 0:
        out.append(Strategy((R, w), w.at(nd - 1)))
    if isinstance(w, Shard) and w.dim == 1:
        out.append(Strategy((w.at(nd - 1), w), PARTIAL))
    out += [Strategy((PARTIAL, R), PARTIAL), Strategy((R, R), R)]
    return out


def _einsum_terms(v: OpView) -> tuple[list[str], str]:
    if v.kind == "einsum":
        eq = v.p["equation"].replace(" ", "")
        ins, out = eq.split("->") if "->" in eq else (eq, None)
        terms = ins.split(",")
        if any("..." in t for t in terms):
            terms, out = _expand_ellipsis(v, terms, out)
        if out is None:
            labels = "".join(terms)
            out = "".join(sorted(c for c in set(labels) if labels.count(c) == 1))
        return terms, out
    # matmul/bmm/mm: label batch dims, then m k , k n
    xs, ys = v.shape(v.tensors[0]), v.shape(v.tensors[1])
    letters = iter("abcdefghij")
    batch = [next(letters) for _ in range(max(len(xs), len(ys)) - 2)]
    x = "".join(batch[len(batch) - (len(xs) - 2) :]) + ("mk" if len(xs) > 1 else "k")
    y = "".join(batch[len(batch) - (len(ys) - 2) :]) + ("kn" if len(ys) > 1 else "k")
    out = "".join(batch) + ("m" if len(xs) > 1 else "") + ("n" if len(ys) > 1 else "")
    return [x, y], out


def _expand_ellipsis(v: OpView, terms: list[str], out: str | None):
    n_ell = max(len(v.shape(x)) - (len(t) - 3) for x, t in zip(v.tensors, terms) if "..." in t)
    fill = "".join(chr(ord("A") + i) for i in range(n_ell))
    new = []
    for x, t in zip(v.tensors, terms):
        if "..." in t:
            k = len(v.shape(x)) - (len(t) - 3)
            t = t.replace("...", fill[n_ell - k :])
        new.append(t)
    return new, (out.replace("...", fill) if out is not None else None)


def contraction(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    terms, out_term = _einsum_terms(v)
    shapes = [v.shape(x) for x in v.tensors]
    out: list[Strategy] = []
    for i, s in enumerate(cur):
        if not isinstance(s, Shard):
            continue
        label = terms[i][s.dim]
        ins = []
        for t, shape in zip(terms, shapes):
            pos = t.find(label)
            broadcast = pos < 0 or shape[pos] == 1 and shapes[i][s.dim] != 1
            ins.append(R if broadcast else s.at(pos))
        res: Placement = s.at(out_term.index(label)) if label in out_term else PARTIAL
        cand = Strategy(tuple(ins), res)
        if cand not in out:
            out.append(cand)
    n = len(cur)
    out += [Strategy(tuple(PARTIAL if j == i else R for j in range(n)), PARTIAL) for i in range(n)]
    out.append(Strategy((R,) * n, R))
    return out


def sdpa(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    out = []
    for s in _shards(cur[:3]):
        if s.dim in (0, 1):
            ins = [s, s, s]
            if len(v.tensors) > 3:
                mask = v.shape(v.tensors[3])
                md = s.dim - (4 - len(mask))
                ins.append(s if md >= 0 and mask[md] == v.out_shape[s.dim] else R)
            out.append(Strategy(tuple(ins), s))
    out.append(Strategy((R,) * len(v.tensors), R))
    return out


def embedding(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    out = [Strategy((s, R), s) for s in _shards(cur[:1])]
    w = cur[1]
    if w == Shard(0):  # vocab-parallel; a padding row is zeroed in backward by the rank that holds it
        out.append(Strategy((R, w), PARTIAL))
    if w == Shard(1):
        out.append(Strategy((R, w), Shard(len(v.out_shape) - 1)))
    out.append(Strategy((R, R), R))
    return out


def cross_entropy(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    reduction = v.p.get("reduction", "mean")
    plain = v.p.get("weight") is None and not v.p.get("label_smoothing") and reduction in ("mean", "sum", 1, 2)
    out = []
    if plain and isinstance(cur[0], Shard) and cur[0].dim == 0:  # rows in any order: their losses are summed
        out.append(Strategy((cur[0], cur[0]), PARTIAL))
    if plain and cur[0] == Shard(1):
        out.append(Strategy((Shard(1), R), R))
    out.append(Strategy((R, R), R))
    return out


# -- shapes ---------------------------------------------------------------------------------
def view(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """A shard stays a shard through merges and splits (in groups where it is not the run's major dim)."""
    s = cur[0]
    out = []
    if isinstance(s, Shard):
        src, dst = (v.local[0][0], v.local[1]) if v.local else (v.shape(v.tensors[0]), v.out_shape)
        if s.parts:
            out += [Strategy((s,), s.at(j)) for j in view_dims(src, dst, s.dim, s.parts)]
        else:
            shards = view_shards(src, dst, s.dim, s.groups)
            # a mirrored shard stays one where its parts still pair up (an even number of groups)
            out += [Strategy((s,), Shard(j, g, mirror=s.mirror)) for j, g in shards if not s.mirror or g % 2 == 0]
    return out + [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]


def _perm(v: OpView) -> list[int]:
    nd = len(v.out_shape)
    if v.kind == "transpose":
        d0, d1 = (v.p.get("d0", 0) % nd, v.p.get("d1", 1) % nd) if "d0" in v.p else (0, 1)
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    dims = v.p.get("dims")
    if dims is None:
        dims = [v.p[k] for k in ("a1", "a2", "a3", "a4", "a5") if k in v.p]
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    return [d % nd for d in dims]


def permute(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    perm = _perm(v)
    out = [Strategy((s,), s.at(perm.index(s.dim))) for s in _shards(cur)]
    return out + [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]


def expand(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    out = []
    for s in _shards(cur):
        od = _input_dim_to_out(v, v.tensors[0], s.dim)
        if v.shape(v.tensors[0])[s.dim] == v.out_shape[od]:
            out.append(Strategy((s,), s.at(od)))
    return out + [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]


def repeat_interleave(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    if not isinstance(v.p.get("repeats"), int) or v.p.get("dim") is None:
        return [Strategy((R,), R)]
    dim = v.p["dim"] % len(v.out_shape)
    return [Strategy((s,), s) for s in _shards(cur) if s.plain or s.dim != dim] + [
        Strategy((PARTIAL,), PARTIAL),
        Strategy((R,), R),
    ]


def split(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """Shards of other dims stay; a dim split in parts (equal groups or unequal parts) split into exactly
    those parts gives plain shards of each."""
    shape = v.shape(v.tensors[0])
    dim = (v.p.get("dim") or 0) % len(shape)
    pieces = tuple(tuple(t.shape)[dim] for t in v.out)
    k = len(pieces)
    out = []
    for s in _shards(cur):
        if s.dim != dim:
            out.append(Strategy((s,), (s,) * k))
        elif not s.plain and part_sizes(s, shape[dim]) == pieces:
            out.append(Strategy((s,), (Shard(dim),) * k))
    return out + [Strategy((PARTIAL,), (PARTIAL,) * k), Strategy((R,), (R,) * k)]


def cat(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """Shards of a dim other than `dim` stay. An empty 1-D input (which torch.cat skips) is read as it is."""
    dim = v.p.get("dim", 0) % len(v.out_shape)
    n = len(cur)
    skipped = [v.shape(x) == (0,) and len(v.out_shape) > 1 for x in v.tensors]
    out = [Strategy(tuple(c if sk else s for c, sk in zip(cur, skipped)), s) for s in _shards(cur) if s.dim != dim]
    return out + [Strategy((PARTIAL,) * n, PARTIAL), Strategy((R,) * n, R)]


def index(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """Basic indexing: slices, ints, None and Ellipsis; a sharded dim must be kept whole, or, split in
    parts, be sliced to exactly one part (a plain shard of it)."""
    shape = v.shape(v.tensors[0])
    kept = index_dim_map(shape, v.p["index"])
    cut = index_slice(shape, v.p["index"])
    out = []
    for s in _shards(cur) if kept is not None else []:
        if kept.get(s.dim) is not None:
            out.append(Strategy((s,), s.at(kept[s.dim])))
        elif cut is not None and cut[0] == s.dim:
            if part_taken(s, shape[s.dim], *cut[1].indices(shape[s.dim])) is not None:
                out.append(Strategy((s,), Shard(cut[2])))
    return out + [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]


def slice_(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """Shards of other dims stay; a dim split in parts sliced to exactly one part is a plain shard of it."""
    shape = v.shape(v.tensors[0])
    dim = v.p.get("dim", 0) % len(shape)
    out_dim_of = (lambda d: d - (d > dim)) if v.kind == "select" else (lambda d: d)
    out = [Strategy((s,), s.at(out_dim_of(s.dim))) for s in _shards(cur) if s.dim != dim]
    if v.kind == "slice":
        _, start, end, step = slice_bounds(v)
        taken = [s for s in _shards(cur) if s.dim == dim and part_taken(s, shape[dim], start, end, step) is not None]
        out += [Strategy((s,), Shard(dim)) for s in taken]
    return out + [Strategy((PARTIAL,), PARTIAL), Strategy((R,), R)]


def tri(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    nd = len(v.out_shape)
    return [Strategy((s,), s) for s in _shards(cur) if s.dim < nd - 2] + [Strategy((R,), R)]


def like(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    return [Strategy((s,), s) for s in _shards(cur)] + [Strategy((PARTIAL,), R), Strategy((R,), R)]


def dimwise(v: OpView, cur: list[Placement], hint=(), *, fixed: tuple[int, ...] = (), linear: bool = False):
    """Ops along some dims of their inputs (`fixed`, which must be whole), elementwise along the others:
    a shard of any other dim stays (every input split the same way). Linear ops keep partial sums."""
    nd = len(v.out_shape)
    out = []
    for s in _shards(cur):
        d = _input_dim_to_out(v, v.tensors[cur.index(s)], s.dim)
        if d in fixed:
            continue
        ins = tuple(s.at(a) if (a := _aligned(v, x, d)) is not None else R for x in v.tensors)
        cand = Strategy(ins, s.at(d))
        if cand not in out and d < nd:
            out.append(cand)
    if linear:
        out.append(Strategy((PARTIAL,) * len(cur), PARTIAL))
    return out + [Strategy((R,) * len(cur), R)]


def scan(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """cumsum along `dim`: linear, elementwise along the other dims."""
    return dimwise(v, cur, hint, fixed=(v.p["dim"] % len(v.out_shape),), linear=True)


def diff(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    dim = v.p.get("dim", -1)
    return dimwise(v, cur, hint, fixed=(dim % len(v.out_shape),))


def pad(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """The padded dims (the last len(pad)/2) are whole; a shard of any other dim stays."""
    nd = len(v.out_shape)
    padded = tuple(range(nd - len(v.p["pad"]) // 2, nd))
    return dimwise(v, cur, hint, fixed=padded)


def new(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`x.new_ones(size)` and kin: the output is whole on every rank; `x` is only asked its dtype."""
    return [Strategy((cur[0],), R)]


def gather(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`x.gather(dim, index)`: along other dims x and index split alike; along `dim`, index may be
    split with x whole."""
    nd = len(v.out_shape)
    dim = v.p["dim"] % nd
    xs, ix = v.shape(v.tensors[0]), v.shape(v.tensors[1])
    out = []
    for s in _shards(cur):
        if s.dim == dim:
            out.append(Strategy((R, s), s))
        elif xs[s.dim] == ix[s.dim]:
            out.append(Strategy((s, s), s))
    return out + [Strategy((R, R), R)]


def index_select(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`x.index_select(dim, index)`: x split along another dim, or the index split (x whole); linear in x."""
    dim = v.p["dim"] % len(v.out_shape)
    out = [Strategy((s, R), s) for s in _shards(cur[:1]) if s.dim != dim]
    if isinstance(cur[1], Shard):
        out.append(Strategy((R, cur[1]), cur[1].at(dim)))
    return out + [Strategy((PARTIAL, R), PARTIAL), Strategy((R, R), R)]


def index_tensor(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`x[i0, i1, ...]` with index tensors in adjacent dims (advanced indexing): x split along a dim no
    index reads, or the index tensors split alike along a dim of their broadcast shape (x whole);
    linear in x."""
    indices = list(v.p["indices"])
    x_nd = len(v.shape(v.tensors[0]))
    read = [d for d, i in enumerate(indices) if i is not None]
    n = len(cur)
    whole = [Strategy((R,) * n, R)]
    if not read or read != list(range(read[0], read[-1] + 1)) or len(v.tensors) - 1 != len(read):
        return whole
    first, width = read[0], len(v.out_shape) - (x_nd - len(read))  # the broadcast index dims in the output
    out = [Strategy((PARTIAL,) + (R,) * (n - 1), PARTIAL)]
    for s in _shards(cur[:1]):
        if s.dim not in read:
            od = s.dim if s.dim < first else s.dim - len(read) + width
            out.insert(0, Strategy((s,) + (R,) * (n - 1), s.at(od)))
    for k, s in enumerate(cur[1:], start=1):
        if not isinstance(s, Shard):
            continue
        j = s.dim + width - len(v.shape(v.tensors[k]))  # the broadcast dim it is
        ins = [R]
        for idx in v.tensors[1:]:
            shape = v.shape(idx)
            a = j - (width - len(shape))
            ins.append(R if a < 0 or shape[a] == 1 else s.at(a))
        cand = Strategy(tuple(ins), s.at(first + j))
        if cand not in out:
            out.insert(0, cand)
    return out + whole


def stack(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    dim = v.p.get("dim", 0) % len(v.out_shape)
    n = len(cur)
    out = [Strategy((s,) * n, s.at(s.dim + (s.dim >= dim))) for s in _shards(cur)]
    return out + [Strategy((PARTIAL,) * n, PARTIAL), Strategy((R,) * n, R)]


def unbind(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    nd = len(v.shape(v.tensors[0]))
    dim = (v.p.get("dim") or 0) % nd
    k = len(v.out)
    out = [Strategy((s,), (s.at(s.dim - (s.dim > dim)),) * k) for s in _shards(cur) if s.dim != dim]
    return out + [Strategy((PARTIAL,), (PARTIAL,) * k), Strategy((R,), (R,) * k)]


def scatter(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`x.scatter(dim, index, src)` and `scatter_add`: along a dim other than `dim` where x, index (and src)
    have one size, a shard stays, every tensor split alike; along `dim` all whole."""
    nd = len(v.out_shape)
    dim = v.p["dim"] % nd
    sizes = [v.shape(t) for t in v.tensors]
    out = [
        Strategy((s,) * len(v.tensors), s) for s in _shards(cur)
        if s.dim != dim and len({shape[s.dim] for shape in sizes}) == 1
    ]  # fmt: skip
    return out + [Strategy((R,) * len(v.tensors), R)]


def topk(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """The k largest along `dim` (values, indices): that dim whole, a shard of any other stays in both."""
    nd = len(v.shape(v.tensors[0]))
    dim = v.p.get("dim", -1) % nd
    return [Strategy((s,), (s, s)) for s in _shards(cur) if s.dim != dim] + [Strategy((R,), (R, R))]


def histc(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """`torch.histc(x, bins, min, max)` over a range it is given (min < max): the counts of each rank's
    shard (of any dim: every element is counted alike) sum to the whole's. A range read from the data
    (min == max, the default) needs x whole."""
    if not v.p.get("min", 0) < v.p.get("max", 0):
        return [Strategy((R,), R)]
    return [Strategy((s,), PARTIAL) for s in _shards(cur)] + [Strategy((R,), R)]


def shard_map(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """A region of per-shard code (`meshlib_torch.shard_map`): its inputs as its in specs place them on
    this axis, its results as its out specs do; nothing else."""
    fn = v.p["fn"]
    ins, outs = region_layouts(fn, len(v.tensors), isinstance(v.out, (list, tuple)))
    ins, out = [lay[v.axis] for lay in ins], [lay[v.axis] for lay in outs]
    held = cur[0] if cur else None
    if fn.mesh.axis_names[v.axis] in getattr(fn, "any_rows", ()) and isinstance(held, Shard) and held.dim == 0:
        # per-row code: its rows may come in the order the first input holds them (tokens merged from a
        # sequence split in head-tail chunks), every row input and the results alike
        ins = [held if p == Shard(0) else p for p in ins]
        out = [held if p == Shard(0) else p for p in out]
    return [Strategy(tuple(ins), tuple(out) if isinstance(v.out, (list, tuple)) else out[0])]


def region_layouts(fn, n_inputs: int, multi: bool) -> tuple[list, list]:
    """The layouts a region's specs give its `n_inputs` tensor inputs and its results (one, or a tuple):
    a P for each, or one for all (a tree prefix, as shard_map takes them)."""
    ins = fn.in_specs if isinstance(fn.in_specs, (list, tuple)) else (fn.in_specs,) * n_inputs
    outs = fn.out_specs if multi else (fn.out_specs,)
    return [_layout(s, fn) for s in ins], [_layout(s, fn) for s in outs]


def _layout(spec, fn) -> tuple[Placement, ...]:
    """A region spec's layout; over the axis the region takes in the head-tail layout (`fn.zigzag`), its shard
    mirrored (`Shard(dim, 2, mirror=True)`)."""
    from .annotate import spec_to_layout

    layout = spec_to_layout(spec, fn.mesh)
    if getattr(fn, "zigzag", None) is None:
        return layout
    i = fn.mesh.axis_names.index(fn.zigzag)
    p = layout[i]
    return (*layout[:i], zigzag(p.dim), *layout[i + 1 :]) if isinstance(p, Shard) else layout


def replicate(v: OpView, cur: list[Placement], hint=()) -> list[Strategy]:
    """Any op: every input whole, the output whole on every rank."""
    return [Strategy((R,) * len(cur), R)]


RULES = {
    "add": binary, "sub": binary, "mul": binary, "div": binary,
    "unary": unary, "linear_unary": linear_unary, "dropout": dropout, "where": unary, "masked_fill": unary,
    "sum": reduction, "mean": reduction, "softmax": softmax, "norm": norm,
    "linear": linear, "matmul": contraction, "einsum": contraction, "sdpa": sdpa,
    "embedding": embedding, "cross_entropy": cross_entropy,
    "view": view, "transpose": permute, "permute": permute, "expand": expand,
    "repeat_interleave": repeat_interleave, "split": split, "cat": cat, "index": index,
    "slice": slice_, "select": slice_, "tri": tri, "like": like, "unknown": replicate,
    "pointwise": pointwise, "scan": scan, "diff": diff, "pad": pad, "new": new, "gather": gather,
    "index_select": index_select, "index_tensor": index_tensor, "stack": stack, "unbind": unbind, "topk": topk,
    "scatter": scatter, "histc": histc,
    "shard_map": shard_map,
}  # fmt: skip

__all__ = ["RULES", "Strategy", "Partial", "Replicate"]
