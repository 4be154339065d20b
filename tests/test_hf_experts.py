"""transformers' mixture-of-experts models, unmodified, on expert parallelism: the single process's numbers,
or an error naming what meshlib does not run.

Method (parity): every rank of a `RankPool` builds the model (`hf_moe_models`: tiny configs, random
weights, no download) and hands it to `parallelize` on the mesh; each experts module becomes the
`experts_ep` region over `ep` (tokens to their experts by all-to-all), the router and shared experts stay
graph ops placed by their rules. 3 AdamW steps follow. The parent trains the unmodified model with the
same weights and batches with `torch.optim.AdamW`. The losses, every gradient after the first backward
and every parameter after the last step must agree. transformers computes routers, norms, rotary angles
and the loss's logits in fp32 whatever the model's dtype (`.float()`, `.to(torch.float32)`,
`.type(torch.float32)`); both sides run under `fp64_kept`, which leaves an fp64 tensor as it is there, so
both are fp64 throughout and agree to 1e-12. Unpatched, in fp32, DeepSeek-V3 agrees to 1e-5: the patch
hides nothing but rounding.

Method (errors, no processes): a model with an option meshlib does not run, or experts stored in a layout
it does not recognise, is refused by `compile_model`, naming the module and the fix.
"""

from __future__ import annotations

import hf_moe_models as hm
import pytest
import torch

import meshlib as ml
from meshlib_torch import compile_model
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytest.importorskip("transformers")

MODELS = {
    "mixtral": hm.build_mixtral,
    "mixtral-aux": hm.build_mixtral_aux,
    "deepseek-v3": hm.build_deepseek,
    "qwen2-moe": hm.build_qwen2_moe,
    "qwen3-moe": hm.build_qwen3_moe,
    "olmoe": hm.build_olmoe,
}
_REFERENCES: dict = {}
PP = {"microbatches": 2}
REPLICATED = ml.pattern_rules({}, default=ml.P())  # the expert weights go over ep by themselves


def _trial(name: str, mesh: str, options: dict) -> Trial:
    return Trial(MODELS[name], hm.batch, mesh=mesh, loss="loss", lr=1e-3, options=options)


def _reference(name: str):
    if name not in _REFERENCES:
        _REFERENCES[name] = hm.run_single_fp64(_trial(name, "dp=2", {}))
    return _REFERENCES[name]


def _parity(name: str, mesh: str, options: dict) -> None:
    results = get_pool(ml.Mesh.parse(mesh).size).run(hm.run_parallel_fp64, _trial(name, mesh, options))
    for rank in results:
        assert_same(_reference(name), rank, rtol=1e-12, atol=1e-12)
    plan = results[0].plan
    assert plan.note_map["trace"] == "export"  # transformers' forwards defeat torch.fx
    assert any(c.kind == "all_to_all" and c.axes == ("ep",) for c in plan.collectives)  # the experts ran on ep


@pytest.mark.ranks
@pytest.mark.parametrize(
    "name, mesh, options",
    [
        ("mixtral", "ep=2", {}),
        ("mixtral", "dp=2,ep=2", {}),
        ("mixtral", "ep=2,pp=2", PP),
        ("mixtral-aux", "dp=2,ep=2", {}),
        ("deepseek-v3", "ep=2", {}),
        ("deepseek-v3", "dp=2,ep=2", {}),
        ("deepseek-v3", "ep=2,pp=2", PP),
        ("mixtral", "dp=2,ep=2", {"zero": 3}),
        ("mixtral", "ep=2,cp=2", {}),  # the sequence over cp: ring attention, experts take head-tail chunks
        ("deepseek-v3", "ep=2,cp=2", {}),
        ("deepseek-v3", "dp=2,ep=2", {"zero": 1}),
    ],
)
def test_parity_with_the_unmodified_model(name, mesh, options):
    _parity(name, mesh, options)


@pytest.mark.ranks
def test_clipped_sgd_on_experts_under_zero1_is_torchs_clipping():
    """DeepSeek-V3's experts on dp=2 x ep=2 under ZeRO-1, clipped to a global norm every step: the norm
    counts each expert once (its weights split over ep, summed over dp only) and the shared weights once,
    as `torch.nn.utils.clip_grad_norm_` on the unmodified model. SGD with momentum (scale-sensitive)."""
    trial = Trial(MODELS["deepseek-v3"], hm.batch, mesh="dp=2,ep=2", loss="loss", lr=0.5, options={"zero": 1},
                  optimizer=torch.optim.SGD, optimizer_options={"momentum": 0.9}, max_norm=0.05)  # fmt: skip
    results = get_pool(4).run(hm.run_parallel_fp64, trial)
    assert_same(hm.run_single_fp64(trial), results[0], rtol=1e-12, atol=1e-12)


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe", "olmoe"])
def test_parity_of_families_with_mixtrals_expert_layout(name):
    _parity(name, "ep=2", {})


@pytest.mark.ranks
def test_fp32_unpatched_agrees_to_fp32_rounding():
    trial = Trial(hm.build_deepseek_fp32, hm.batch, mesh="ep=2", loss="loss", lr=1e-3)
    assert_same(run_single(trial), get_pool(2).run(run_parallel, trial)[0], rtol=1e-5, atol=1e-5)


# -- plans (no processes) --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral-aux", "deepseek-v3"])
def test_every_router_op_has_a_rule(name):
    """Every op of the routers, the balancing loss and MLA is placed by a rule (none runs whole), and the
    experts are one region per layer: an all-to-all there and back over ep, forward and backward."""
    with hm.fp64_kept():
        plan = compile_model(MODELS[name](), mesh=ml.Mesh(dp=2, ep=2), rules=REPLICATED, example_inputs=hm.batch(0),
                             loss="loss").plan  # fmt: skip
    assert "ops run whole on every rank (no rule)" not in plan.note_map
    assert plan.note_map["data-parallel axes"] == "dp,ep"
    moe_layers = 1 if name == "deepseek-v3" else 2
    for phase in ("forward", "backward"):
        exchanges = sum(c.count for c in plan.collectives if (c.phase, c.kind, c.axes) == (phase, "all_to_all", ("ep",)))
        assert exchanges >= 2 * moe_layers, phase


# -- what meshlib does not run ---------------------------------------------------------------------
def _compile(model: torch.nn.Module):
    return compile_model(model, mesh=ml.Mesh(ep=2), rules=REPLICATED, example_inputs=hm.batch(0), loss="loss")


def test_router_jitter_noise_in_training_is_refused_by_name():
    model = hm._transformers().MixtralForCausalLM(hm.mixtral_config(router_jitter_noise=0.1)).train()
    with pytest.raises(NotImplementedError, match=r"^model\.layers\.0\.mlp \(MixtralSparseMoeBlock\): router jitter noise 0\.1 in training .*Fix: set router_jitter_noise=0"):
        _compile(model)


def test_experts_with_biases_in_another_layout_are_refused_by_name():
    """gpt-oss stores its experts transposed, gate and up interleaved, with biases (gate_up_proj (E, H, 2I),
    gate_up_proj_bias, down_proj (E, I, H), down_proj_bias)."""
    tf = hm._transformers()
    cfg = tf.GptOssConfig(**{**hm._COMMON, "attn_implementation": "eager"}, head_dim=8, intermediate_size=16,
                          num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    model = tf.GptOssForCausalLM(cfg)
    assert {n for n, _ in model.model.layers[0].mlp.experts.named_parameters()} == {
        "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
    }  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"^model\.layers\.0\.mlp \(GptOssMLP\), model\.layers\.1\.mlp \(GptOssMLP\): mixture-of-experts blocks whose experts meshlib does not recognise"):
        _compile(model)


# -- Hugging Face checkpoints: each rank reads its own experts; export writes them back ------------------
def _load_train_export(path: str, out: str, mesh: str) -> dict:
    """On every rank: Mixtral from the checkpoint (one tensor per expert, as transformers saves it), noting
    the keys this rank reads; 2 AdamW steps; export; the trained parameters whole."""
    import re

    from meshlib_torch import export, parallelize
    from meshlib_torch.runtime.hub import SafetensorsWeights

    read, keys = SafetensorsWeights.read, []

    def noted(self, key, index, dtype):
        keys.append(key)
        return read(self, key, index, dtype)

    SafetensorsWeights.read = noted
    try:
        m = ml.Mesh.parse(mesh)
        with hm.fp64_kept():
            par = parallelize(hm.meta_mixtral(), mesh=m, rules=REPLICATED, example_inputs=hm.batch(0), loss="loss",
                              weights=path)  # fmt: skip
    finally:
        SafetensorsWeights.read = read
    opt = par.optimizer(lr=1e-3)
    with hm.fp64_kept():
        for step in range(2):
            par.train_step(hm.batch(step), opt)
    export(par, out, config=hm.mixtral_config())
    experts = sorted({int(e) for k in keys for e in re.findall(r"\.experts\.(\d+)\.", k)})
    whole = {n: par.whole(n).detach().clone() for n in par.named_model_parameters()}
    return {"coords": m.coords(torch.distributed.get_rank()), "experts read": experts, "params": whole}


@pytest.mark.ranks
def test_a_checkpoint_with_one_tensor_per_expert_loads_each_ranks_experts_and_exports_back(tmp_path):
    """transformers saves Mixtral's experts one tensor per expert and projection (`block_sparse_moe.experts.<e>.w1`,
    w3, w2); its conversion mapping stacks them into `mlp.experts.gate_up_proj` and `down_proj`. On dp=2×ep=2
    each rank reads the pieces of its own 4 experts only (ep coordinate c: experts 4c..4c+3), and trains as the
    unmodified model does from the same weights (fp64, 1e-12); `export` writes the trained model, which
    `from_pretrained` reads back equal."""
    path, out = str(tmp_path / "saved"), str(tmp_path / "exported")
    hm.build_mixtral().save_pretrained(path)
    mesh = "dp=2,ep=2"
    trial = Trial(hm.meta_mixtral, hm.batch, mesh=mesh, loss="loss", lr=1e-3, options={"weights": path})
    for rank in get_pool(4).run(hm.run_parallel_fp64, trial):
        assert_same(_reference("mixtral"), rank, rtol=1e-12, atol=1e-12)
    results = get_pool(4).run(_load_train_export, path, out, mesh)
    for got in results:
        c = got["coords"]["ep"]
        assert got["experts read"] == list(range(4 * c, 4 * c + 4)), got["coords"]
    reloaded = hm._transformers().MixtralForCausalLM.from_pretrained(out, dtype=torch.float64)
    trained = results[0]["params"]
    assert {n for n, _ in reloaded.named_parameters()} == set(trained)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
