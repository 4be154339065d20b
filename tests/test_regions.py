"""Per-shard code inside a compiled model: a `shard_map` region traced by torch.fx as one node.

The model is the bundled Llama with its feed-forward written as a region (`region_models`: Megatron's
MLP, each tp rank its columns of w1 and w3 and its rows of w2, then `lax.psum` over tp). The compiler
places the region's inputs as its in specs say and its results as its out specs say, and asks the
region itself what it moves (one run on meta tensors of the shards).

Method (plan, closed form): on dp=2 x tp=2 the region costs per layer exactly Megatron's f and g: one
all-reduce over tp of b/dp*s*h values forward (its psum) and one backward (the sum of x's gradient,
the implicit cast of x to vary over tp), and the model's other collectives are those of the plain
model's plan, where the feed-forward is compiled from torch ops: the two plans move the same bytes.

Method (parity): every rank of a gloo pool trains the region model (3 AdamW steps, fp64) and the
parent trains the plain model with the same weights; losses, every gradient and every parameter
agree to 1e-12, typed (`check_vma=True`) and untyped (under ZeRO-1), on tp=2, dp=2 x tp=2 (also with
sequence parallelism and block recompute) and dp=2 x pp=2 x tp=2.

Method (per rank): the plan's collectives on each rank, the region's included, equal the bytes each
rank's c10d calls moved in a measured step (`testing.measure`).

Method (errors): a region whose collective runs over a data-parallel axis, and one on another mesh,
are refused at compile time with the fix named.
"""

import functools

import pytest
import region_models as rm
import torch

import meshlib as ml
from meshlib_torch import compile_model, lax, shard_map
from meshlib_torch.testing.measure import measure_step, planned
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

H, FP64 = 32, 8


def _plan(model, mesh: str, **options):
    m = ml.Mesh.parse(mesh)
    return compile_model(model, mesh=m, rules=rm.rules(m), example_inputs=rm.batch(0), **options).plan


def test_the_region_costs_megatrons_f_and_g_and_the_plan_matches_the_plain_model():
    plan = _plan(rm.build_region("dp=2,tp=2"), "dp=2,tp=2")
    plain = _plan(rm.build_plain(), "dp=2,tp=2")
    mine = [c for c in plan.collectives if c.op.startswith("lax.")]
    bsh = rm.BATCH // 2 * rm.SEQ * H * FP64
    layers = rm.build_plain().config.n_layers
    assert sorted((c.op, c.kind, c.axes, c.phase, c.bytes) for c in mine) == sorted(
        [("lax.psum", "all_reduce", ("tp",), "forward", bsh), ("lax.pvary", "all_reduce", ("tp",), "backward", bsh)]
        * layers
    )
    assert all("megatron_mlp" in c.reason and "region_models.py" in c.source for c in mine)
    for axes in (("tp",), ("dp",)):
        assert plan.comm_bytes(axes=axes) == plain.comm_bytes(axes=axes) > 0


def _trial(mesh: str, check_vma: bool = True, **options) -> Trial:
    build = functools.partial(rm.build_region, mesh, check_vma)
    return Trial(build, rm.batch, mesh=mesh, rules=rm.rules, lr=1e-3, options=options)


@pytest.mark.ranks
@pytest.mark.parametrize(
    "mesh, check_vma, options",
    [
        ("tp=2", True, {}),
        ("dp=2,tp=2", True, {}),
        ("dp=2,tp=2", False, {"zero": 1}),
        ("dp=2,pp=2,tp=2", True, {"microbatches": 2}),
        ("dp=2,tp=2", True, {"sequence_parallel": True, "recompute": "block"}),
    ],
)
def test_a_model_with_a_region_trains_as_the_single_process(mesh, check_vma, options):
    ref = run_single(Trial(rm.build_plain, rm.batch, lr=1e-3))
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, _trial(mesh, check_vma, **options))
    assert_same(ref, got[0], rtol=1e-12, atol=1e-12)


@pytest.mark.ranks
@pytest.mark.parametrize("mesh, options", [("dp=2,tp=2", {}), ("dp=2,pp=2,tp=2", {"microbatches": 2})])
def test_the_plan_counts_the_regions_collectives_as_each_rank_runs_them(mesh, options):
    results = get_pool(ml.Mesh.parse(mesh).size).run(measure_step, _trial(mesh, **options))
    for got in results:
        want = planned(got["plan"], got["coords"])
        assert got["comm"] == want["comm"], (got["rank"], got["coords"])
        assert got["state"] == want["state"], (got["rank"], got["coords"])
    assert any("lax.psum" in c.op for c in results[0]["plan"].collectives)


def _batch_mean(x, w1, w3, w2):
    return lax.pmean(rm.megatron_mlp(x, w1, w3, w2), "dp")


def test_a_region_collective_over_a_data_parallel_axis_is_refused():
    mesh = ml.Mesh.parse("dp=2,tp=2")
    model = rm.build_plain()
    mapped = rm._mapped(mesh, _batch_mean)
    for layer in model.layers:
        layer.feed_forward = rm.RegionFeedForward(layer.feed_forward, mapped)
    with pytest.raises(ValueError, match=r"called at region_models.py:\d+: lax.pmean at test_regions.py:\d+ sums over \['dp'\].*data parallelism"):
        _plan(model, "dp=2,tp=2")


def test_a_region_on_another_mesh_is_refused():
    model = rm.build_region("tp=2")
    with pytest.raises(ValueError, match="not the one the model is compiled for.*Fix: give shard_map the mesh"):
        _plan(model, "dp=2,tp=2")


def test_a_region_runs_alone_on_meta_tensors_as_global_shapes():
    """Outside a compiled model, on meta tensors, a region returns its results' global shapes."""
    mesh = ml.Mesh.parse("dp=2,tp=2")
    x = torch.empty(rm.BATCH, rm.SEQ, H, dtype=torch.float64, device="meta")
    w1 = torch.empty(64, H, dtype=torch.float64, device="meta")
    w2 = torch.empty(H, 64, dtype=torch.float64, device="meta")
    y = rm._mapped(mesh)(x, w1, w1, w2)
    assert y.shape == x.shape and y.device.type == "meta"
    specs = (ml.P("dp"), ml.P("tp", None), ml.P("tp", None), ml.P(None, "tp"))
    with pytest.raises(ValueError, match=r"out spec P\(\) leaves out 'dp'"):  # checked there too
        shard_map(rm.megatron_mlp, mesh=mesh, in_specs=specs, out_specs=ml.P())(x, w1, w1, w2)
