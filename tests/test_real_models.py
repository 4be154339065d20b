"""Models nobody here wrote, unmodified: the single process's numbers, or a clear error.

Method (parity): every rank of a `RankPool` builds the model with the same seed and
hands it, weights and all, to `parallelize`; 3 AdamW steps follow on the mesh. The
parent trains the unmodified model, with the same weights and batches, with
`torch.optim.AdamW`. Each step's loss, every gradient after the first backward and
every parameter after the last step must agree: the nanoGPT-style model in fp64 to
1e-12; transformers' models in fp32 to rtol/atol 1e-5 (their loss function casts the
logits to fp32 even in an fp64 model, so fp64 buys nothing there). Clipped (ZeRO-1 with recompute and
sequence parallelism or a pipeline): SGD with momentum, clipped to a global norm each step, against the
same model clipped by `torch.nn.utils.clip_grad_norm_`.

Method (plans, no processes): Megatron's pattern on each model's own parameter
names, counted in the plan: per layer 2 tensor-parallel all-reduces of b*s*h forward
and 2 backward (with sequence parallelism an all-gather plus a reduce-scatter each),
no parameter gathered, nothing gathered over the data axis; and the bytes each rank
counted on a real step equal the plan's.
"""

import gc
import re
import weakref

import pytest
import real_models as rm
import torch

import meshlib as ml
from meshlib_torch import compile_model, parallelize
from meshlib_torch.compiler.capture.call import batch_call, pick_loss
from meshlib_torch.testing.pool import RankError, get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytest.importorskip("transformers")

LAYERS, HIDDEN = 2, 32
MESHES = [
    ("dp=2", {}),
    ("tp=2", {}),
    ("dp=2,tp=2", {}),
    ("pp=2", {"microbatches": 2}),
    ("dp=2,pp=2", {"microbatches": 2}),
]
_REFERENCES: dict = {}


def _trial(name: str, mesh: str, options: dict) -> Trial:
    build, rules, batch, loss = rm.MODELS[name]
    return Trial(build, batch, mesh=mesh, rules=rules, loss=loss, options=options, lr=1e-3)


def _reference(name: str, trial: Trial):
    if name not in _REFERENCES:
        _REFERENCES[name] = run_single(trial)
    return _REFERENCES[name]


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama"])
@pytest.mark.parametrize("mesh, options", MESHES, ids=[m for m, _ in MESHES])
def test_parity_with_the_unmodified_model(name, mesh, options):
    trial = _trial(name, mesh, options)
    results = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    tol = 1e-12 if name == "nanogpt" else 1e-5
    diffs = assert_same(_reference(name, trial), results[0], rtol=tol, atol=tol)
    assert all(r.losses == results[0].losses for r in results)  # every rank reports the same loss
    if "pp" not in mesh:  # what each rank counted at the collective layer is what the plan says
        planned: dict = {}
        for c in results[0].plan.collectives:
            key = (c.phase, c.kind, c.axes[0])
            planned[key] = planned.get(key, 0) + c.total_bytes
        assert results[0].comm["by_kind"] == planned
    assert diffs["loss"] <= tol


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["gpt2", "llama", "nanogpt"])
def test_parity_with_sequence_parallelism(name):
    trial = _trial(name, "dp=2,tp=2", {"sequence_parallel": True})
    results = get_pool(4).run(run_parallel, trial)
    tol = 1e-12 if name == "nanogpt" else 1e-5
    assert_same(_reference(name, trial), results[0], rtol=tol, atol=tol)


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_compute_is_the_model_run_in_bf16(name):
    """precision='bf16' on an fp32 model: the first step's loss and gradients are those of the model cast
    to bf16 and run as it is. torch.export writes the dtypes it traced into the graph (GPT-2's
    `.to(device)`, Llama's RMSNorm casting back to its input's dtype); the model is traced as it computes."""
    build, rules, batch, loss = rm.MODELS[name]
    trial = Trial(build, batch, mesh="dp=2,tp=2", rules=rules, loss=loss, options={"precision": "bf16"}, steps=1)
    got = get_pool(4).run(run_parallel, trial)[0]
    model = build().to(torch.bfloat16)
    args, kwargs = batch_call(batch(0))
    want = pick_loss(model(*args, **kwargs), loss)
    want.backward()
    assert got.losses[0] == pytest.approx(want.item(), rel=1e-3)
    for n, p in model.named_parameters():  # bf16 keeps 8 bits: sums in other orders differ by a few %
        scale = float(p.grad.float().abs().max())
        assert float((got.grads[n].float() - p.grad.float()).abs().max()) <= 0.1 * scale, n


CLIPPED = [
    ("dp=2,tp=2", {"sequence_parallel": True, "recompute": "block", "zero": 1}),
    ("dp=2,pp=2", {"microbatches": 2, "recompute": "block", "zero": 1}),
]


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["llama", "nanogpt"])
@pytest.mark.parametrize("mesh, options", CLIPPED, ids=[m for m, _ in CLIPPED])
def test_clipped_sgd_under_zero1_is_torchs_clipping_on_the_unmodified_model(name, mesh, options):
    """transformers' Llama and the nanoGPT-style model (fp64, 1e-12) under ZeRO-1 with block recompute
    (and sequence parallelism, or a pipeline),
    clipped to a global norm every step (`train_step(max_norm=)`, the norm from ZeRO-1's reduce-scattered
    pieces), against the unmodified model clipped by `torch.nn.utils.clip_grad_norm_`. SGD with momentum
    steps in proportion to the clipped gradient (AdamW would nearly divide the scale out), so a norm off by
    any factor moves every parameter; 0.05 is below every step's norm."""
    build, rules, batch, loss = rm.MODELS[name]
    trial = Trial(build, batch, mesh=mesh, rules=rules, loss=loss, options=options, lr=0.5,
                  optimizer=torch.optim.SGD, optimizer_options={"momentum": 0.9}, max_norm=0.05)  # fmt: skip
    results = get_pool(4).run(run_parallel, trial)
    tol = 1e-12 if name == "nanogpt" else 1e-5
    assert_same(run_single(trial), results[0], rtol=tol, atol=tol)


# -- plans ------------------------------------------------------------------------------------
def _plan(name: str, mesh: str, sp: bool = False) -> ml.Plan:
    build, rules, batch, loss = rm.MODELS[name]
    m = ml.Mesh.parse(mesh)
    return compile_model(build(), mesh=m, rules=rules(m), example_inputs=batch(0), loss=loss, sequence_parallel=sp).plan


def _itemsize(name: str) -> int:
    return next(rm.MODELS[name][0]().parameters()).element_size()


def _count(plan, phase, kind, axis, nbytes=None):
    return sum(
        c.count for c in plan.collectives
        if (c.phase, c.kind, c.axes) == (phase, kind, (axis,)) and (nbytes is None or c.bytes == nbytes)
    )  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "llama", "nanogpt"])
@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_megatron_pattern_on_the_models_own_names(name, mesh):
    """Forward: the embedding's sum and 2 per layer; backward: 2 per layer and the head's input; b*s*h each."""
    plan = _plan(name, mesh)
    dp = ml.Mesh.parse(mesh).axis_size("dp") if "dp" in mesh else 1
    bsh = rm.BATCH // dp * rm.SEQ * HIDDEN * _itemsize(name)
    assert _count(plan, "forward", "all_reduce", "tp", bsh) == 2 * LAYERS + 1
    assert _count(plan, "backward", "all_reduce", "tp", bsh) == 2 * LAYERS + 1
    assert _count(plan, "forward", "all_gather", "tp") == 0  # no weight gathered, no fused qkv gathered
    forward_dp = [c for c in plan.collectives if "dp" in c.axes and c.phase == "forward"]
    assert {c.kind for c in forward_dp} <= {"all_reduce"} and all(c.bytes <= 8 for c in forward_dp)  # loss scalars
    assert "ops run whole on every rank (no rule)" not in plan.note_map


@pytest.mark.parametrize("name", ["gpt2", "llama", "nanogpt"])
def test_sequence_parallel_pattern(name):
    plan = _plan(name, "tp=2", sp=True)
    bsh = rm.BATCH * rm.SEQ * HIDDEN * _itemsize(name)
    assert _count(plan, "forward", "all_reduce", "tp", bsh) == 0
    assert _count(plan, "forward", "reduce_scatter", "tp", bsh) == 2 * LAYERS + 1
    assert _count(plan, "forward", "all_gather", "tp", bsh) == 2 * LAYERS + 1
    assert _count(plan, "backward", "reduce_scatter", "tp", bsh) == 2 * LAYERS + 1


def test_conv1d_and_fused_qkv_hold_whole_heads():
    plan = _plan("gpt2", "tp=2")
    placements = dict(plan.placements)
    assert placements["transformer.h.0.attn.c_attn.weight"] == ("S(1/3)",)  # Conv1D: (in, out), out in 3 parts
    assert placements["transformer.h.0.attn.c_attn.bias"] == ("S(0/3)",)
    assert placements["transformer.h.0.attn.c_proj.weight"] == ("S(0)",)
    assert plan.note_map["use_cache (set by meshlib)"] == "False"


def test_a_tied_parameter_takes_the_spec_given_to_either_name():
    """nanoGPT ties wte to lm_head; the rules name only lm_head.weight: the embedding is vocab-parallel too."""
    plan = _plan("nanogpt", "tp=2")
    assert dict(plan.placements)["wte.weight"] == ("S(0)",)
    m = rm.build_nanogpt()
    rules = ml.pattern_rules({"wte.weight": ml.P(), "lm_head.weight": ml.P("tp", None)}, default=ml.P())
    with pytest.raises(ValueError, match=r"tied parameters get different specs under their names: P\('tp', None\) as lm_head\.weight, P\(\) as wte\.weight"):
        compile_model(m, mesh=ml.Mesh(tp=2), rules=rules, example_inputs=rm.nanogpt_batch(0), loss=1)


# -- errors before any collective ----------------------------------------------------------------
class _Erfcx(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.special.erfcx(self.proj(x))  # an op with no rule
        return (h - y).square().mean()


def test_a_data_parallel_collapse_names_the_op_node_and_line():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rules = ml.pattern_rules({}, default=ml.P())
    with pytest.raises(ValueError, match=r"data parallelism would collapse: special_erfcx \(node special_erfcx, at test_real_models\.py:\d+\) needs add \[4, 8\] whole over data axis 'dp': it has no rule"):
        compile_model(_Erfcx(), mesh=ml.Mesh(dp=2), rules=rules, example_inputs=(x, y))
    plan = compile_model(_Erfcx(), mesh=ml.Mesh(dp=2), rules=rules, example_inputs=(x, y), allow_data_gather=True).plan
    assert plan.note_map["ops run whole on every rank (no rule)"].startswith("special_erfcx (torch.special.special_erfcx) at test_real_models.py:")
    assert _count(plan, "forward", "all_gather", "dp") == 2  # the op's input, then the target it meets


def test_an_op_without_a_rule_runs_whole_where_that_is_free():
    """Over tp (no data split) the same op runs whole, and the plan says so per op."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rules = ml.pattern_rules({"proj.weight": ml.P("tp", None)}, default=ml.P())
    plan = compile_model(_Erfcx(), mesh=ml.Mesh(tp=2), rules=rules, example_inputs=(x, y), in_specs={"x": ml.P(), "y": ml.P()}).plan
    assert "special_erfcx" in plan.note_map["ops run whole on every rank (no rule)"]


class _TwoScalars(rm.NanoGPT):
    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss, loss * 2


def test_which_output_is_the_loss():
    m, batch = rm.build_nanogpt(), rm.nanogpt_batch(0)
    mesh, rules = ml.Mesh(dp=2), rm.rules_nanogpt(ml.Mesh(dp=2))
    with pytest.raises(ValueError, match=r"which output is the loss\? The model returns \(tensor\(8, 16, 96\), tensor\(\), tensor\(\)\)\. Fix: pass loss="):
        compile_model(_TwoScalars().double(), mesh=mesh, rules=rules, example_inputs=batch)
    with pytest.raises(ValueError, match=r"loss=5: the model's output has no such entry; it returns \(tensor\(8, 16, 96\), tensor\(\)\)"):
        compile_model(m, mesh=mesh, rules=rules, example_inputs=batch, loss=5)
    plan = compile_model(m, mesh=mesh, rules=rules, example_inputs=batch).plan  # the lone scalar is the loss
    assert plan.note_map["data-parallel axes"] == "dp"
    plan = compile_model(_TwoScalars().double(), mesh=mesh, rules=rules, example_inputs=batch, loss=lambda out: out[2]).plan
    assert plan.note_map["data-parallel axes"] == "dp"


def test_keyword_inputs_bind_by_name_and_mismatches_say_what_to_fix():
    m = rm.build_gpt2()
    mesh = ml.Mesh(dp=2)
    ids = torch.zeros(8, 16, dtype=torch.long)
    with pytest.raises(TypeError, match=r"the inputs do not fit the model's forward"):
        compile_model(m, mesh=mesh, rules=rm.rules_gpt2(mesh), example_inputs=(ids,), example_kwargs={"input_ids": ids})
    c = compile_model(m, mesh=mesh, rules=rm.rules_gpt2(mesh), example_inputs={"input_ids": ids, "labels": ids})
    assert c.input_names == ["input_ids", "labels"]
    with pytest.raises(TypeError, match=r"tensor inputs \['labels'\] not given"):
        c.traced.call.bind((), {"input_ids": ids})
    with pytest.raises(TypeError, match=r"\['use_cache'\] differ from the compiled values \[False\]"):
        c.traced.call.bind((), {"input_ids": ids, "labels": ids, "use_cache": True})


# -- weights -------------------------------------------------------------------------------------
def _parallelize_twice(kind: str):
    """On every rank: the model's weights checked against init= and the meta device."""

    mesh = ml.Mesh(dp=2)
    rules = rm.rules_nanogpt(mesh)
    batch = rm.nanogpt_batch(0)
    if kind == "init with weights":
        parallelize(rm.build_nanogpt(), mesh=mesh, rules=rules, example_inputs=batch, init=lambda n: ("normal", 0.02))
    elif kind == "meta without init":
        with torch.device("meta"):
            model = rm.NanoGPT()
        parallelize(model, mesh=mesh, rules=rules, example_inputs=batch)
    elif kind == "different weights":
        torch.manual_seed(torch.distributed.get_rank())
        parallelize(rm.NanoGPT().double(), mesh=mesh, rules=rules, example_inputs=batch)
    else:  # the whole copy is released: nothing in meshlib keeps the model's tensors
        model = rm.build_nanogpt()
        ref = weakref.ref(model.h[0].attn.c_attn.weight)
        par = parallelize(model, mesh=mesh, rules=rules, example_inputs=batch, loss=1)
        gc.collect()
        return ref() is None, all(p.is_meta for p in model.parameters()), len(par.named_model_parameters())


@pytest.mark.ranks
@pytest.mark.parametrize(
    "kind, message",
    [
        ("init with weights", r"the model has its own weights, and init= would replace them"),
        ("meta without init", r"the model is on the meta device and has no values, and neither weights= \(a checkpoint to read\) nor init="),
        ("different weights", r"the ranks were given different weights: h\.0\.attn\.c_attn\.bias, .* differ between ranks"),
    ],
)
def test_weights_errors_on_every_rank(kind, message):
    with pytest.raises(RankError) as err:
        get_pool(2).run(_parallelize_twice, kind)
    assert sorted(err.value.failures) == [0, 1]  # raised on every rank
    assert all(re.search(message, why) for why in err.value.failures.values()), err.value.failures


@pytest.mark.ranks
def test_the_models_whole_copy_is_released():
    freed, meta, n = get_pool(2).run(_parallelize_twice, "release")[0]
    assert freed and meta and n == sum(1 for _ in rm.build_nanogpt().parameters())


# -- grad-mode and autocast regions ---------------------------------------------------------------
@pytest.mark.ranks
@pytest.mark.parametrize("build", [rm.build_regions_fx, rm.build_regions_export], ids=["fx", "export"])
def test_no_grad_and_autocast_blocks_keep_their_meaning(build):
    """A statistic under no_grad and a bf16 autocast head: the same as the single process to bf16's
    tolerance, while the same model with the statistic differentiated is far outside it."""
    trial = Trial(build, rm.regions_batch, mesh="dp=2", lr=1e-2)
    ref = run_single(trial)
    par = get_pool(2).run(run_parallel, trial)[0]
    assert_same(ref, par, rtol=1e-2, atol=1e-2)
    assert par.plan.note_map["trace"] == ("fx" if build is rm.build_regions_fx else "export")
    with torch.no_grad():  # the statistic, had its gradient flowed: inp's gradient moves by 0.1, 10x the tolerance
        model = build()
        x, y = rm.regions_batch(0)
    model.zero_grad()
    h = torch.tanh(model.inp(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.out(h * model.scale / (h.square().mean(-1, keepdim=True) + 0.05))
    torch.nn.functional.cross_entropy(logits.float(), y).backward()
    assert float((model.inp.weight.grad - ref.grads["inp.weight"]).abs().max()) > 0.1


def _train_with_dropout(mesh: str):
    """Three steps of GPT-2 with dropout; every rank's local shards and losses."""
    from meshlib_torch import parallelize

    m = ml.Mesh.parse(mesh)
    torch.manual_seed(100 + torch.distributed.get_rank())  # however the ranks were seeded before
    par = parallelize(rm.build_gpt2_dropout(), mesh=m, rules=rm.rules_gpt2(m), example_inputs=rm.hf_batch(0))
    opt = par.optimizer(lr=1e-3)
    losses = [par.train_step(rm.hf_batch(step), opt) for step in range(3)]
    local = {n: p.to_local().detach().clone() for n, p in par.named_model_parameters().items()}
    return losses, local, m.coords(torch.distributed.get_rank()), dict(par.plan.notes)


@pytest.mark.ranks
def test_dropout_draws_the_same_masks_on_replicas():
    """Ranks holding the same block of a parameter (replicas over dp, and over tp for what tp does not
    split) end three dropout steps with equal values: their masks agreed wherever their values did."""
    results = get_pool(4).run(_train_with_dropout, "dp=2,tp=2")
    losses, first, _, notes = results[0]
    # the embeddings', 2 residuals' per layer and attention's own (inside scaled_dot_product_attention)
    assert notes["random ops"].startswith("7 (aten.dropout.default, aten.scaled_dot_product_attention.default)")
    no_dropout = run_single(Trial(rm.build_gpt2, rm.hf_batch, lr=1e-3)).losses
    assert losses[0] != pytest.approx(no_dropout[0], abs=1e-4)  # dropout is on
    for r_losses, *_ in results[1:]:
        assert r_losses == losses
    by_tp = {}
    for _, local, coords, _ in results:
        by_tp.setdefault(coords["tp"], []).append(local)
    for replicas in by_tp.values():  # dp replicas of every block
        for name in replicas[0]:
            torch.testing.assert_close(replicas[1][name], replicas[0][name], rtol=0, atol=0)
    whole = [n for n, p in _plan("gpt2", "dp=2,tp=2").placements if p == ("R", "R")]
    for name in whole:  # and tp replicas of what tp does not split
        torch.testing.assert_close(by_tp[1][0][name], by_tp[0][0][name], rtol=0, atol=0)


@pytest.mark.ranks
@pytest.mark.parametrize("mesh", ["pp=2", "dp=2,pp=2"])
def test_an_untraceable_model_returning_logits_and_loss_pipelines_by_module_name(mesh):
    trial = Trial(rm.build_untraceable_nanogpt, rm.nanogpt_batch, mesh=mesh, rules=rm.rules_nanogpt, loss=1,
                  options={"microbatches": 2}, lr=1e-3)  # fmt: skip
    results = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    assert results[0].plan.note_map["stage split"] == "by module FQN on the eager model, balanced by flops"
    assert_same(_reference("nanogpt", _trial("nanogpt", mesh, {})), results[0], rtol=1e-12, atol=1e-12)


# -- any torch optimizer -------------------------------------------------------------------------
@pytest.mark.ranks
@pytest.mark.parametrize("zero", [0, 1, 3])
@pytest.mark.parametrize(
    "optimizer, options",
    [
        (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        (torch.optim.AdamW, {"betas": (0.8, 0.9), "weight_decay": 0.05}),
    ],
    ids=["sgd-momentum", "adamw"],
)
def test_any_torch_optimizer_on_every_zero_level(optimizer, options, zero):
    """torch.optim's own classes, as the user builds them, on the nanoGPT-style model (fp64, dp=2 x tp=2):
    ZeRO-1 shards their state over dp, ZeRO-3 is FSDP2's."""
    trial = Trial(rm.build_nanogpt, rm.nanogpt_batch, mesh="dp=2,tp=2", rules=rm.rules_nanogpt, loss=1,
                  options={"zero": zero}, optimizer=optimizer, optimizer_options=options, lr=1e-2)  # fmt: skip
    assert_same(run_single(trial), get_pool(4).run(run_parallel, trial)[0], rtol=1e-12, atol=1e-12)


# Adafactor's first step is grad / sqrt(grad^2 + eps1^2) per element: with torch's default eps1 (the dtype's
# machine epsilon) an attention key bias, whose gradient is zero up to rounding, steps by +-lr on noise.
ADAFACTOR = (torch.optim.Adafactor, {"eps": (1e-8, 1e-3)})


@pytest.mark.ranks
def test_adafactor_trains_where_parameters_are_whole():
    trial = Trial(rm.build_nanogpt, rm.nanogpt_batch, mesh="dp=2", rules=rm.rules_nanogpt, loss=1,
                  optimizer=ADAFACTOR[0], optimizer_options=ADAFACTOR[1], lr=1e-2)  # fmt: skip
    assert_same(run_single(trial), get_pool(2).run(run_parallel, trial)[0], rtol=1e-12, atol=1e-12)


def _adafactor_on(mesh: str, zero: int) -> None:
    m = ml.Mesh.parse(mesh)
    par = parallelize(rm.build_nanogpt(), mesh=m, rules=rm.rules_nanogpt(m), example_inputs=rm.nanogpt_batch(0),
                      loss=1, zero=zero)  # fmt: skip
    par.optimizer(ADAFACTOR[0], lr=1e-2, **ADAFACTOR[1])


@pytest.mark.ranks
@pytest.mark.parametrize("mesh, zero", [("tp=2", 0), ("dp=2", 1), ("dp=2", 3)])
def test_an_optimizer_that_reads_whole_tensors_is_refused_on_shards(mesh, zero):
    """Adafactor's row and column means over a shard are not the whole tensor's: `par.optimizer` says so
    on every rank, before any step."""
    with pytest.raises(RankError) as err:
        get_pool(2).run(_adafactor_on, mesh, zero)
    assert sorted(err.value.failures) == [0, 1]
    for why in err.value.failures.values():
        assert "torch.optim.Adafactor cannot step on this plan's shards: it does not update each" in why


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.ranks
def test_a_learning_rate_scheduler_drives_the_mesh_optimizer():
    """torch's LR schedulers take the optimizer `par.optimizer` returns, as they take any other."""
    trial = Trial(rm.build_nanogpt, rm.nanogpt_batch, mesh="dp=2", rules=rm.rules_nanogpt, loss=1,
                  options={"zero": 1}, scheduler=halving, lr=1e-2)  # fmt: skip
    ref = run_single(trial)
    assert_same(ref, get_pool(2).run(run_parallel, trial)[0], rtol=1e-12, atol=1e-12)
    constant = run_single(Trial(rm.build_nanogpt, rm.nanogpt_batch, loss=1, lr=1e-2))
    assert ref.losses[2] != pytest.approx(constant.losses[2], abs=1e-6)  # the schedule changed the steps
