"""meshlib_torch.shard_map and its lax collectives equal jax.shard_map and jax.lax, values and gradients.

Method: each per-shard program in `shard_map_cases` is written once against a `lax` namespace and
runs twice with the same specs and inputs (fp64): on meshlib's shard_map on real gloo ranks (one pool
job per mesh runs every case), and on `jax.shard_map` over CPU host devices in this process (the
oracle, as in test_layout_vs_jax.py). Each rank's whole results must equal JAX's, and after
`backward()` on sum(result * ct) each global input's `.grad` must equal `jax.grad` of the same sum.
Meshes of one, two and three axes (4 and 8 ranks); axis names as tuples, in and out of mesh order.
"""

from __future__ import annotations

import numpy as np
import optree
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
import shard_map_cases as cases  # noqa: E402
from shard_map_cases import Case  # noqa: E402

from meshlib import Mesh, P  # noqa: E402
from meshlib.interop.jax import to_jax_mesh, to_jax_spec  # noqa: E402
from meshlib_torch.testing.pool import get_pool  # noqa: E402

pytestmark = pytest.mark.ranks

JAX_OPS = cases.SimpleNamespace(
    relu=jax.nn.relu, tanh=jnp.tanh, like=lambda i, x: i.astype(x.dtype), expand=jnp.expand_dims, squeeze=jnp.squeeze
)

ONE = Mesh(i=4)
TWO = Mesh(dp=2, tp=4)
THREE = Mesh(dp=2, pp=2, tp=2)

CASES = {
    ONE: [
        Case("psum", "reduce", dict(op="psum", ax="i"), ((8, 3),), P("i"), P()),
        Case("pmean", "reduce", dict(op="pmean", ax="i"), ((8, 3),), P("i"), P()),
        Case("pmax", "reduce", dict(op="pmax", ax="i"), ((8, 3),), P("i"), P(), grad=False),
        Case("pmin", "reduce", dict(op="pmin", ax="i"), ((8, 3),), P("i"), P(), grad=False),
        Case("all_gather stacked", "gather", dict(ax="i"), ((8, 3),), P("i"), P("i")),
        Case("all_gather tiled axis 1", "gather", dict(ax="i", axis=1, tiled=True), ((4, 8),), P(None, "i"), P(None, "i")),
        Case("all_gather_invariant", "gather", dict(ax="i", axis=1, tiled=True, to="invarying"), ((4, 8),), P(None, "i"), P()),
        Case("all_gather_invariant stacked", "gather", dict(ax="i", to="invarying"), ((8, 3),), P("i"), P()),
        Case("psum_scatter", "scatter", dict(ax="i"), ((16, 4),), P("i"), P("i")),
        Case("psum_scatter tiled dim 1", "scatter", dict(ax="i", dim=1, tiled=True), ((8, 8),), P("i"), P("i")),
        Case("all_to_all 0->1", "a2a", dict(ax="i", split=0, concat=1), ((16, 3),), P("i"), P("i")),
        Case("all_to_all 1->0", "a2a", dict(ax="i", split=1, concat=0), ((4, 4, 8),), P(None, None, "i"), P("i")),
        Case("all_to_all tiled uneven 1->0", "a2a", dict(ax="i", split=1, concat=0, tiled=True), ((8, 12),), P("i"), P("i")),
        Case("all_to_all tiled same dim", "a2a", dict(ax="i", split=0, concat=0, tiled=True), ((32, 2),), P("i"), P("i")),
        Case("ring of ppermutes", "ring", dict(ax="i", n=4), ((8, 3),), P("i"), P("i")),
        Case("ppermute partial", "shift", dict(ax="i", perm=[(0, 2), (1, 0), (3, 3)]), ((8, 3),), P("i"), P("i")),
        Case("axis_index", "index_scale", dict(ax="i"), ((5,),), P(), P("i")),
        Case("psum of an invariant", "invariant_psum", dict(ax="i"), ((3,),), P(), P()),
        Case("pcast to varying", "pcast_use", dict(ax="i"), ((2, 3), (8, 3)), (P(), P("i")), P("i")),
        Case("trees in and out", "tree_io", dict(ax="i"), ({"a": (8, 3), "b": (2, 3)},), ({"a": P("i"), "b": P()},), {"s": P(), "c": P()}),
        Case("psum / axis_size", "mean_by_size", dict(ax="i"), ((8, 3),), P("i"), P()),
        Case("psum of a pytree", "tree_psum", dict(ax="i"), ((8, 3),), P("i"), {"a": P(), "b": P()}),
        # untyped (check_vma=False): psum is its own transpose, the boundary scales and sums instead
        Case("unchecked psum", "reduce", dict(op="psum", ax="i"), ((8, 3),), P("i"), P(), check_vma=False),
        Case("unchecked psum of an invariant", "invariant_psum", dict(ax="i"), ((3,),), P(), P(), check_vma=False),
        Case("unchecked gather", "gather", dict(ax="i", axis=1, tiled=True), ((4, 8),), P(None, "i"), P(None, "i"), check_vma=False),
        Case("unchecked axis_index", "index_scale", dict(ax="i"), ((5,),), P(), P("i"), check_vma=False),
        Case("unchecked pcast", "pcast_use", dict(ax="i"), ((2, 3), (8, 3)), (P(), P("i")), P("i"), check_vma=False),
        Case("unchecked ring", "ring", dict(ax="i", n=4), ((8, 3),), P("i"), P("i"), check_vma=False),
        Case("unchecked trees", "tree_io", dict(ax="i"), ({"a": (8, 3), "b": (2, 3)},), ({"a": P("i"), "b": P()},), {"s": P(), "c": P()}, check_vma=False),
    ],
    TWO: [
        Case("megatron mlp", "megatron", dict(tp="tp"), ((4, 6), (6, 8), (8, 6)), (P("dp"), P(None, "tp"), P("tp", None)), P("dp")),
        Case("sequence parallel", "sequence_parallel", dict(tp="tp"), ((8, 6), (6, 8), (8, 6)), (P("tp"), P(None, "tp"), P("tp", None)), P("tp")),
        Case("psum over both", "reduce", dict(op="psum", ax=("dp", "tp")), ((4, 8),), P("dp", "tp"), P()),
        Case("psum over both, reversed", "reduce", dict(op="psum", ax=("tp", "dp")), ((4, 8),), P("dp", "tp"), P()),
        Case("gather invariant, tp major", "gather", dict(ax=("tp", "dp"), tiled=True, to="invarying"), ((16, 3),), P(("tp", "dp")), P()),
        Case("gather stacked, tp major", "gather", dict(ax=("tp", "dp")), ((16, 3),), P(("tp", "dp")), P(("tp", "dp"))),
        Case("all_to_all tp major", "a2a", dict(ax=("tp", "dp"), split=1, concat=0, tiled=True), ((16, 16),), P(("tp", "dp")), P(("tp", "dp"))),
        Case("ring over tp", "ring", dict(ax="tp", n=4), ((4, 8),), P("dp", "tp"), P("dp", "tp")),
        Case("ppermute over both", "shift", dict(ax=("dp", "tp"), perm=[(j, (3 * j + 1) % 8) for j in range(8)]), ((16,),), P(("dp", "tp")), P(("dp", "tp"))),
        Case("axis_index tp major", "index_scale", dict(ax=("tp", "dp")), ((3,),), P(), P(("tp", "dp"))),
        Case("psum of a dp-sharded invariant", "invariant_psum", dict(ax="tp"), ((4, 3),), P("dp"), P("dp")),
        Case("pmax over tp", "reduce", dict(op="pmax", ax="tp"), ((2, 8),), P(None, "tp"), P(), grad=False),
        Case("psum_scatter over dp", "scatter", dict(ax="dp", tiled=True), ((8, 4),), P(None, "tp"), P("dp", "tp")),
        Case("psum_scatter tp major", "scatter", dict(ax=("tp", "dp"), dim=1, tiled=True), ((3, 16),), P(), P(None, ("tp", "dp"))),
        Case("unchecked megatron", "megatron", dict(tp="tp"), ((4, 6), (6, 8), (8, 6)), (P("dp"), P(None, "tp"), P("tp", None)), P("dp"), check_vma=False),
        Case("unchecked sequence parallel", "sequence_parallel", dict(tp="tp"), ((8, 6), (6, 8), (8, 6)), (P("tp"), P(None, "tp"), P("tp", None)), P("tp"), check_vma=False),
    ],
    THREE: [
        Case("two levels", "two_level", dict(outer=("dp", "pp"), inner="tp"), ((8, 6),), P(("dp", "pp"), "tp"), P()),
        Case("megatron, data over two axes", "megatron", dict(tp="tp"), ((8, 6), (6, 4), (4, 6)), (P(("dp", "pp")), P(None, "tp"), P("tp", None)), P(("dp", "pp"))),
        Case("psum_scatter over pp,tp", "scatter", dict(ax=("pp", "tp"), tiled=True), ((8, 4),), P("dp"), P(("dp", "pp", "tp"))),
        Case("all_to_all over pp", "a2a", dict(ax="pp", split=1, concat=0), ((4, 2, 3),), P("dp"), P(("dp", "pp"))),
        Case("ring over tp,dp", "ring", dict(ax=("tp", "dp"), n=4), ((8, 3),), P(("tp", "dp")), P(("tp", "dp"))),
        Case("axis_index over three", "index_scale", dict(ax=("dp", "pp", "tp")), ((2,),), P(), P(("dp", "pp", "tp"))),
        Case("sequence parallel over pp", "sequence_parallel", dict(tp="pp"), ((8, 6), (6, 4), (4, 6)), (P("pp"), P(None, "pp"), P("pp", None)), P("pp")),
    ],
}  # fmt: skip


def _jax_specs(tree):
    return optree.tree_map(to_jax_spec, tree, none_is_leaf=True)


def _inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    return optree.tree_map(lambda shape: rng.standard_normal(shape), case.inputs, is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(n, int) for n in s))


def _jax_fn(mesh: Mesh, case: Case, program: str):
    return jax.shard_map(
        getattr(cases, program)(jax.lax, JAX_OPS, **case.kw), mesh=to_jax_mesh(mesh),
        in_specs=_jax_specs(case.in_specs), out_specs=_jax_specs(case.out_specs), check_vma=case.check_vma,
    )  # fmt: skip


def _jax_run(mesh: Mesh, case: Case, xs, seed: int):
    """JAX's results, random cotangents of their shapes, and jax.grad of sum(result * ct): one jitted
    function for both (eager jax.shard_map compiles every op on its own)."""
    f = _jax_fn(mesh, case, case.program)
    rng = np.random.default_rng(seed + 1000)
    cts = [rng.standard_normal(o.shape) for o in jax.tree_util.tree_leaves(jax.eval_shape(f, *xs))]
    if not case.grad:
        return [np.asarray(o) for o in jax.tree_util.tree_leaves(jax.jit(f)(*xs))], cts, None
    untiled_a2a = case.program == "a2a" and not case.kw.get("tiled") and case.kw["split"] != case.kw["concat"]
    g = _jax_fn(mesh, case, "a2a_expanded") if untiled_a2a else f
    loss = lambda *a: sum((o * c).sum() for o, c in zip(jax.tree_util.tree_leaves(g(*a)), cts))
    both = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)))
    outs, grads = both(*xs)
    return [np.asarray(o) for o in jax.tree_util.tree_leaves(outs)], cts, [np.asarray(v) for v in jax.tree_util.tree_leaves(grads)]


@pytest.mark.parametrize("mesh", list(CASES), ids=lambda m: "x".join(f"{a}{n}" for a, n in m.shape.items()))
def test_cases_equal_jax(mesh):
    table = CASES[mesh]
    with jax.enable_x64(True):
        inputs = [_inputs(case, seed) for seed, case in enumerate(table)]
        oracle = [_jax_run(mesh, case, xs, seed) for seed, (case, xs) in enumerate(zip(table, inputs))]
    ranks = get_pool(mesh.size).run(cases.run_cases, mesh, table, inputs, [cts for _, cts, _ in oracle])
    for rank, rows in enumerate(ranks):
        for case, row, (outs, _, grads) in zip(table, rows, oracle):
            where = f"{case.name} on rank {rank}"
            assert len(row["out"]) == len(outs), where
            for got, want in zip(row["out"], outs):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=where)
            if case.grad:
                for got, want in zip(row["grad"], grads):
                    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{where}: gradient")


def test_dtensors_in_and_out_with_gradients():
    """Inputs as DTensors (already laid out, resharded, partial) and a result fed to a second shard_map:
    the whole gradients equal one process's autograd of the same math; results carry the out specs'
    placements (tp-major blocks of P(("tp", "dp")) a strided shard, as JAX lays them out)."""
    mesh = Mesh(dp=2, tp=2)
    ranks = get_pool(mesh.size).run(cases.dtensor_job, mesh)
    from torch.distributed.tensor import Replicate, Shard

    from meshlib_torch.torch_private import StridedShard

    for rank, got in enumerate(ranks):
        assert got["y"] == ((Shard(0), Replicate()), True)
        assert got["z"] == ((Shard(0), Shard(1)), True)
        assert got["grads"] == [True, True, True] and all(got["grad placements"])
        assert got["partial in"]
        placements, local, whole = got["strided"]
        assert placements == (StridedShard(0, split_factor=2), Shard(0)) and whole
        block = 2 * mesh.coords(rank)["tp"] + mesh.coords(rank)["dp"]  # JAX: tp major
        assert local == [got["x"][block]]


@pytest.mark.parametrize("mesh, axis", [(Mesh(ep=4), "ep"), (Mesh(a=2, b=2), ("b", "a"))], ids=["ep", "b-major"])
def test_ragged_all_to_all_equals_its_reference(mesh, axis):
    """jax 0.10 cannot run ragged_all_to_all on CPU ("HLO opcode ragged-all-to-all is not supported by
    XLA:CPU"), so the oracle is its docstring's pseudocode in one process (`ragged_reference`), with
    torch autograd for the gradients: two slices per destination, empty ones among them, gaps between.
    Over a tuple of axes, rank r of the reference is index r along it (b major here), as jax's replica
    groups order it."""
    n = 4
    problem = cases.ragged_problem(n, per=2, rows=20, width=3, seed=5)
    ct = np.random.default_rng(6).standard_normal(problem["output"].shape)
    want, operand_grad, output_grad = cases.ragged_reference(problem, n, ct)
    ranks = get_pool(n).run(cases.ragged_job, mesh, axis, problem, ct)
    sends = problem["send_sizes"].reshape(n, -1).sum(1)
    index = [mesh.axis_coord(r, axis) for r in range(n)]  # each rank's index along the axis name
    for rank, got in enumerate(ranks):
        np.testing.assert_allclose(got["out"], want, rtol=0, atol=0)
        np.testing.assert_allclose(got["operand"], operand_grad, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got["output"], output_grad, rtol=1e-12, atol=1e-12)
        assert got["forward bytes"] == {"ragged_all_to_all": 8 * 4 + int(sends[index[rank]]) * 3 * 8}  # offsets, rows


def test_dry_run_records_equal_what_the_eager_run_counts():
    """`spmd.region_collectives` on meta tensors of one rank's shards lists the collectives, forward and
    backward, with the bytes `COUNTER` counts when the same program runs on gloo ranks (shard_map's own
    boundary gathers aside: a compiled region's inputs are already shards)."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch.spmd import region_collectives

    case = CASES[TWO][0]  # the Megatron MLP
    xs = _inputs(case, 0)
    cts = [np.ones((4, 6))]
    counted = get_pool(TWO.size).run(cases.counted_job, TWO, case, xs, cts)[0]
    local = [ShapeDtype((2, 6), "float64"), ShapeDtype((6, 2), "float64"), ShapeDtype((2, 6), "float64")]
    f = cases.megatron(__import__("meshlib_torch").lax, cases.torch_ops(), tp="tp")
    plan = region_collectives(f, mesh=TWO, in_specs=case.in_specs, out_specs=case.out_specs, args=tuple(local))
    recorded: dict = {}
    for r in plan.records:
        key = (r.phase, r.kind, "_".join(r.axes), r.op)
        recorded[key] = recorded.get(key, 0) + r.bytes
    eager = {k: b for k, b in counted.items() if k[3] != "shard_map"}
    assert recorded == eager == {
        ("forward", "all_reduce", "tp", "psum"): 2 * 6 * 8,  # the row-parallel output
        ("backward", "all_reduce", "tp", "pvary"): 2 * 6 * 8,  # x's gradient: x is invariant over tp
        ("backward", "all_reduce", "dp", "pvary"): 2 * (6 * 2 * 8),  # w1's and w2's: invariant over dp
    }
    assert all(r.source.startswith("shard_map_cases.py:") and r.priced == "exact" for r in plan.records)
    assert plan.outputs.shape == (2, 6) and plan.varying == frozenset({"dp"})
    c = plan.records[0].to_collective(node="mlp")
    assert (c.kind, c.axes, c.bytes, c.group, c.phase, c.node) == ("all_reduce", ("tp",), 96, 4, "forward", "mlp")


def test_dry_run_prices_a_ragged_all_to_all_from_what_its_caller_declares():
    from meshlib.tree import ShapeDtype
    from meshlib_torch import lax
    from meshlib_torch.spmd import Bound, Expected, region_collectives

    mesh = Mesh(ep=4)
    rows, sizes = ShapeDtype((16, 8), "float32"), ShapeDtype((4,), "int32")
    args = (rows, rows, sizes, sizes, sizes, sizes)

    def priced(price):
        f = lambda *a: lax.ragged_all_to_all(*a, axis_name="ep", price=price)
        plan = region_collectives(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), args=args)
        return [(r.phase, r.bytes, r.priced) for r in plan.records]

    exchange = ("forward", 4 * 4, "exact")  # where each slice lands: K int32 offsets
    assert priced(None) == [exchange, ("forward", 16 * 8 * 4, "bound"), *priced(None)[2:]]  # default: every row
    assert priced(Bound(10))[1] == ("forward", 10 * 8 * 4, "bound")
    assert priced(Expected(3))[1] == ("forward", 3 * 8 * 4, "expected")
    backward = priced(Expected(3))[2:]  # three offset exchanges (as jax's transpose), then the rows sent back
    assert [b[0] for b in backward] == ["backward"] * 4 and backward[-1] == ("backward", 3 * 8 * 4, "expected")


def test_a_weight_used_many_times_is_summed_once():
    """JAX casts an invariant weight at every use (one psum per use in backward); casting it once per
    region gives the same gradient (the uses add up first) with one all-reduce per weight."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch import lax
    from meshlib_torch.spmd import region_collectives

    def layers(x, w1, w2):
        for _ in range(4):
            x = x + lax.psum(torch.relu(x @ w1) @ w2, "tp")
        return x

    args = (ShapeDtype((8, 16)), ShapeDtype((16, 4)), ShapeDtype((4, 16)))
    plan = region_collectives(layers, mesh=TWO, in_specs=CASES[TWO][0].in_specs, out_specs=P("dp"), args=args)
    weights = [r for r in plan.records if r.phase == "backward" and r.axes == ("dp",)]
    assert [r.bytes for r in weights] == [4 * 16 * 4, 16 * 4 * 4]  # w2's and w1's local shards, once each


def test_dropless_expert_round_trip():
    """MoE dispatch and combine with ragged_all_to_all (no capacity, no dropped token): each token comes
    back scaled by its expert's index + 1, and its gradient is that factor times the cotangent."""
    mesh, n, tokens = Mesh(ep=4), 4, 6
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n * tokens, 5))
    expert = rng.integers(0, n, size=n * tokens)
    expert[:tokens] = 2  # rank 0 sends everything to one expert: maximally uneven
    ct = rng.standard_normal(x.shape)
    got = get_pool(n).run(cases.moe_job, mesh, "ep", x, expert, ct)
    scale = (expert + 1.0)[:, None]
    for rank in got:
        np.testing.assert_allclose(rank["y"], x * scale, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(rank["grad"], ct * scale, rtol=1e-12, atol=1e-12)
