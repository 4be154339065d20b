"""check_vma refuses per-shard programs whose out specs promise a replication they do not have, before
any collective, naming the result, the axis and the fix; torch's local_map runs the same programs silently.

Method: a corpus of deliberately wrong programs (`shard_map_cases.Wrong`), each breaking its out spec's
promise over one mesh axis. (1) In this process, which has no process group at all, shard_map refuses
each one: the check runs f on meta tensors carrying their varying axes, so it cannot have run a
collective. (2) On 4 gloo ranks every rank raises the same message and no collective ran
(`COUNTER.calls`), while `torch.distributed.tensor.experimental.local_map` with the same placements
returns DTensors whose "replicated" shards differ between ranks. (3) JAX's shard_map refuses the same
programs (abstractly, `jax.eval_shape`), but for the ragged all-to-all, which jax 0.10 types unsoundly.
Then the errors for bad input: unknown axes, trees that do not match, dims that do not divide.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
import optree  # noqa: E402
import shard_map_cases as cases  # noqa: E402
from shard_map_cases import Wrong  # noqa: E402

from meshlib import Mesh, P  # noqa: E402
from meshlib.interop.jax import to_jax_mesh, to_jax_spec  # noqa: E402
from meshlib_torch import lax, shard_map  # noqa: E402
from meshlib_torch.spmd.specs import path_str  # noqa: E402
from meshlib_torch.testing.pool import get_pool  # noqa: E402

MESH = Mesh(dp=2, tp=2)
MLP = ((4, 6), (6, 4), (4, 6))
MLP_SPECS = (P("dp"), P(None, "tp"), P("tp", None))

WRONG = [
    Wrong("row-parallel output without its psum", "no_psum", MLP, MLP_SPECS, P("dp"), "out", "tp"),
    Wrong("psum over the data axis instead of tp", "psum_wrong_axis", MLP, MLP_SPECS, P(), "out", "tp"),
    Wrong("axis_index added, claimed replicated", "plus_index", ((3,),), P(), P(), "out", "tp"),
    Wrong("psum_scatter's shard claimed whole", "scatter_as_whole", ((4, 4),), P(None, "tp"), P(), "out", "tp"),
    Wrong("all_gather where all_gather_invariant was meant", "gather_varying", ((4, 3),), P("tp"), P(), "out", "tp", differs=False),
    Wrong("ppermute result claimed replicated", "permuted", ((4, 3),), P("tp"), P(), "out", "tp"),
    Wrong("all_to_all result claimed replicated", "exchanged", ((4, 3),), P("tp"), P(), "out", "tp"),
    Wrong("pmax over one of two sharded axes", "pmax_one_axis", ((4, 4),), P("dp", "tp"), P(), "out", "dp"),
    Wrong("data-parallel loss without pmean", "dp_loss_no_pmean", ((4, 3),), P("dp"), P(), "out", "dp"),
    Wrong("bias added to a tp shard, claimed whole", "bias_on_shard", ((4, 6), (3,)), (P(None, "tp"), P()), P(), "out", "tp"),
    Wrong("psum over half of a tuple-sharded dim", "psum_half_tuple", ((4, 4),), P(("dp", "tp")), P(), "out", "tp"),
    Wrong("local sum over a dim split over tp", "local_sum_of_split_dim", ((4, 4),), P("dp", "tp"), P("dp"), "out", "tp"),
    Wrong("pcast to varying, claimed replicated", "pcast_as_whole", ((3,),), P(), P(), "out", "tp", differs=False),
    Wrong("one entry of a dict result", "dict_one_wrong", ((4, 4),), P("dp", "tp"), {"aux": P(), "loss": P()}, "out['loss']", "tp"),
    Wrong("local mean instead of pmean", "local_mean", ((4, 3),), P("dp"), P(), "out", "dp"),
    Wrong("axis_index over a tuple, tp left out", "index_tuple", ((3,),), P(), P("dp"), "out", "tp"),
    Wrong("second of two results", "second_output", ((4, 4),), P("dp", "tp"), (P("dp"), P("dp")), "out[1]", "tp"),
    Wrong("invariant gather over dp, still split over tp", "gather_other_axis", ((4, 4),), P("dp", "tp"), P(), "out", "tp"),
    Wrong("ragged_all_to_all result claimed replicated", "ragged_as_whole", ((4, 3),), P("tp"), P(), "out", "tp", jax_refuses=False),
]  # fmt: skip
IDS = [w.program for w in WRONG]


def _inputs(w: Wrong, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in w.inputs]


@pytest.mark.parametrize("w", WRONG, ids=IDS)
def test_check_vma_refuses_before_any_process_group(w):
    """No process group exists here: the refusal comes from the abstract run alone."""
    assert not torch.distributed.is_initialized()
    f = getattr(cases, w.program)(lax, cases.torch_ops())
    args = [torch.tensor(a) for a in _inputs(w, 0)]
    with pytest.raises(ValueError, match="out_specs promise replication") as err:
        shard_map(f, mesh=MESH, in_specs=w.in_specs, out_specs=w.out_specs)(*args)
    msg = str(err.value)
    assert f"  {w.path}: out spec" in msg and f"leaves out {w.axis!r}" in msg and "Fix" in msg, msg


def test_the_corpus_is_large_enough():
    assert len(WRONG) >= 15 and len(set(IDS)) == len(IDS)


@pytest.mark.ranks
def test_every_rank_refuses_and_local_map_runs_silently():
    inputs = [_inputs(w, seed) for seed, w in enumerate(WRONG)]
    ranks = get_pool(MESH.size).run(cases.wrong_job, MESH, WRONG, inputs)
    for i, w in enumerate(WRONG):
        rows = [rank_rows[i] for rank_rows in ranks]
        assert rows[0]["refused"] is not None, w.name
        assert all(r["refused"] == rows[0]["refused"] for r in rows), f"{w.name}: ranks disagree"
        assert all(r["collectives"] == 0 for r in rows), f"{w.name}: a collective ran before the refusal"
        if not w.differs:
            continue
        paths = [path_str("out", p) for p in optree.tree_paths(w.out_specs, none_is_leaf=True)]
        out = paths.index(w.path)  # the wrong result among the outputs, in leaf order
        group = MESH.group(0, w.axis)  # ranks local_map's Replicate says hold the same value
        shards = [rows[r]["local"][out] for r in group]
        assert any(not np.allclose(shards[0], s) for s in shards[1:]), f"{w.name}: local_map's ranks agree"


def _jax_fn(w: Wrong):
    ops = cases.SimpleNamespace(
        relu=jax.nn.relu, tanh=jnp.tanh, like=lambda i, x: i.astype(x.dtype), ones_int=lambda n: jnp.ones(n, jnp.int32),
        arange_int=lambda n: jnp.arange(n, dtype=jnp.int32), like_int=lambda i, x: i.astype(x.dtype),
        zeros=lambda x: jnp.zeros(x.shape, x.dtype),
    )  # fmt: skip
    specs = lambda t: optree.tree_map(to_jax_spec, t, none_is_leaf=True)
    return jax.shard_map(
        getattr(cases, w.program)(jax.lax, ops), mesh=to_jax_mesh(MESH), in_specs=specs(w.in_specs),
        out_specs=specs(w.out_specs),
    )  # fmt: skip


@pytest.mark.parametrize("w", WRONG, ids=IDS)
def test_jax_refuses_them_too(w):
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in w.inputs]
    if not w.jax_refuses:
        jax.eval_shape(_jax_fn(w), *args)  # jax 0.10 types a ragged all-to-all by its output buffer alone
        return
    with pytest.raises(ValueError, match=w.axis):
        jax.eval_shape(_jax_fn(w), *args)


# -- bad input: every error names what is wrong and the fix, before anything runs -------------------
def _raises(match: str, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        fn(*args, **kwargs)
    assert "Fix" in str(err.value), str(err.value)
    return str(err.value)


def _mlp_args():
    return [torch.randn(shape) for shape in MLP]


def test_unknown_axis_in_specs_is_named_with_its_path():
    msg = _raises(r"in_specs\[1\]: spec P\(None, 'mp'\) names mesh axis 'mp'", shard_map, lambda *a: a[0], mesh=MESH, in_specs=(P("dp"), P(None, "mp"), P()), out_specs=P())  # noqa: E501
    assert "('dp', 'tp')" in msg
    _raises(r"out_specs\['y'\]: spec P\('x'\) names mesh axis 'x'", shard_map, lambda x: x, mesh=MESH, in_specs=P(), out_specs={"y": P("x")})


def test_unknown_axis_in_a_collective():
    f = shard_map(lambda x: lax.psum(x, "model"), mesh=MESH, in_specs=P("dp"), out_specs=P())
    _raises(r"lax.psum\(..., axis_name='model'\) at test_shard_map_vma.py:\d+: unknown axis 'model'; the shard_map's mesh has axes \('dp', 'tp'\)", f, torch.ones(4))


def test_spec_tree_must_be_a_prefix_of_the_arguments():
    f = shard_map(lambda x, w1, w2: x, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    _raises(r"in_specs do not match args: tuple arity mismatch; expected: 2, got: 3", f, *_mlp_args())
    g = shard_map(lambda d: d["a"], mesh=MESH, in_specs=({"a": P(), "b": P()},), out_specs=P())
    _raises("dictionary key mismatch", g, {"a": torch.ones(2), "c": torch.ones(2)})
    h = shard_map(lambda x: (x, x), mesh=MESH, in_specs=P(), out_specs=(P(), P(), P()))
    _raises("out_specs do not match out", h, torch.ones(2))


def test_a_dim_that_does_not_divide_names_the_input_dim_and_fix():
    f = shard_map(lambda x, w1, w2: x, mesh=MESH, in_specs=MLP_SPECS, out_specs=P("dp"))
    msg = _raises(r"args\[1\] dim 1 has size 5, which P\(None, 'tp'\) splits over \('tp',\) \(2 ranks\)", f, torch.ones(4, 6), torch.ones(6, 5), torch.ones(4, 6))  # noqa: E501
    assert "pad dim 1 to a multiple of 2" in msg


def test_spec_longer_than_the_tensor_and_a_spec_on_a_non_tensor():
    f = shard_map(lambda x: x, mesh=MESH, in_specs=P(None, "dp"), out_specs=P(None, "dp"))
    _raises(r"args\[0\] has shape \(4,\) \(1 dims\) but its spec P\(None, 'dp'\) has 2 entries", f, torch.ones(4))
    g = shard_map(lambda x, n: x * n, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    _raises(r"args\[1\] is a int, not a tensor, but in_specs gives it P\(\)", g, torch.ones(4), 3)


def test_a_none_spec_passes_an_argument_unchanged():
    """(No process group here: the abstract run succeeds, then running for real needs one.)"""
    f = shard_map(lambda x, n: lax.psum(x * n, "dp"), mesh=MESH, in_specs=(P("dp"), None), out_specs=P())
    with pytest.raises(ValueError, match="device_mesh needs a process group"):
        f(torch.ones(4), 3)


def test_collectives_outside_shard_map_and_nested_shard_map():
    _raises(r"lax.psum was called outside shard_map", lax.psum, torch.ones(2), "tp")
    _raises(r"lax.axis_index was called outside shard_map", lax.axis_index, "tp")
    inner = shard_map(lambda x: x, mesh=MESH, in_specs=P(), out_specs=P())
    _raises("shard_map inside shard_map is not supported", shard_map(lambda x: inner(x), mesh=MESH, in_specs=P(), out_specs=P()), torch.ones(2))


def test_reading_values_into_python_is_refused_with_the_reason():
    f = shard_map(lambda x: x * float(x.sum()), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    _raises(r"runs f on meta tensors first .* must not read tensor values into Python", f, torch.ones(4))
    g = shard_map(lambda x: torch.bincount(x, minlength=4), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    _raises(r"aten::bincount: attempted to run this operator with Meta tensors, but there was no fake impl or Meta kernel registered. f must not.*one-hot sum", g, torch.ones(4, dtype=torch.long))


def test_collective_arguments_are_checked():
    scatter = shard_map(lambda x: lax.psum_scatter(x, "tp"), mesh=MESH, in_specs=P(), out_specs=P("tp"))
    _raises(r"lax.psum_scatter over \('tp',\) at .*: scatter_dimension 0 has size 3, which must be exactly 2", scatter, torch.ones(3))
    a2a = shard_map(lambda x: lax.all_to_all(x, "tp", 0, 0, tiled=True), mesh=MESH, in_specs=P(), out_specs=P("tp"))
    _raises(r"split_axis 0 has size 3, which must be a multiple of 2", a2a, torch.ones(3))
    perm = shard_map(lambda x: lax.ppermute(x, "tp", [(0, 1), (1, 1)]), mesh=MESH, in_specs=P("tp"), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"each source and each destination at most once"):
        perm(torch.ones(4))
    cast = shard_map(lambda x: lax.pcast(x, "tp", to="varying"), mesh=MESH, in_specs=P("tp"), out_specs=P("tp"))
    _raises(r"already varies over \['tp'\]", cast, torch.ones(4))


def test_pmax_has_no_derivative_as_in_jax():
    from meshlib.tree import ShapeDtype
    from meshlib_torch.spmd import region_collectives

    f = lambda x: lax.pmax(x, "tp")
    with pytest.raises(ValueError, match=r"lax.pmax at test_shard_map_vma.py:\d+ has no derivative .* Fix: reduce a detached"):
        region_collectives(f, mesh=MESH, in_specs=P("tp"), out_specs=P(), args=(ShapeDtype((2, 3)),))
    plan = region_collectives(lambda x: lax.pmax(x.detach(), "tp"), mesh=MESH, in_specs=P("tp"), out_specs=P(), args=(ShapeDtype((2, 3)),))
    assert [(r.op, r.phase) for r in plan.records] == [("pmax", "forward")]
