"""Expert parallelism in compiled models: the bundled MoE models on `ep` train as the single process.

Method: the same fp64 weights and batches run once in one process (the reference: the model as written,
its experts dense) and once compiled on gloo ranks, where each experts module is the `experts_ep`
region (tokens to their experts by all-to-all over `ep`, E/ep experts per rank); the losses, every
gradient after the first backward and every parameter after 3 AdamW steps must agree to 1e-12.
"""

from __future__ import annotations

import moe_models as mm
import pytest

import meshlib as ml
from meshlib_torch.models import update_balancing_bias
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytestmark = pytest.mark.ranks

MODELS = {"moe-tiny": (mm.build_tiny, mm.rules_tiny), "moe-tiny-ds": (mm.build_ds, mm.rules_ds)}


COUNTS, BIAS = "tokens_per_expert", "e_score_correction_bias"


@pytest.mark.parametrize(
    "name, mesh, options",
    [
        ("moe-tiny", "ep=2", {}),
        ("moe-tiny", "ep=4", {}),
        ("moe-tiny", "dp=2,ep=2", {}),
        ("moe-tiny-ds", "dp=2,ep=2", {}),
        ("moe-tiny", "ep=2,tp=2", {}),
        ("moe-tiny-ds", "ep=2,tp=2", {"sequence_parallel": True, "recompute": "block"}),
        ("moe-tiny-ds", "pp=2,ep=2", {"microbatches": 2}),
        ("moe-tiny", "ep=2", {"recompute": "block"}),
    ],
)
def test_an_moe_model_on_ep_trains_as_the_single_process(name, mesh, options):
    """Besides the losses, gradients and parameters: moe-tiny's routers never reset their token counts, so
    after 3 steps they hold the 3 batches' counts, summed over every rank that routes and counted once per
    forward (a recomputed block does not count again); moe-tiny-ds moves its balancing bias after each
    update (the runtime does; the reference calls `update_balancing_bias`), equal on every rank."""
    build, rules = MODELS[name]
    keep = (COUNTS,) if name == "moe-tiny" else (BIAS,)
    ref = run_single(Trial(build, mm.batch, lr=1e-3, after_step=update_balancing_bias, buffers=keep))
    trial = Trial(build, mm.batch, mesh=mesh, rules=rules, lr=1e-3, options=options, buffers=keep)
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    assert ref.buffers and any(float(b.abs().sum()) > 0 for b in ref.buffers.values())
    for rank in got:
        assert_same(ref, rank, rtol=1e-12, atol=1e-12)
        assert sorted(rank.buffers) == sorted(ref.buffers)
    if options.get("microbatches", 1) > 1:  # per-microbatch routing statistics are stated
        assert "each microbatch's" in dict(got[0].plan.notes)["MoE"]


def test_the_plan_counts_the_all_to_all_and_the_host_syncs_as_each_rank_runs_them():
    """Plan = measured = closed form, on every rank of dp=2×ep=2, routing even (`moe_models.BalancedRouter`):
    per MoE layer (2 of them) and step, the counts exchange (E int64) and two all_to_all_v of
    T·k·H·8·(ep−1)/ep bytes forward (dispatch, combine), two backward, and one host read of the send and
    receive counts (2·E int64) in forward; T = 8 tokens per rank, k = 2, H = 32, E = 8."""
    from meshlib_torch.testing.measure import measure_step, planned

    trial = Trial(mm.build_balanced, mm.batch, mesh="dp=2,ep=2", rules=mm.rules_ds, lr=1e-3)
    results = get_pool(4).run(measure_step, trial)
    tokens, k, hidden, experts, ep, layers = 8, 2, 32, 8, 2, 2
    exchange = tokens * k * hidden * 8 * (ep - 1) // ep
    want = {
        ("forward", "all_to_all", "ep"): layers * (experts * 8 + 2 * exchange),
        ("backward", "all_to_all", "ep"): layers * 2 * exchange,
        ("forward", "host_sync", ""): layers * 2 * experts * 8,
    }
    for got in results:
        plan = planned(got["plan"], got["coords"])["comm"]
        assert got["comm"] == plan, (got["rank"], got["coords"])
        assert {key: plan[key] for key in want} == want
