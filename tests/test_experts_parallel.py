"""Expert parallelism in compiled models: the bundled MoE models on `ep` train as the single process.

Method: the same fp64 weights and batches run once in one process (the reference: the model as written,
its experts dense) and once compiled on gloo ranks, where each experts module is the `experts_ep`
region (tokens to their experts by all-to-all over `ep`, E/ep experts per rank); the losses, every
gradient after the first backward and every parameter after 3 AdamW steps must agree to 1e-12.
"""

from __future__ import annotations

import moe_models as mm
import pytest
import torch

import meshlib as ml
from meshlib_torch import compile_model
from meshlib_torch.models import build, update_balancing_bias
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
        # each with ZeRO-3: FSDP2 shards the experts over the data ranks besides ep, the rest over all
        ("moe-tiny", "ep=2", {"zero": 3}),
        ("moe-tiny", "ep=4", {"zero": 3}),
        ("moe-tiny-ds", "dp=2,ep=2", {"zero": 3}),
        ("moe-tiny", "ep=2,tp=2", {"zero": 3}),
        ("moe-tiny-ds", "pp=2,ep=2", {"microbatches": 2, "zero": 3}),
        ("moe-tiny", "dp=2,ep=2", {"zero": 1}),
        ("moe-tiny-ds", "dp=2,ep=2", {"zero": 2, "recompute": "block"}),
    ],
)
def test_an_moe_model_on_ep_trains_as_the_single_process(name, mesh, options):
    """Besides the losses, gradients and parameters (the routers' bitwise equal on every rank): moe-tiny's
    routers never reset their token counts, so after 3 steps they hold the 3 batches' counts, summed over
    every rank that routes and counted once per forward (a recomputed block does not count again);
    moe-tiny-ds moves its balancing bias after each update (the runtime does; the reference calls
    `update_balancing_bias`), equal on every rank."""
    build, rules = MODELS[name]
    keep = (COUNTS,) if name == "moe-tiny" else (BIAS,)
    ref = run_single(Trial(build, mm.batch, lr=1e-3, after_step=update_balancing_bias, buffers=keep))
    trial = Trial(build, mm.batch, mesh=mesh, rules=rules, lr=1e-3, options=options, buffers=keep)
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    assert ref.buffers and any(float(b.abs().sum()) > 0 for b in ref.buffers.values())
    for rank in got:
        assert_same(ref, rank, rtol=1e-12, atol=1e-12)
        assert sorted(rank.buffers) == sorted(ref.buffers)
    routers = [n for n in ref.params if n.endswith("moe.gate.weight")]  # each rank's own copy (torchtitan#2387)
    assert routers and all(torch.equal(rank.params[n], got[0].params[n]) for n in routers for rank in got)
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
    exchanges = [c for c in results[0]["plan"].collectives if c.op == "lax.all_to_all_v"]
    assert exchanges and all(c.bus_bytes == c.total_bytes for c in exchanges)  # its records hold what leaves
    # what the plan took for routing it says: dropless spreads the tokens evenly
    assert "spreads them evenly over the experts" in dict(results[0]["plan"].notes)["MoE routing"]


def _skewed_peak(mesh: str) -> int:
    """The measured peak bytes of a step of `moe_models.build_skewed_to_rank_0_of_2` on this rank (parameters,
    buffers and optimizer state its baseline, as the plan counts them), 8 x 64 tokens."""
    from meshlib_torch import PeakTracker, parallelize

    m = ml.Mesh.parse(mesh)
    par = parallelize(mm.build_skewed_to_rank_0_of_2(), mesh=m, rules=mm.rules_ds(m), example_inputs=mm.long_batch(0))
    opt = par.optimizer(lr=1e-3)
    par.train_step(mm.long_batch(0), opt)
    state = [v for st in opt.state.values() for v in st.values()]
    with PeakTracker(device="cpu") as tracker:
        tracker.baseline(list(par.parameters()) + list(par.buffers()) + state)
        par.train_step(mm.long_batch(1), opt)
    return tracker.peak


@pytest.mark.ranks
def test_expert_load_plans_the_busiest_ranks_memory():
    """Dropless routing sends every pair to rank 0's experts (ep=2: they draw twice an even share, rank 1's
    none). The plan with expert_load=2 holds rank 0's measured peak within 10% (measured: 2%); the even plan
    (the default) is more than 5% below it (measured: 9%), and the load raises the plan by what rank 0's experts hold (linear in the load)."""
    m = ml.Mesh.parse("ep=2")

    def plan(load: float) -> int:
        model = build("moe-tiny-ds", device="meta", dtype=torch.float64)
        example = tuple(torch.empty(8, 64, dtype=torch.long, device="meta") for _ in range(2))
        return compile_model(model, mesh=m, rules=mm.rules_ds(m), example_inputs=example, estimate_memory=True,
                             expert_load=load).plan.memory.peak  # fmt: skip

    even, busy, between = plan(1.0), plan(2.0), plan(1.5)
    got = get_pool(2).run(_skewed_peak, "ep=2")
    print(f"plan: even {even / 2**20:.2f} MiB, expert_load=2 {busy / 2**20:.2f} MiB; measured "
          f"{[round(g / 2**20, 2) for g in got]} MiB")
    assert got[0] == pytest.approx(busy, rel=0.1)
    assert even < 0.95 * got[0] and abs(got[0] - even) > 3 * abs(got[0] - busy)
    assert between - even == pytest.approx(busy - between, rel=0.01)


@pytest.mark.parametrize("load", [0.5, float("inf"), True, "2"])
def test_an_expert_load_below_an_even_share_is_refused_naming_the_fix(load):
    with pytest.raises(ValueError, match=r"expert_load=.*give a number >= 1"):
        ml.Parallelism(expert_load=load)


# -- ZeRO with ep: the experts' state over the data ranks besides ep, the rest over all ------------------
@pytest.mark.parametrize("zero, precision", [(1, None), (2, None), (3, None), (1, "bf16"), (3, "bf16")])
def test_zero_shards_the_experts_over_the_data_ranks_besides_ep(zero, precision):
    """dp=2×ep=2, routing even: every rank's counted bytes and model state equal the plan's, and the closed
    forms. An expert weight's gradient is summed over dp (2 ranks; the ep ranks hold other experts), every
    other over dp×ep (4): reduce-scatters of E/ep experts' gradients over dp and of the rest over dp_ep, in the
    reduce dtype (fp64 here; fp32 under bf16). ZeRO-1 all-gathers the updated pieces back; ZeRO-2 gathers the
    parameters in forward, ZeRO-3 in backward too. In fp64 the optimizer's two moments hold a quarter of
    everything (the E/ep experts halved by dp, the rest quartered by dp×ep), and so do ZeRO-2/3's parameters
    and gradients; ZeRO-1 keeps the rank's E/ep experts and the whole rest."""
    from meshlib_torch.testing.measure import measure_step, planned

    options = {"zero": zero} | ({"precision": precision} if precision else {})
    trial = Trial(mm.build_balanced, mm.batch, mesh="dp=2,ep=2", rules=mm.rules_ds, lr=1e-3, options=options)
    results = get_pool(4).run(measure_step, trial)
    numel = {n: p.numel() for n, p in mm.build_balanced().named_parameters()}
    experts = sum(v for n, v in numel.items() if ".experts." in n) // 2  # E/ep of them on each rank
    dense = sum(v for n, v in numel.items() if ".experts." not in n)
    reduce_b = 4 if precision else 8
    gathers = {1: ["optimizer"], 2: ["forward"], 3: ["forward", "backward"]}[zero]
    want = {
        ("backward", "reduce_scatter", "dp"): experts * reduce_b,
        ("backward", "reduce_scatter", "dp_ep"): dense * reduce_b,
    }
    param_b = 2 if precision else 8  # parameters are gathered in their compute dtype
    for phase in gathers:
        want |= {(phase, "all_gather", "dp"): experts * param_b, (phase, "all_gather", "dp_ep"): dense * param_b}
    for got in results:
        plan = planned(got["plan"], got["coords"])
        assert got["comm"] == plan["comm"] and got["state"] == plan["state"], (got["rank"], got["coords"])
        assert {key: got["comm"].get(key) for key in want} == want
        if precision is None:
            quarter = 8 * (experts // 2 + dense // 4)
            kept = quarter if zero >= 2 else 8 * (experts + dense)
            assert got["state"] == {"params": kept, "grads": kept, "optimizer": 2 * quarter}


# -- reliability: no hang beside FSDP2's collectives, and a dead rank ends the run ----------------------
TIMEOUT = 30.0  # seconds, every collective's

def test_twenty_zero3_steps_on_dp2_ep2_run_under_a_collective_timeout():
    """Megatron-LM#5749 hung when the dispatch's all-to-all interleaved with the data-parallel reduce-scatter.
    Here every rank issues its collectives in the graph's one order (FSDP2's gathers and reduce-scatters hang on
    the layers and the expert regions, the all-to-alls run inside the regions): 20 steps of moe-tiny-ds on
    dp=2×ep=2 with ZeRO-3 under a 30 s collective timeout finish, and give the single process's losses,
    parameters and balancing biases (fp64, to 1e-10 after 20 AdamW steps)."""
    ref = run_single(Trial(mm.build_ds, mm.batch, steps=20, lr=1e-3, after_step=update_balancing_bias, buffers=(BIAS,)))
    trial = Trial(mm.build_ds, mm.batch, mesh="dp=2,ep=2", rules=mm.rules_ds, steps=20, lr=1e-3,
                  options={"zero": 3, "timeout": TIMEOUT}, buffers=(BIAS,))  # fmt: skip
    for rank in get_pool(4).run(run_parallel, trial):
        assert len(rank.losses) == 20
        assert_same(ref, rank, rtol=1e-10, atol=1e-10)


def _die_in_the_dispatch(timeout: float):
    """One step, then rank 1 exits inside the next step's first all_to_all_v (the dispatch's token exchange),
    while the others wait in it."""
    import os

    import torch.distributed as dist

    from meshlib_torch.spmd.eager import EagerBackend
    from meshlib_torch.testing.reference import parallelize_trial

    trial = Trial(mm.build_ds, mm.batch, mesh="dp=2,ep=2", rules=mm.rules_ds, options={"zero": 3, "timeout": timeout})
    par = parallelize_trial(trial)
    opt = par.optimizer(lr=1e-3)
    par.train_step(mm.batch(0), opt)
    if dist.get_rank() == 1:
        EagerBackend.all_to_all_v = lambda *args, **kwargs: os._exit(9)
    return par.train_step(mm.batch(1), opt)


def test_a_rank_killed_mid_all_to_all_ends_the_run_within_the_timeout():
    import time

    from meshlib_torch.testing.pool import RankError

    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 9\)"):  # its exit, inside all_to_all_v
        get_pool(4).run(_die_in_the_dispatch, TIMEOUT)
    assert time.monotonic() - start < TIMEOUT  # gloo sees the closed socket at once; the timeout bounds the rest
    assert get_pool(4).run(int, 4) == [4, 4, 4, 4]  # the pool starts afresh


# -- capacity mode in a compiled model -------------------------------------------------------------------
def _capacity_job(trial: Trial) -> dict:
    """Every rank: 3 steps, and after each the pairs dropped over every rank (`Routing.dropped`)."""
    from meshlib_torch.testing.reference import parallelize_trial

    par = parallelize_trial(trial)
    opt = trial.make_optimizer(par.optimizer)
    dropped = []
    for step in range(trial.steps):
        par.train_step(trial.batch(step), opt)
        dropped.append(par.routing.dropped())
    return {"dropped": dropped, "plan": par.plan}


@pytest.mark.parametrize(
    "mesh, options, blocks",
    [
        ("ep=2", {}, 2),
        ("dp=2,ep=2", {"zero": 3}, 4),
        ("pp=2,ep=2", {"microbatches": 2}, 4),  # 2 data ranks, each its batch in 2 microbatches
        ("ep=2", {"recompute": "block"}, 2),  # a recomputed block does not count its drops again
    ],
)
def test_capacity_mode_drops_what_one_process_drops_by_its_rule(mesh, options, blocks):
    """moe-tiny-ds with capacity_factor=1: each expert takes at most ceil(T·k/E) pairs from each rank's call,
    the first in token order. The one-process reference is the model as written, whose experts zero the
    weights of the pairs the rule drops, block by block of the global batch (`testing.capacity`): losses,
    gradients, parameters and balancing biases after 3 AdamW steps agree to 1e-12 (so each step drops the
    same pairs), and the first step's count of dropped pairs, summed over the ranks, equals the reference's.
    No host read is planned."""
    build = {2: mm.build_ds_dropping_as_2, 4: mm.build_ds_dropping_as_4}[blocks]
    ref = run_single(Trial(build, mm.batch, lr=1e-3, after_step=update_balancing_bias, buffers=(BIAS,)))
    options = {"capacity_factor": mm.CAPACITY, **options}
    trial = Trial(mm.build_ds, mm.batch, mesh=mesh, rules=mm.rules_ds, lr=1e-3, options=options, buffers=(BIAS,))
    size = ml.Mesh.parse(mesh).size
    for rank in get_pool(size).run(run_parallel, trial):
        assert_same(ref, rank, rtol=1e-12, atol=1e-12)
    model = build()
    model(*mm.batch(0))
    want = model.capacity_hooks.dropped
    assert want > 0
    for got in get_pool(size).run(_capacity_job, trial):
        assert got["dropped"][0] == want
        assert not [c for c in got["plan"].collectives if c.kind == "host_sync"]
        assert "MoE routing" not in dict(got["plan"].notes)  # capacity bounds what each expert takes


def test_meshlib_runs_capacity_mode_against_its_one_process_reference():
    """What `meshlib run --model moe-tiny-ds --mesh dp=2,ep=2 --capacity-factor 1 --zero 3` runs on the ranks
    and in one process (`testing.parity`): equal to fp64's tolerance over 3 steps, balancing biases moving on
    both sides, with the dropped pairs reported and a share of the routed pairs (2 MoE layers, T·k = 2048)."""
    from meshlib_torch.testing.parity import RunConfig, compare, train_parallel, train_reference

    run = RunConfig(model="moe-tiny-ds", mesh="dp=2,ep=2", steps=3, zero=3, capacity_factor=1.0)
    results = get_pool(4).run(train_parallel, run)
    compare(train_reference(run), results[0], run.tolerance)
    routed = sum(sum(counts) for _, counts, _ in results[0].routing)
    assert {r.dropped for r in results} == {results[0].dropped} and 0 < results[0].dropped < routed


def test_router_counts_stay_exact_in_full_precision_under_bf16():
    """moe-tiny (an fp64 model) computing in bf16 on dp=2×ep=2: the routers' token counts stay buffers of the
    model's own dtype (bf16 holds no odd integer past 256), so after 3 steps of 512 tokens each router has
    counted exactly 3 × 512 × k = 3,072 pairs, summed over the ranks, whatever bf16's routing chose; the plan
    sums the counts in that dtype (plan = measured, but for the exchanges, priced from even routing)."""
    from meshlib_torch.testing.measure import measure_step, planned

    trial = Trial(mm.build_tiny, mm.long_batch, mesh="dp=2,ep=2", rules=mm.rules_tiny, lr=1e-3,
                  options={"precision": "bf16"}, buffers=(COUNTS,))  # fmt: skip
    for rank in get_pool(4).run(run_parallel, trial):
        assert len(rank.buffers) == 2
        for name, counts in rank.buffers.items():
            assert counts.dtype == torch.float64 and float(counts.sum()) == 3 * 512 * 2, name
    for got in get_pool(4).run(measure_step, trial):  # the exchanges follow the routing; the rest is exact
        plan = planned(got["plan"], got["coords"])["comm"]
        assert {k: v for k, v in got["comm"].items() if k[1] != "all_to_all"} == {
            k: v for k, v in plan.items() if k[1] != "all_to_all"
        }


def test_gradient_accumulation_with_ep_and_zero3_trains_as_the_single_process():
    """moe-tiny-ds on dp=2×ep=2 accumulating 2 microbatches of 512 tokens under ZeRO-3 (no pipeline): the token
    counts add up over the microbatches and the balancing bias moves once per step, from the whole batch's
    counts, as the single process's one call does (fp64, 1e-12)."""
    ref = run_single(Trial(mm.build_ds, mm.long_batch, lr=1e-3, after_step=update_balancing_bias, buffers=(BIAS,)))
    trial = Trial(mm.build_ds, mm.long_batch, mesh="dp=2,ep=2", rules=mm.rules_ds, lr=1e-3,
                  options={"microbatches": 2, "zero": 3}, buffers=(BIAS,))  # fmt: skip
    for rank in get_pool(4).run(run_parallel, trial):
        assert_same(ref, rank, rtol=1e-12, atol=1e-12)


def test_tokens_the_data_ranks_do_not_divide_are_refused_at_compile_time():
    """5 sequences over ep=4 under uneven='chunk' would give ranks 2, 2, 1 and 0 of them; the experts region takes
    equal shards (JAX's shard_map semantics), so compiling says so, naming the region and the fix, before any
    process exists. So does a capacity factor on a model without experts."""
    from meshlib_torch import compile_model

    mesh = ml.Mesh(ep=4)
    with pytest.raises(ValueError, match=r"shard_map\(experts_ep.*do not split evenly over axis 'ep' \(4 ways\)"):
        compile_model(mm.build_ds(), mesh=mesh, rules=mm.rules_ds(mesh), example_inputs=mm.uneven_batch(0),
                      uneven="chunk")  # fmt: skip
    from meshlib_torch.models import build, default_rules

    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="capacity_factor=1.0 caps the tokens each expert takes, but this model"):
        compile_model(build("gpt-tiny"), mesh=ml.Mesh(dp=4), rules=default_rules("gpt-tiny", ml.Mesh(dp=4)),
                      example_inputs=(x, x), capacity_factor=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="capacity_factor=0: give a positive number"):
        ml.Parallelism(capacity_factor=0)
