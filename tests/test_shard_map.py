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
        in_specs=_jax_specs(case.in_specs), out_specs=_jax_specs(case.out_specs),
    )  # fmt: skip


def _jax_run(mesh: Mesh, case: Case, xs, seed: int):
    """JAX's results, random cotangents of their shapes, and jax.grad of sum(result * ct) (jitted: eager
    jax.shard_map compiles every op on its own)."""
    outs = [np.asarray(o) for o in jax.tree_util.tree_leaves(jax.jit(_jax_fn(mesh, case, case.program))(*xs))]
    rng = np.random.default_rng(seed + 1000)
    cts = [rng.standard_normal(o.shape) for o in outs]
    if not case.grad:
        return outs, cts, None
    untiled_a2a = case.program == "a2a" and not case.kw.get("tiled") and case.kw["split"] != case.kw["concat"]
    f = _jax_fn(mesh, case, "a2a_expanded" if untiled_a2a else case.program)
    loss = lambda *a: sum((o * c).sum() for o, c in zip(jax.tree_util.tree_leaves(f(*a)), cts))
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(xs)))))(*xs)
    return outs, cts, [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


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
