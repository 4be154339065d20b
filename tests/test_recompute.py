"""What recompute runs again, and what sequence parallelism gathers again, counted in the plan.

Method: (1) plan = measured. On real gloo ranks, one step after two warm-up steps, the bytes
meshlib's collective layer counts per (phase, kind, axis) equal the plan's for that rank, for
recompute none, block and selective on tp, tp with sequence parallelism, dp x tp with ZeRO-3,
pp x tp and bf16 sequence parallelism, and for pp x tp x SP in bf16. What a recomputed layer
runs again is counted under the phase "recompute"; an all-gathered value backward needs is kept
as its shard and gathered again in backward. (2) Closed forms on the bundled Llama (L layers,
per layer two all-gathers and two reduce-scatters under SP, two all-reduces without): block
recompute runs again every collective of a layer but the last, after which the layer saves
nothing (torch's early stop); selective keeps every collective's output but the all-gathers', so
it runs again only those, and no more than the step without recompute already gathers again.
"""

import pytest
import torch

from meshlib import Mesh
from meshlib_torch import compile_model, models
from meshlib_torch.testing.measure import measure_step, planned
from meshlib_torch.testing.parity import RunConfig
from meshlib_torch.testing.pool import get_pool

MESHES = {
    "tp2": dict(mesh="tp=2"),
    "tp2-sp": dict(mesh="tp=2", sequence_parallel=True),
    "dp2tp2-zero3": dict(mesh="dp=2,tp=2", zero=3),
    "pp2tp2": dict(mesh="pp=2,tp=2", microbatches=2),
    "tp2-sp-bf16": dict(mesh="tp=2", sequence_parallel=True, precision="bf16"),
}
CASES = {f"{name}-{mode}": dict(kw, recompute=mode) for name, kw in MESHES.items() for mode in ("none", "block", "selective")}
CASES["pp2tp2-sp-bf16-1f1b"] = dict(mesh="pp=2,tp=2", microbatches=4, sequence_parallel=True, precision="bf16")
CASES["gpt-tp2-block"] = dict(mesh="tp=2", recompute="block", model="gpt-tiny")


@pytest.mark.ranks
@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_a_measured_step(case):
    kw = dict(CASES[case])
    model = kw.pop("model", "llama-tiny")
    dtype = "float32" if "precision" in kw else "float64"
    run = RunConfig(model=model, steps=3, batch_size=8, dtype=dtype, lr=1e-3, **kw)
    for got in get_pool(Mesh.parse(run.mesh).size).run(measure_step, run):
        want = planned(got["plan"], got["coords"])
        assert got["comm"] == want["comm"], (got["rank"], got["coords"])
        assert got["state"] == want["state"], (got["rank"], got["coords"])
    again = {kind for phase, kind, _ in want["comm"] if phase == "recompute"}
    if kw.get("recompute") == "block":
        assert again  # a recomputed layer runs its collectives again, and the plan says so
    if kw.get("recompute") == "selective":
        assert again <= {"all_gather"}  # it keeps every other collective's output


L, H, B, S = 4, 64, 8, 32


def _plan(mesh: str, **options):
    cfg = models.LlamaConfig(vocab_size=256, dim=H, n_layers=L, n_heads=4, hidden_dim=128, max_seq_len=S)
    m = Mesh.parse(mesh)
    example = tuple(torch.empty(B, S, dtype=torch.long, device="meta") for _ in range(2))
    model = models.build(cfg, device="meta")
    return compile_model(model, mesh=m, rules=models.default_rules(cfg, m), example_inputs=example, **options).plan


def _count(plan, phase: str, kind: str, *, again: str | None = None) -> int:
    return sum(
        c.count for c in plan.collectives
        if c.phase == phase and c.kind == kind and c.axes == ("tp",) and c.bytes == B * S * H * 4
        and (again is None or again in c.reason)
    )  # fmt: skip


def test_block_recompute_runs_a_layers_collectives_again_but_the_last():
    """Under SP a Llama layer gathers its input twice and reduce-scatters twice; recomputed, it runs
    again all but the last reduce-scatter: 2 all-gathers and 1 reduce-scatter per layer. Without SP the
    residual stays a partial sum until a norm reads it: both all-reduces feed a norm, and both run again
    (as in Megatron's full recompute)."""
    sp = _plan("tp=2", sequence_parallel=True, recompute="block")
    assert (_count(sp, "recompute", "all_gather"), _count(sp, "recompute", "reduce_scatter")) == (2 * L, L)
    plain = _plan("tp=2", recompute="block")
    assert _count(plain, "recompute", "all_reduce") == 2 * L
    # the head's all-gather is outside the recomputed layers: its input is kept as the shard and gathered again
    assert _count(sp, "backward", "all_gather", again="again in backward") == 1


def test_selective_recompute_adds_no_collective_to_the_step():
    """Selective keeps what every collective but the all-gathers returns: without SP it runs nothing
    again; with SP it runs again each all-gather, which the step without recompute gathers again in
    backward anyway (its savers keep the shard): the same number of all-gathers in all."""
    assert not [c for c in _plan("tp=2", recompute="selective").collectives if c.phase == "recompute"]
    sel, none = _plan("tp=2", sequence_parallel=True, recompute="selective"), _plan("tp=2", sequence_parallel=True)
    assert _count(sel, "recompute", "reduce_scatter") == 0
    assert _count(sel, "recompute", "all_gather") == 2 * L
    assert _count(none, "backward", "all_gather", again="again") == 2 * L + 1  # each layer's two, and the head's
    total = lambda p: sum(c.total_bytes for c in p.collectives if c.kind == "all_gather")  # noqa: E731
    assert total(sel) == total(none)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_recompute_under_a_zero_bubble_schedule_is_refused(schedule):
    with pytest.raises(ValueError, match=rf"recompute='block' with the {schedule} schedule.*Fix: use recompute='none'"):
        _plan("pp=2", recompute="block", microbatches=4, schedule=schedule)
