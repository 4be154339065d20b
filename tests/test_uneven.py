"""uneven='chunk': dims that do not divide over their mesh axis, cut in torch.chunk's pieces.

Method (parity): the parity harness trains 3 AdamW steps on real gloo ranks and
compares losses, gradient norms and parameters with the single process: the
bundled models in fp64 to 1e-12, transformers' GPT-2 in fp32 to 1e-5. The
meshes are chosen so that dims do not divide: tp=3 over a width-32 model
(MLP 128 -> 43/43/42 rows, vocab 256 -> 86/86/84, 4 heads gathered), SP over a
sequence of 50, GPT-2 with an odd vocabulary (97 -> 49/48) vocab-parallel.

Method (per rank): what each rank holds is torch.chunk's piece of each
parameter, DTensor's documented Shard semantics, computed here from the global
shapes; the plan gives the first rank's (the largest), and what each rank
counts moving equals the plan on the first rank and is never more elsewhere.
Collectives over an uneven dim move it padded to equal pieces: an all-gather of
a 32x32 weight split 11/11/10 moves 33x32.
"""

import pytest
import real_models as rm
import torch

import meshlib as ml
from meshlib import Mesh
from meshlib_torch import compile_model, models
from meshlib_torch.testing.measure import measure_step, planned
from meshlib_torch.testing.parity import RunConfig, compare, train_parallel, train_reference
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

BUNDLED = [
    ("gpt-tiny", "tp=3", {}),
    ("llama-tiny", "dp=2,tp=3", {"zero": 1}),
    ("llama-tiny", "dp=2,tp=3", {"zero": 3}),
    ("gpt-tiny", "tp=3", {"sequence_parallel": True, "seq_len": 50}),
    ("llama-tiny", "pp=2,tp=3", {"microbatches": 2}),
]


@pytest.mark.ranks
@pytest.mark.parametrize("model, mesh, options", BUNDLED, ids=[f"{m}-{s}-{'-'.join(o)}" for m, s, o in BUNDLED])
def test_bundled_models_match_the_single_process(model, mesh, options):
    run = RunConfig(model=model, mesh=mesh, uneven="chunk", **options)
    result = get_pool(Mesh.parse(mesh).size).run(train_parallel, run)[0]
    diffs = compare(train_reference(run), result, run.tolerance)
    assert diffs["loss"] < 1e-12 and diffs["param"] < 1e-12
    assert result.plan.uneven == "chunk"


@pytest.mark.ranks
def test_bf16_matches_a_bf16_reference():
    run = RunConfig(model="llama-tiny", mesh="dp=2,tp=3", uneven="chunk", precision="bf16", zero=1, lr=1e-3)
    result = get_pool(6).run(train_parallel, run)[0]
    compare(train_reference(run), result, run.tolerance)


@pytest.mark.ranks
@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=3"])
def test_transformers_gpt2_with_an_odd_vocabulary(mesh):
    """Vocab-parallel embedding and loss over 97 rows (49/48 on tp=2; 33/32/32 on tp=3)."""
    trial = Trial(
        rm.build_gpt2_odd_vocab, rm.odd_vocab_batch, mesh=mesh, rules=rm.rules_gpt2, loss="loss",
        options={"uneven": "chunk"}, lr=1e-3,
    )  # fmt: skip
    results = get_pool(Mesh.parse(mesh).size).run(run_parallel, trial)
    diffs = assert_same(run_single(trial), results[0], rtol=1e-5, atol=1e-5)
    assert diffs["loss"] <= 1e-5
    assert all(r.losses == results[0].losses for r in results)


@pytest.mark.ranks
@pytest.mark.parametrize("mesh, options", [("tp=3", {}), ("pp=2,tp=3", {"microbatches": 2})], ids=["tp3", "pp2tp3"])
def test_a_plain_nanogpt_model_matches_the_single_process(mesh, options):
    """A nanoGPT-style model written with plain nn.Linear (width 32, 4 heads, MLP 128) on tp=3, alone and
    in a pipeline, in fp64."""
    trial = Trial(
        rm.build_nanogpt, rm.nanogpt_batch, mesh=mesh, rules=rm.rules_nanogpt, loss=1,
        options={"uneven": "chunk", **options},
    )  # fmt: skip
    results = get_pool(Mesh.parse(mesh).size).run(run_parallel, trial)
    diffs = assert_same(run_single(trial), results[0], rtol=1e-12, atol=1e-12)
    assert diffs["loss"] < 1e-12


def _chunk_bytes(plan: ml.Plan, params: dict, mesh: Mesh, coords: dict, itemsize: int) -> int:
    """The bytes of torch.chunk's piece of every parameter a rank at `coords` holds."""
    total = 0
    for name, p in params.items():
        piece = torch.empty(p.shape, device="meta")
        spec = dict(plan.specs)[name]
        for d in range(p.dim()):
            for axis in spec.dim_axes(d):
                piece = piece.chunk(mesh.axis_size(axis), d)[coords[axis]]
        total += piece.numel() * itemsize
    return total


@pytest.mark.ranks
@pytest.mark.parametrize("mesh, zero", [("tp=3", 0), ("dp=2,tp=3", 1)])
def test_each_rank_holds_its_chunk_and_moves_no_more_than_the_plan(mesh, zero):
    run = RunConfig(model="gpt-tiny", mesh=mesh, uneven="chunk", zero=zero)
    results = get_pool(Mesh.parse(mesh).size).run(measure_step, run)
    cfg = models.config("gpt-tiny")
    params = dict(models.build(cfg, device="meta").named_parameters())
    m = Mesh.parse(mesh)
    for got in results:
        want = planned(got["plan"], got["coords"])
        held = _chunk_bytes(got["plan"], params, m, got["coords"], 8)
        assert got["state"]["params"] == held, (got["coords"], got["state"]["params"], held)
        if got["coords"]["tp"] == 0:  # the first rank's pieces are the largest: the plan's
            assert got["comm"] == want["comm"]
            assert got["state"] == want["state"]
        else:
            assert set(got["comm"]) == set(want["comm"])
            assert all(got["comm"][k] <= want["comm"][k] for k in want["comm"])
            assert got["state"]["params"] <= want["state"]["params"]
            if got["coords"]["tp"] == 2:  # 128 rows: 43, 43, 42; vocab 256: 86, 86, 84
                assert got["state"]["params"] < want["state"]["params"]


def _compiled(model: str, mesh: str, **kw):
    cfg = models.config(model)
    m = Mesh.parse(mesh)
    net = models.build(cfg, device="meta")
    tokens = torch.zeros(kw.pop("batch", 8), kw.pop("seq", 64), dtype=torch.long, device="meta")
    return compile_model(net, mesh=m, rules=models.default_rules(cfg, m), example_inputs=(tokens, tokens), **kw)


def test_the_plan_pads_what_it_moves_and_keeps_the_first_rank_figures():
    compiled = _compiled("gpt-tiny", "tp=3", uneven="chunk")
    plan = compiled.plan
    # c_proj.weight 32x32 split 11/11/10 over its columns: gathered whole, moved as 33 columns
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and "S(1)" in c.reason]
    assert gathers and all(c.bytes == 32 * 33 * 4 for c in gathers)
    params = dict(compiled.traced.params)
    assert plan.memory.params == _chunk_bytes(plan, params, compiled.mesh, {"tp": 0}, 4)
    assert plan.uneven == "chunk" and ("uneven", "chunk") in plan.tables()[0].rows


def test_even_only_by_default_and_the_error_names_the_fix():
    with pytest.raises(ValueError, match=r"128 is not a multiple of 3\. Fix: .*uneven='chunk'"):
        _compiled("gpt-tiny", "tp=3")


def test_a_fused_projection_whose_parts_do_not_divide_stays_a_plain_shard():
    """4 heads over tp=3: q, k and v (32 rows each) cannot be split alike, so c_attn keeps P('tp') as
    declared, and the attention runs on its output gathered whole (the plan shows the gather)."""
    plan = _compiled("gpt-tiny", "tp=3", uneven="chunk").plan
    assert dict(plan.placements)["h.0.attn.c_attn.weight"] == ("S(0)",)
    assert any(c.kind == "all_gather" and c.op == "split.Tensor" for c in plan.collectives)
    assert "h.0.attn.c_attn.weight" in dict(plan.notes)["fused projections split as declared"]


def test_an_uneven_dim_over_several_axes_is_refused():
    cfg = models.config("gpt-tiny")
    m = Mesh.parse("dp=2,tp=3")
    net = models.build(cfg, device="meta")
    tokens = torch.zeros(6, 64, dtype=torch.long, device="meta")
    rules = ml.pattern_rules({"lm_head.weight": ml.P(("dp", "tp"))}, default=ml.P())
    with pytest.raises(ValueError, match=r"split unevenly over several mesh axes \('dp', 'tp'\)"):
        compile_model(net, mesh=m, rules=rules, example_inputs=(tokens, tokens), uneven="chunk", idle_axes=("tp",))


def test_an_uneven_batch_says_why_it_collapses_and_microbatches_refuse_it():
    with pytest.raises(ValueError, match=r"batch is cut unevenly over the data axes .*multiple of the data-parallel"):
        _compiled("gpt-tiny", "dp=3", batch=8, uneven="chunk")
    with pytest.raises(ValueError, match=r"microbatch of 4 does not divide over the 3 data-parallel ranks"):
        _compiled("gpt-tiny", "dp=3", batch=8, uneven="chunk", microbatches=2)


def test_uneven_policy_is_checked():
    with pytest.raises(ValueError, match=r"uneven='pad': choose one of \('error', 'chunk'\)"):
        _compiled("gpt-tiny", "tp=2", uneven="pad")


def test_rank_zero_holds_the_most():
    """torch.chunk gives the first ranks ceil(n / ways): the plan's figure is the most loaded rank's."""
    compiled = _compiled("llama-tiny", "tp=3", uneven="chunk")
    plan = compiled.plan
    per_rank = [_chunk_bytes(plan, dict(compiled.traced.params), compiled.mesh, {"tp": c}, 4) for c in range(3)]
    assert plan.memory.params == max(per_rank) == per_rank[0] > per_rank[2]
