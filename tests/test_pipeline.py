"""Pipeline parallelism on real gloo ranks against the single-process run, and its failure modes.

Method: the parity harness trains with a pp axis in the mesh (the compiled
model cut into stages, run by torch.distributed.pipelining) and compares
losses, gradient norms and every parameter after 3 AdamW steps with the
unsharded run, in fp64 to 1e-12. Every schedule runs at pp=2, several at
pp=4, and pp composes with dp (tied embeddings across the first and last
stage), tp with sequence parallelism, both on 8 ranks, and ZeRO-1.
"""

import re
import time

import pytest
import torch

from meshlib import Mesh, bubble_formula, schedule, simulate
from meshlib_torch import COUNTER, parallelize
from meshlib_torch import data as mdata
from meshlib_torch.models import build, config, default_rules
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.testing.parity import RunConfig, compare, pipeline_sends, train_parallel, train_reference
from meshlib_torch.testing.pool import close_all, get_pool

pytestmark = pytest.mark.ranks


def _check(**kw):
    run = RunConfig(**kw)
    results = get_pool(Mesh.parse(run.mesh).size).run(train_parallel, run)
    diffs = compare(train_reference(run), results[0], run.tolerance)
    assert diffs["loss"] < 1e-12
    sent, planned = pipeline_sends(results)
    assert planned["forward"] > 0 and sent == planned
    return results[0]


@pytest.mark.parametrize(
    "sched, layers",
    [("gpipe", 2), ("1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 2), ("zbv", 4), ("ScheduleInterleavedZeroBubble", 4)],
)
def test_every_schedule_at_pp2(sched, layers):
    result = _check(model="llama-tiny", mesh="pp=2", microbatches=4, schedule=sched, overrides={"n_layers": layers})
    assert result.plan.microbatches == 4 and result.plan.schedule in sched.lower() + "zb-h1"


@pytest.mark.parametrize("sched, layers", [("1f1b", 4), ("interleaved-1f1b", 8), ("zbv", 8), ("zb-h1", 4)])
def test_schedules_at_pp4(sched, layers):
    _check(model="llama-tiny", mesh="pp=4", microbatches=4, schedule=sched, overrides={"n_layers": layers})


def test_zbv_with_a_tied_embedding_on_both_stages_of_one_rank():
    """ZBV puts the first and the last stage on rank 0, so the GPT's tied embedding is in two of
    its stages; its gradient is averaged over the microbatches once, not once per stage."""
    _check(model="gpt-tiny", mesh="pp=2", microbatches=4, schedule="zbv", overrides={"n_layer": 4})


def test_pp_with_dp_and_tied_embeddings_across_stages():
    """The GPT ties its input and output embeddings: first and last stage each hold a copy."""
    _check(model="gpt-tiny", mesh="pp=2,dp=2", microbatches=2, schedule="1f1b")


@pytest.mark.parametrize("sched, layers", [("zb-h1", 2), ("zbv", 4)])
def test_pp_with_tp_and_sequence_parallel(sched, layers):
    """With SP the residual stream crosses a boundary as its sequence shard (Megatron's scatter/gather):
    tp times fewer bytes than without SP, counted at torch's send ops (`_check`)."""
    sp = _check(model="llama-tiny", mesh="pp=2,tp=2", microbatches=2, schedule=sched, sequence_parallel=True,
                overrides={"n_layers": layers})  # fmt: skip
    hidden = [b for s in sp.plan.stages for b in s.sends if b.dtype == "float64"]
    b_m, seq, dim, tp = 4 // 2, 16, config("llama-tiny").dim, 2
    assert hidden and all(b.shape == (b_m, seq // tp, dim) and b.bytes == b_m * seq // tp * dim * 8 for b in hidden)


def test_three_d_mesh_dp_tp_pp_on_8_ranks():
    _check(model="llama-tiny", mesh="dp=2,pp=2,tp=2", microbatches=2, schedule="1f1b", batch_size=8)


def test_pp_with_zero1():
    _check(model="llama-tiny", mesh="pp=2,dp=2", microbatches=2, schedule="gpipe", zero=1)


@pytest.mark.parametrize("mesh, zero", [("pp=2,tp=2", 0), ("dp=2,pp=2,tp=2", 3)])
def test_pp_with_sequence_parallel_and_recompute(mesh, zero):
    """A stage that receives its sequence shard gathers it inside its first layer: the layers the
    recompute (and FSDP2) units are cut along hold that gather too."""
    _check(model="llama-tiny", mesh=mesh, microbatches=2, sequence_parallel=True, recompute="block", zero=zero,
           batch_size=8)  # fmt: skip


@pytest.mark.parametrize(
    "zero, sched, model, layers, mesh",
    [(3, "1f1b", "gpt-tiny", 2, "dp=2,pp=2"), (3, "zbv", "gpt-tiny", 4, "dp=2,pp=2"),
     (2, "interleaved-1f1b", "llama-tiny", 4, "dp=2,pp=2"), (3, "zb-h1", "llama-tiny", 2, "dp=2,pp=2"),
     (3, "1f1b", "llama-tiny", 2, "dp=2,pp=2,tp=2")],
)  # fmt: skip
def test_pp_with_fsdp_in_every_stage(zero, sched, model, layers, mesh):
    """ZeRO-2/3: FSDP2 shards each stage's layers over dp (torch's PipelineStage runs its gradient
    reduction after the last microbatch); the GPT's tied embedding, in the first and the last stage,
    stays whole and is summed over dp and between the stages. Zero-bubble schedules compute weight
    gradients after later forwards, so a stage's parameters stay gathered through the step."""
    key = "n_layer" if model.startswith("gpt") else "n_layers"
    result = _check(model=model, mesh=mesh, microbatches=4, schedule=sched, zero=zero, batch_size=8,
                    overrides={key: layers})  # fmt: skip
    if zero == 3:
        assert "kept until the step's last backward" in result.plan.note_map["ZeRO-3 in stages"]


@pytest.mark.parametrize("zero", [0, 3])
def test_pp_in_bf16_against_a_bf16_reference(zero):
    """Stages compute in bf16 and send bf16 activations; the fp32 masters are the optimizer's."""
    run = RunConfig(model="llama-tiny", mesh="dp=2,pp=2", microbatches=2, schedule="1f1b", zero=zero, batch_size=8,
                    dtype="float32", precision="bf16", lr=1e-3)  # fmt: skip
    result = get_pool(4).run(train_parallel, run)[0]
    compare(train_reference(run), result, run.tolerance)


def _peak_step(recompute: str) -> tuple[int, float]:
    from meshlib_torch import PeakTracker

    run = RunConfig(model="llama-tiny", mesh="pp=2", microbatches=4, schedule="gpipe", recompute=recompute,
                    batch_size=8, seq_len=32, overrides={"n_layers": 4})  # fmt: skip
    cfg, mesh = config(run.model, **run.overrides), Mesh.parse(run.mesh)
    with torch.device("meta"):
        model = build(cfg, dtype=torch.float64)
    batch = mdata.batch(0, batch_size=run.batch_size, seq_len=run.seq_len)
    par = parallelize(model, mesh=mesh, rules=default_rules(cfg, mesh), example_inputs=batch, recompute=recompute,
                      microbatches=4, schedule="gpipe", init=lambda n: ("normal", 0.02))  # fmt: skip
    opt = par.optimizer(lr=1e-3)
    par.train_step(batch, opt)  # the optimizer's state exists from here on
    with PeakTracker(device="cpu") as tracker:
        tracker.baseline(list(par.parameters()) + [v for st in opt.state.values() for v in st.values()])
        loss = par.train_step(mdata.batch(1, batch_size=run.batch_size, seq_len=run.seq_len), opt)
    return tracker.peak, loss


def test_recompute_inside_pipeline_stages():
    """GPipe keeps every microbatch's activations until its backward: with recompute each layer keeps
    its input alone, so a stage's peak drops; the losses are the same."""
    peaks = {mode: get_pool(2).run(_peak_step, mode) for mode in ("none", "block")}
    for rank in range(2):
        assert peaks["block"][rank][0] < 0.8 * peaks["none"][rank][0], peaks
        assert peaks["block"][rank][1] == pytest.approx(peaks["none"][rank][1], rel=1e-12)
    _check(model="llama-tiny", mesh="pp=2", microbatches=4, schedule="1f1b", recompute="selective")


def test_plan_records_stages_boundaries_and_traffic():
    run = RunConfig(model="llama-tiny", mesh="pp=2", microbatches=2, schedule="1f1b", steps=1, overrides={"n_layers": 4})
    result = get_pool(2).run(train_parallel, run)[0]
    plan = result.plan
    assert [s.modules for s in plan.stages] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    hidden = [b for b in plan.stages[0].sends if b.dtype == "float64" and len(b.shape) == 3]
    b_m = run.batch_size // run.microbatches
    assert [b.shape for b in hidden] == [(b_m, run.seq_len, config("llama-tiny").dim)]  # b x s x h per microbatch
    assert hidden[0].bytes == b_m * run.seq_len * 32 * 8
    sends = [c for c in plan.collectives if c.kind == "send_recv"]
    assert {c.phase for c in sends} == {"forward", "backward"} and all(c.count == 2 for c in sends)
    assert "by layer FQN on the fx graph, balanced by flops" in plan.note_map["stage split"]
    sent = result.comm["by_kind"]
    assert ("step", "broadcast", "pp") in sent  # the loss, from the last stage to every rank


def _bad(flaw: str):
    mesh = Mesh(pp=2)
    x = torch.zeros(4, 16, dtype=torch.long)
    model = build("llama-tiny")
    kw = {"microbatches": dict(microbatches=3), "1f1b": dict(microbatches=1, schedule="1f1b"),
          "stages": dict(microbatches=2, schedule="zbv")}[flaw]  # zbv: 4 stages > 2 layers
    COUNTER.reset()
    before = len(mdist._MESHES)
    try:
        parallelize(model, mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), init=lambda n: ("zeros", 0.0), **kw)
    except ValueError as err:
        return str(err), COUNTER.calls, len(mdist._MESHES) - before
    return "no error", 0, 0


@pytest.mark.parametrize(
    "flaw, message",
    [
        ("microbatches", r"the batch of 4 does not split into 3 microbatches"),
        ("stages", r"4 pipeline stages but the model has 2 layers"),
        ("1f1b", r"schedule '1f1b' with 1 microbatch\(es\) on 2 pipeline stages: torch's Schedule1F1B .* Fix: "
                 r"microbatches=2 or more, or schedule='gpipe'"),
    ],
)
def test_bad_pipeline_input_fails_on_every_rank_before_any_communication(flaw, message):
    results = get_pool(2).run(_bad, flaw)
    for text, calls, meshes in results:
        assert re.search(message, text), text
        assert calls == 0 and meshes == 0


def _stall():
    """Rank 1 never runs its stage: rank 0's send must time out, not hang."""
    mesh = Mesh(pp=2)
    x = torch.zeros(4, 16, dtype=torch.long)
    pipe = parallelize(
        build("llama-tiny"), mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x),
        init=lambda n: ("normal", 0.02), microbatches=2, timeout=4.0,
    )  # fmt: skip
    opt = pipe.optimizer(lr=1e-3)
    if torch.distributed.get_rank() == 1:
        return "skipped"
    start = time.monotonic()
    try:
        pipe.train_step((x, x), opt)
    except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError on a timeout
        return f"raised after {time.monotonic() - start:.1f}s: {type(err).__name__}: {err}"
    return "finished"


def test_a_stalled_stage_times_out_instead_of_hanging():
    """Rank 1 skips the step: rank 0's send/recv must fail at the 4 s given to parallelize, by
    meshlib's own timeout, not by the pool's job limit (60 s)."""
    try:
        results = get_pool(2).run(_stall, timeout=60)
    finally:
        close_all()  # the groups of this job are broken now
    assert results[1] == "skipped"
    seconds = float(re.search(r"after ([0-9.]+)s", results[0]).group(1))
    assert 3.5 <= seconds < 20, results
    assert "TimeoutError: pipeline step timed out on rank 0" in results[0] and "raise `timeout=`" in results[0]


def test_simulated_bubbles_match_the_closed_forms_used_in_the_benchmark():
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"):
        sim = simulate(schedule(name, 4, 8), t_f=1.0, t_b=2.0, t_w=1.0)
        assert sim.bubble == pytest.approx(bubble_formula(name, 4, 8))


@pytest.mark.parametrize("sched, mesh, layers", [("interleaved-1f1b", "pp=2", 2), ("zbv", "pp=2", 2),
                                                 ("interleaved-1f1b", "pp=2,tp=2", 6)])  # fmt: skip
def test_stages_with_only_the_embedding_or_the_head(sched, mesh, layers):
    """balance="layers" with two stages more than layers (Llama 3 405B's 126 layers on 128 stages): the first
    stage holds the embedding alone, the last the norm and the head alone, and training matches."""
    result = _check(model="llama-tiny", mesh=mesh, microbatches=4, schedule=sched, balance="layers",
                    chunks=(layers + 2) // 2, sequence_parallel="tp" in mesh, overrides={"n_layers": layers})  # fmt: skip
    stages = result.plan.stages
    assert len(stages) == layers + 2 and stages[0].modules == stages[-1].modules == ()
    assert [s.modules for s in stages[1:-1]] == [(f"layers.{i}",) for i in range(layers)]


def test_a_plan_torch_would_refuse_says_so():
    """A 1F1B plan with fewer microbatches than stages is a plan to read, not to run: it says why, with the
    fix, in the words parallelize refuses it with."""
    from meshlib_torch import compile_model

    mesh, x = Mesh(pp=2), torch.zeros(4, 16, dtype=torch.long, device="meta")
    cfg = config("llama-tiny")
    plan = compile_model(build(cfg, device="meta"), mesh=mesh, rules=default_rules(cfg, mesh), example_inputs=(x, x),
                         schedule="1f1b").plan  # fmt: skip
    assert "torch's Schedule1F1B needs at least as many microbatches as stages" in plan.note_map["schedule"]
    assert "does not run" in plan.note_map["schedule"]
    fine = compile_model(build(cfg, device="meta"), mesh=mesh, rules=default_rules(cfg, mesh), example_inputs=(x, x),
                         schedule="1f1b", microbatches=2).plan  # fmt: skip
    assert "schedule" not in fine.note_map
