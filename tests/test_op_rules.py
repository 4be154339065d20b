"""Every op rule of the compiler, checked against the op itself on simulated ranks.

Method (as torch's DTensor strategy validation): hypothesis draws an op of each
kind in `compiler/ops.RULES` with random shapes and values, an axis of 2 to 4
ranks and the placements its inputs have now; every strategy the rule lists
for them is run the way the compiler localizes it, on simulated ranks (local
shards, replicas, and partial sums split 60/40 with zero-sum noise), and the
reassembled output must equal the op on the whole inputs (fp64, 1e-9).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlib_torch.compiler.placement.ops import RULES
from meshlib_torch.compiler.placement.placements import PARTIAL, R, Shard, part_sizes, parts_divide
from meshlib_torch.compiler.placement.shapes import chunk_fits
from meshlib_torch.testing.rule_check import In, OpCase, check, kind, strategies, tensor_order

aten = torch.ops.aten
F64 = torch.float64


def _even_sizes(n: int) -> list[int]:
    return [n, 2 * n, 3 * n, 6 * n, 1, 5]


def _uneven_sizes(n: int) -> list[int]:
    """Sizes torch.chunk cuts into n non-empty, mostly unequal pieces (7 over 4: 2, 2, 2, 1)."""
    return [2 * n - 1, 3 * n - 1, 7, n, 2 * n, 1]


SIZES = {"now": _even_sizes}


def _dims(draw, rank: int, n: int) -> tuple[int, ...]:
    """A shape whose dims mostly split over n ranks (and sometimes in 2 or 3 groups first); in the
    uneven test, mostly do not."""
    return tuple(draw(st.sampled_from(SIZES["now"](n))) for _ in range(rank))


def _rand(shape, gen, dtype=F64):
    return torch.randn(shape, generator=gen, dtype=dtype)


# -- one generator per op kind: (draw, n, gen) -> OpCase ----------------------------------------------
def _binary(draw, n, gen):
    in_place = [aten.add_.Tensor, aten.div_.Tensor]  # as torch.export keeps `x += y` and `x /= y`
    fn = draw(st.sampled_from([operator.add, operator.sub, operator.mul, operator.truediv, aten.add.Tensor, *in_place]))
    shape = _dims(draw, draw(st.integers(1, 3)), n)
    other = shape[draw(st.integers(0, len(shape) - 1)) :]  # broadcasts from the right
    if draw(st.booleans()):
        return OpCase(fn, [_rand(shape, gen)], (In(0), 1.5))
    divides = fn in (operator.truediv, aten.div_.Tensor)
    y = _rand(other, gen).abs() + 1 if divides else _rand(other, gen)
    return OpCase(fn, [_rand(shape, gen), y], (In(0), In(1)))


def _unary(draw, n, gen):
    fn = draw(st.sampled_from([F.gelu, F.silu, torch.tanh, torch.exp, aten.rsqrt.default, torch.sin, torch.erf]))
    x = _rand(_dims(draw, draw(st.integers(1, 3)), n), gen)
    return OpCase(fn, [x.abs() + 0.5 if fn is aten.rsqrt.default else x], (In(0),))


def _linear_unary(draw, n, gen):
    fn = draw(st.sampled_from([torch.neg, aten.clone.default, "contiguous", aten.alias.default]))
    return OpCase(fn, [_rand(_dims(draw, 2, n), gen)], (In(0),))


def _dropout(draw, n, gen):  # deterministic forms only: no drop, or eval
    p, training = draw(st.sampled_from([(0.0, True), (0.3, False)]))
    return OpCase(F.dropout, [_rand(_dims(draw, 2, n), gen)], (In(0), p, training))


def _where(draw, n, gen):
    shape = _dims(draw, 2, n)
    return OpCase(torch.where, [_rand(shape, gen) > 0, _rand(shape, gen), _rand(shape, gen)], (In(0), In(1), In(2)))


def _masked_fill(draw, n, gen):
    shape = _dims(draw, 2, n)
    return OpCase(aten.masked_fill.Scalar, [_rand(shape, gen), _rand(shape[-1:], gen) > 0], (In(0), In(1), -3.0))


def _reduction(draw, n, gen):
    fn = draw(st.sampled_from([torch.sum, torch.mean, aten.sum.dim_IntList, aten.mean.dim]))
    shape = _dims(draw, 3, n)
    dims = draw(st.sampled_from([[0], [1], [2], [0, 2], [-1]]))
    return OpCase(fn, [_rand(shape, gen)], (In(0), dims, draw(st.booleans())))


def _softmax(draw, n, gen):
    fn = draw(st.sampled_from([aten._softmax.default, aten._log_softmax.default]))
    return OpCase(fn, [_rand(_dims(draw, 3, n), gen)], (In(0), draw(st.integers(-1, 2)), False))


def _norm(draw, n, gen):
    shape = _dims(draw, 3, n)
    h = shape[-1:]
    if draw(st.booleans()):
        return OpCase(F.layer_norm, [_rand(shape, gen), _rand(h, gen), _rand(h, gen)], (In(0), h, In(1), In(2), 1e-5))
    return OpCase(F.rms_norm, [_rand(shape, gen), _rand(h, gen)], (In(0), h, In(1), 1e-5))


def _linear(draw, n, gen):
    b, k, o = _dims(draw, 3, n)
    return OpCase(F.linear, [_rand((b, 3, k), gen), _rand((o, k), gen)], (In(0), In(1)))


def _matmul(draw, n, gen):
    fn = draw(st.sampled_from([torch.matmul, aten.mm.default, aten.bmm.default]))
    b, m, k, o = _dims(draw, 4, n)
    if fn is aten.mm.default:
        return OpCase(fn, [_rand((m, k), gen), _rand((k, o), gen)], (In(0), In(1)))
    return OpCase(fn, [_rand((b, m, k), gen), _rand((b, k, o) if fn is aten.bmm.default else (k, o), gen)], (In(0), In(1)))


def _einsum(draw, n, gen):
    b, h, q, d = _dims(draw, 4, n)
    eq = draw(st.sampled_from(["bhqd,bhkd->bhqk", "bhqd,hd->bhq"]))
    second = (b, h, q, d) if eq.startswith("bhqd,bhkd") else (h, d)
    return OpCase(torch.einsum, [_rand((b, h, q, d), gen), _rand(second, gen)], (eq, In(0), In(1)))


def _sdpa(draw, n, gen):
    b, h, s, d = _dims(draw, 4, n)
    q, k, v = (_rand((b, h, s, d), gen) for _ in range(3))
    if draw(st.booleans()):
        return OpCase(F.scaled_dot_product_attention, [q, k, v], (In(0), In(1), In(2)), {"is_causal": True})
    mask = torch.rand((b, 1, s, s), generator=gen) > 0.3
    mask[..., 0] = True
    return OpCase(F.scaled_dot_product_attention, [q, k, v, mask], (In(0), In(1), In(2), In(3)))


def _embedding(draw, n, gen):
    vocab, h = draw(st.sampled_from([2 * n, 4 * n])), draw(st.sampled_from([n, 2 * n]))
    ids = torch.randint(0, vocab, _dims(draw, 2, n), generator=gen)
    return OpCase(F.embedding, [ids, _rand((vocab, h), gen)], (In(0), In(1)))


def _cross_entropy(draw, n, gen):
    rows, classes = draw(st.sampled_from([n, 4 * n])), draw(st.sampled_from([2 * n, 3 * n]))
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[0] = -100
    red = draw(st.sampled_from(["mean", "sum", "none"]))
    return OpCase(F.cross_entropy, [_rand((rows, classes), gen), target], (In(0), In(1)), {"reduction": red})


def _view(draw, n, gen):
    a, b, c = _dims(draw, 3, n)
    to = draw(st.sampled_from([(a * b, c), (a, b * c), (a * b * c,), (a, b, c, 1), (1, a, b, c)]))
    return OpCase("view", [_rand((a, b, c), gen)], (In(0), *to))


def _view_back(draw, n, gen):  # a merged dim split again (a grouped shard back to a plain one)
    a, b, c = _dims(draw, 3, n)
    return OpCase(aten.view.default, [_rand((a * b, c), gen)], (In(0), [a, b, c]))


def _transpose(draw, n, gen):
    return OpCase(torch.transpose, [_rand(_dims(draw, 3, n), gen)], (In(0), 0, 2))


def _permute(draw, n, gen):
    perm = draw(st.permutations([0, 1, 2]))
    return OpCase(aten.permute.default, [_rand(_dims(draw, 3, n), gen)], (In(0), list(perm)))


def _expand(draw, n, gen):
    a, b = _dims(draw, 2, n)
    return OpCase(aten.expand.default, [_rand((a, 1, b), gen)], (In(0), [a, 2 * n, b]))


def _repeat_interleave(draw, n, gen):
    return OpCase(torch.repeat_interleave, [_rand(_dims(draw, 3, n), gen)], (In(0), 2, draw(st.integers(0, 2))))


def _split(draw, n, gen):
    a, b = _dims(draw, 2, n)
    if draw(st.booleans()):
        return OpCase(torch.split, [_rand((a, 3 * b), gen)], (In(0), b, 1))
    return OpCase(aten.split_with_sizes.default, [_rand((a, 3 * b), gen)], (In(0), [b, 2 * b], 1))


def _cat(draw, n, gen):
    a, b = _dims(draw, 2, n)
    dim = draw(st.integers(0, 1))
    return OpCase(torch.cat, [_rand((a, b), gen), _rand((a, b), gen)], ([In(0), In(1)], dim))


def _index(draw, n, gen):
    index = draw(st.sampled_from([(slice(None), 0), (Ellipsis, slice(0, 2)), (None, slice(None)), 0]))
    return OpCase(operator.getitem, [_rand(_dims(draw, 3, n), gen)], (In(0), index))


def _slice(draw, n, gen):
    if draw(st.booleans()):
        return OpCase(aten.slice.Tensor, [_rand(_dims(draw, 3, n), gen)], (In(0), draw(st.integers(0, 2)), 0, 1))
    return OpCase(aten.select.int, [_rand(_dims(draw, 3, n), gen)], (In(0), draw(st.integers(0, 2)), 0))


def _tri(draw, n, gen):
    return OpCase(draw(st.sampled_from([torch.tril, torch.triu])), [_rand(_dims(draw, 3, n), gen)], (In(0),))


def _like(draw, n, gen):
    return OpCase(draw(st.sampled_from([torch.zeros_like, torch.ones_like])), [_rand(_dims(draw, 2, n), gen)], (In(0),))


def _unknown(draw, n, gen):
    return OpCase(torch.special.erfcx, [_rand(_dims(draw, 2, n), gen)], (In(0),))


def _pointwise(draw, n, gen):
    fn = draw(st.sampled_from([aten.eq.Tensor, aten.le.Tensor, torch.maximum, aten.__and__.Tensor]))
    shape = _dims(draw, 2, n)
    if fn is aten.__and__.Tensor:
        return OpCase(fn, [_rand(shape, gen) > 0, _rand(shape[-1:], gen) > 0], (In(0), In(1)))
    x = torch.randint(0, 3, shape, generator=gen).to(F64)
    return OpCase(fn, [x, torch.randint(0, 3, shape[-1:], generator=gen).to(F64)], (In(0), In(1)))


def _scan(draw, n, gen):
    return OpCase(torch.cumsum, [_rand(_dims(draw, 3, n), gen)], (In(0), draw(st.integers(-1, 2))))


def _diff(draw, n, gen):
    x = _rand(_dims(draw, 2, n), gen)
    return OpCase(aten.diff.default, [x, x[:, :1].clone()], (In(0), 1, -1, In(1)))


def _pad(draw, n, gen):
    return OpCase(aten.pad.default, [_rand(_dims(draw, 3, n), gen)], (In(0), [0, 1], "constant", -100.0))


def _new(draw, n, gen):
    return OpCase(aten.new_ones.default, [_rand(_dims(draw, 2, n), gen)], (In(0), [2, 3]))


def _gather(draw, n, gen):
    a, b = _dims(draw, 2, n)
    idx = torch.randint(0, b, (a, b), generator=gen)
    return OpCase(torch.gather, [_rand((a, b), gen), idx], (In(0), draw(st.integers(0, 1)) * 0 + 1, In(1)))


def _index_select(draw, n, gen):
    a, b = _dims(draw, 2, n)
    idx = torch.randint(0, a, (2 * n,), generator=gen)
    return OpCase(torch.index_select, [_rand((a, b), gen), idx], (In(0), 0, In(1)))


def _index_tensor(draw, n, gen):
    a, b, c = _dims(draw, 3, n)
    rows = torch.randint(0, b, (a, 1), generator=gen)
    cols = torch.randint(0, c, (1, 2 * n), generator=gen)
    if draw(st.booleans()):
        return OpCase(aten.index.Tensor, [_rand((a, b, c), gen), rows, cols], (In(0), [None, In(1), In(2)]))
    return OpCase(aten.index.Tensor, [_rand((b, c), gen), rows], (In(0), [In(1)]))


def _stack(draw, n, gen):
    shape = _dims(draw, 2, n)
    return OpCase(torch.stack, [_rand(shape, gen), _rand(shape, gen)], ([In(0), In(1)], draw(st.integers(0, 2))))


def _unbind(draw, n, gen):
    return OpCase(torch.unbind, [_rand((3, *_dims(draw, 2, n)), gen)], (In(0), 0))


def _topk(draw, n, gen):
    shape = _dims(draw, 3, n)
    dim = draw(st.integers(-1, 2))
    return OpCase(torch.topk, [_rand(shape, gen)], (In(0), draw(st.integers(1, shape[dim])), dim))


def _scatter(draw, n, gen):
    a, b = _dims(draw, 2, n)
    dim = draw(st.integers(0, 1))
    index = torch.randint(0, (a, b)[dim], (a, b), generator=gen)
    if draw(st.booleans()):
        return OpCase(torch.scatter_add, [_rand((a, b), gen), index, _rand((a, b), gen)], (In(0), dim, In(1), In(2)))
    if draw(st.booleans()):  # in place into zeros, a mask of chosen groups (DeepSeek-V3's router)
        return OpCase(aten.scatter_.value, [torch.zeros(a, b, dtype=F64), index[:, :1] * 0], (In(0), dim, In(1), 1.0))
    return OpCase(torch.scatter, [_rand((a, b), gen), index[:, :1] * 0, _rand((a, b), gen)], (In(0), dim, In(1), In(2)))


def _histc(draw, n, gen):
    """Counts of values in a given range (Mixtral's balancing loss counts the chosen experts so), or in
    the data's own range (min == max)."""
    bins = draw(st.sampled_from([4, 8]))
    x = torch.randint(0, bins, _dims(draw, draw(st.integers(1, 2)), n), generator=gen).to(F64)
    lo, hi = draw(st.sampled_from([(0, bins), (1, bins - 1), (0, 0)]))
    return OpCase(torch.histc, [x], (In(0), bins, lo, hi))


CASES = {
    "add": _binary, "unary": _unary, "linear_unary": _linear_unary, "dropout": _dropout, "where": _where,
    "masked_fill": _masked_fill, "sum": _reduction, "softmax": _softmax, "norm": _norm, "linear": _linear,
    "matmul": _matmul, "einsum": _einsum, "sdpa": _sdpa, "embedding": _embedding, "cross_entropy": _cross_entropy,
    "view": _view, "view back": _view_back, "transpose": _transpose, "permute": _permute, "expand": _expand,
    "repeat_interleave": _repeat_interleave, "split": _split, "cat": _cat, "index": _index, "slice": _slice,
    "tri": _tri, "like": _like, "unknown": _unknown, "pointwise": _pointwise, "scan": _scan, "diff": _diff,
    "pad": _pad, "new": _new, "gather": _gather, "index_select": _index_select, "index_tensor": _index_tensor,
    "stack": _stack, "unbind": _unbind, "topk": _topk, "scatter": _scatter, "histc": _histc,
}  # fmt: skip
# kinds that share a rule with one above: "sub", "mul", "div" (binary), "mean" (reduction), "select" (slice)
SAME_RULE = {"sub": "add", "mul": "add", "div": "add", "mean": "sum", "select": "slice"}


PARTS = [(1, 2), (2, 1, 1), (1, 2, 3)]  # unequal parts (grouped-query attention's q, k, v: 2:1:1)


# kinds whose rule is checked by running the models that use them, not on random inputs here:
# "shard_map" (a region's layouts are its declared specs; tests/test_regions.py trains through one)
BY_MODEL = {"shard_map"}


def test_every_rule_has_a_generator():
    assert set(RULES) == (set(CASES) - {"view back"}) | set(SAME_RULE) | BY_MODEL


def _placements(draw, case: OpCase, n: int, uneven: bool = False) -> list:
    """Current placements of the op's tensor inputs (in the rule's order): shards of dims that split
    (with `uneven`, in torch.chunk's pieces too), R, and partial sums of floating-point values."""
    out = []
    for i in tensor_order(case):
        x = case.inputs[i]
        options = [R] + [Shard(d) for d in range(x.dim()) if x.shape[d] % n == 0 or uneven and chunk_fits(x.shape[d], n)]
        options += [Shard(d, g) for d in range(x.dim()) for g in (2, 3) if x.shape[d] % (g * n) == 0]
        options += [Shard(d, parts=w) for d in range(x.dim()) for w in PARTS if parts_divide(Shard(0, parts=w), x.shape[d], n)]
        if x.is_floating_point():
            options.append(PARTIAL)
        out.append(draw(st.sampled_from(options)))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_equals_the_unsharded_op(name, data):
    n = data.draw(st.integers(2, 4), label="ranks")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    case = CASES[name](data.draw, n, gen)
    assert RULES[kind(case)] is RULES[name.removesuffix(" back")], case.target
    cur = _placements(data.draw, case, n)
    for strategy in strategies(case, cur, n):
        try:
            check(case, strategy, n)
        except AssertionError as err:
            raise AssertionError(f"{name} {case.target} on {n} ranks, inputs {cur}: strategy {strategy} is wrong: {err}") from None


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_on_uneven_shards_equals_the_unsharded_op(name, data):
    """The same with dims that do not divide, cut in torch.chunk's pieces (uneven='chunk'): every strategy
    the compiler may pick for them (a view only where it keeps the dim as it is, a mean rescaled by
    each piece's count, the vocab-parallel ops at each piece's offset) equals the op."""
    SIZES["now"] = _uneven_sizes
    try:
        n = data.draw(st.integers(2, 4), label="ranks")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        case = CASES[name](data.draw, n, gen)
        cur = _placements(data.draw, case, n, uneven=True)
        for strategy in strategies(case, cur, n, uneven=True):
            try:
                check(case, strategy, n, uneven=True)
            except AssertionError as err:
                raise AssertionError(
                    f"{name} {case.target} on {n} ranks, inputs {cur}: strategy {strategy} is wrong: {err}"
                ) from None
    finally:
        SIZES["now"] = _even_sizes


# -- a dim held in parts, cut into them --------------------------------------------------------------
def _cut_one_part(draw, n, gen, weights):
    """A fused projection's output (rows, parts along dim 1, in `weights`) cut into its parts: one part by
    `aten.slice`, `narrow` or basic indexing, or every part by `split` into their sizes."""
    unit = n * draw(st.sampled_from([1, 2]))
    whole = sum(weights) * unit
    x = _rand((draw(st.sampled_from([n, 3])), whole, 2), gen)
    sizes = part_sizes(Shard(1, parts=weights) if len(set(weights)) > 1 else Shard(1, len(weights)), whole)
    i = draw(st.integers(0, len(sizes) - 1))
    start = sum(sizes[:i])
    end = start + sizes[i]
    form = draw(st.sampled_from(["slice", "open slice", "narrow", "index", "split"]))
    if form == "slice":
        return OpCase(aten.slice.Tensor, [x], (In(0), 1, start, end))
    if form == "open slice":  # `qkv[..., a:]` as torch.export writes it: the end is INT64_MAX
        return OpCase(aten.slice.Tensor, [x], (In(0), -2, start, end if i < len(sizes) - 1 else 2**63 - 1))
    if form == "narrow":
        return OpCase("narrow", [x], (In(0), 1, start, sizes[i]))
    if form == "index":
        return OpCase(operator.getitem, [x], (In(0), (Ellipsis, slice(start, end), slice(None))))
    return OpCase(torch.split, [x], (In(0), list(sizes), 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_cut_into_parts_of_a_dim_held_in_parts_needs_no_gather(data):
    """A dim split in parts (unequal, or equal groups) sliced to exactly one part, or split into all of
    them: the rule offers a plain shard of the part(s) with the input as it is, and it and every other
    strategy offered equals the op on the whole input."""
    n = data.draw(st.integers(2, 4), label="ranks")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    weights = data.draw(st.sampled_from(PARTS + [(1, 1), (1, 1, 1)]), label="parts")
    case = _cut_one_part(data.draw, n, gen, weights)
    held = Shard(1, parts=weights) if len(set(weights)) > 1 else Shard(1, len(weights))
    offered = strategies(case, [held], n)
    kept = [s for s in offered if s.inputs == (held,)]
    assert kept and all(o == Shard(1) for o in (kept[0].output if isinstance(kept[0].output, tuple) else (kept[0].output,))), (case, offered)
    for strategy in offered:
        try:
            check(case, strategy, n)
        except AssertionError as err:
            raise AssertionError(f"{case.target} {case.args[1:]} on {n} ranks, input {held}: {strategy} is wrong: {err}") from None


VIEWS = {  # n -> (shape, view, dim held in parts 1:2:3, the view's dim that carries them)
    "rows merged": lambda n: ((2, 3, 6 * n), (6, 6 * n), 2, 1),
    "split into heads": lambda n: ((2, 3, 18 * n), (2, 3, 6 * n, 3), 2, 2),
    "merged with a minor dim": lambda n: ((2, 6 * n, 3), (2, 18 * n), 1, 1),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_view_carries_unequal_parts(n, name):
    """A view of a dim held in parts 1:2:3 where the dim leads its run of merged or split dims: the
    parts' shard carries over, and every strategy offered equals the view of the whole."""
    shape, to, dim, out_dim = VIEWS[name](n)
    case = OpCase(aten.view.default, [_rand(shape, torch.Generator().manual_seed(n))], (In(0), list(to)))
    held = Shard(dim, parts=(1, 2, 3))
    offered = strategies(case, [held], n)
    assert held.at(out_dim) in [s.output for s in offered], offered
    for strategy in offered:
        check(case, strategy, n)
