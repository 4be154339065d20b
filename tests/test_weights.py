"""Weights in and out: Hugging Face checkpoints read into shards, exported back, DCP checkpoints as weights.

Method: transformers' GPT-2 and Llama (GQA) are built from small configs with random weights and
saved with `save_pretrained` (safetensors, split into several files with the index) into a
temporary directory. Every rank of a `RankPool` builds the same model on the meta device and
hands `parallelize` the directory (`weights=`): its first batch's loss and logits must equal the
unmodified model's, and three AdamW steps must match the single-process run (fp32, 1e-5). The
peak of tensor bytes while a rank builds is measured with `PeakTracker` and must stay within its
own shards plus one tensor. An export after training is read back by `from_pretrained` and
gives meshlib's loss, with every tensor equal to the trained shards gathered. Checkpoints that do
not fit raise one error, on every rank, naming what is wrong.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re

import pytest
import real_models as rm
import torch

import meshlib as ml
from meshlib_torch import PeakTracker, checkpoint, compile_model, export, parallelize
from meshlib_torch.testing.pool import RankError, get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytest.importorskip("transformers")
pytestmark = pytest.mark.ranks


def meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return rm.MODELS[name][0]()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each model saved as Hugging Face does it, in several safetensors files with the index."""
    out = {}
    for name in ("gpt2", "llama"):
        path = tmp_path_factory.mktemp(name)
        rm.MODELS[name][0]().save_pretrained(path, max_shard_size="20KB")
        out[name] = str(path)
    return out


def _logits(name: str, mesh: str, path: str, options: dict) -> torch.Tensor:
    """On every rank: the first batch's logits from the checkpoint, through meshlib (`loss=` picks them)."""
    m = ml.Mesh.parse(mesh)
    par = parallelize(meta_model(name), mesh=m, rules=rm.MODELS[name][1](m), example_inputs=rm.hf_batch(0),
                      weights=path, loss="logits", **options)  # fmt: skip
    return par(**rm.hf_batch(0)).detach()


CASES = [("dp=2,tp=2", {}), ("tp=2", {"sequence_parallel": True}), ("pp=2", {"microbatches": 2}), ("dp=2", {"zero": 3}),
         ("tp=3", {"uneven": "chunk"})]  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh, options", CASES, ids=["dp2tp2", "tp2-sp", "pp2", "dp2-zero3", "tp3-chunk"])
def test_a_hugging_face_checkpoint_loads_into_shards(saved, name, mesh, options):
    assert len([f for f in os.listdir(saved[name]) if f.endswith(".safetensors")]) > 1  # sharded, with the index
    build, rules, batch, loss = rm.MODELS[name]
    size = ml.Mesh.parse(mesh).size
    if "pp" not in mesh:  # a pipeline's last stage returns the loss alone: its logits are checked through it
        with torch.no_grad():
            want = build()(**batch(0)).logits
        got = get_pool(size).run(_logits, name, mesh, saved[name], options)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    trial = Trial(functools.partial(meta_model, name), batch, mesh=mesh, rules=rules, loss=loss,
                  options={"weights": saved[name], **options})  # fmt: skip
    assert_same(run_single(Trial(build, batch, loss=loss)), get_pool(size).run(run_parallel, trial)[0], rtol=1e-5, atol=1e-5)


def _load_peak(path: str) -> tuple[int, int, int, int]:
    """On every rank: the peak of tensor bytes while it builds from the checkpoint (compiled beforehand),
    its own shards' bytes, the largest tensor's, and the whole model's."""
    m = ml.Mesh(dp=2, tp=2)
    model, rules = meta_model("llama"), rm.rules_llama(m)
    compiled = compile_model(model, mesh=m, rules=rules, example_inputs=rm.hf_batch(0))
    shards = sum(math.prod(compiled.local_param_shape(n)) * 4 for n in compiled.traced.params)
    largest = max(math.prod(p.shape) * 4 for p in compiled.traced.params.values())
    whole = sum(math.prod(p.shape) * 4 for p in compiled.traced.params.values())
    batch = rm.hf_batch(0)
    with PeakTracker(device="cpu") as tracker:
        parallelize(model, mesh=m, rules=rules, example_inputs=batch, weights=path, compiled=compiled)
    return tracker.peak, shards, largest, whole


BOOKKEEPING = 2048  # bytes: the index lists of the rows and columns read, the mesh's rank table, the rotary buffers


def test_loading_holds_the_own_shards_and_one_tensor_at_most(saved):
    for peak, shards, largest, whole in get_pool(4).run(_load_peak, saved["llama"]):
        assert shards < peak <= shards + largest + BOOKKEEPING < whole, (peak, shards, largest, whole)


def _train_and_export(path: str, out: str, mesh: str, options: dict) -> tuple[float, dict]:
    m = ml.Mesh.parse(mesh)
    par = parallelize(meta_model("gpt2"), mesh=m, rules=rm.rules_gpt2(m), example_inputs=rm.hf_batch(0), weights=path,
                      **options)  # fmt: skip
    opt = par.optimizer(lr=1e-3)
    for step in range(2):
        par.train_step(rm.hf_batch(step), opt)
    export(par, out, config=rm.build_gpt2().config, max_shard_size=60_000)
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_model_parameters().items()}
    return par.evaluate(rm.hf_batch(5)), whole


@pytest.mark.parametrize("mesh, options", CASES[:1] + CASES[2:], ids=["dp2tp2", "pp2", "dp2-zero3", "tp3-chunk"])
def test_export_reloads_with_from_pretrained(saved, tmp_path, mesh, options):
    out = str(tmp_path / "exported")
    results = get_pool(ml.Mesh.parse(mesh).size).run(_train_and_export, saved["gpt2"], out, mesh, options)
    loss = [r[0] for r in results if r[0] is not None][-1]  # a pipeline's loss is on its last stage
    trained = {n: t for r in results for n, t in r[1].items()}  # every stage's parameters
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(trained)  # the tied lm_head once, as save_pretrained does
    tf = rm._quiet_transformers()
    reloaded = tf.GPT2LMHeadModel.from_pretrained(out)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
    with torch.no_grad():
        theirs = float(reloaded(**rm.hf_batch(5)).loss)
    assert theirs == pytest.approx(loss, rel=1e-5, abs=1e-5)


def _save_dcp(path: str, out: str) -> float:
    m = ml.Mesh(dp=2, tp=2)
    par = parallelize(meta_model("llama"), mesh=m, rules=rm.rules_llama(m), example_inputs=rm.hf_batch(0), weights=path)
    opt = par.optimizer(lr=1e-3)
    par.train_step(rm.hf_batch(0), opt)
    checkpoint.save(out, par, opt, step=1)
    return par.evaluate(rm.hf_batch(3))


def _from_dcp(out: str) -> float:
    m = ml.Mesh(dp=2, pp=2)
    par = parallelize(meta_model("llama"), mesh=m, rules=rm.rules_llama(m), example_inputs=rm.hf_batch(0), weights=out,
                      microbatches=2)  # fmt: skip
    return par.evaluate(rm.hf_batch(3))


def test_a_dcp_checkpoint_serves_as_weights_on_another_mesh(saved, tmp_path):
    out = str(tmp_path / "dcp")
    before = get_pool(4).run(_save_dcp, saved["llama"], out)[0]
    after = get_pool(4).run(_from_dcp, out)[0]
    assert after == pytest.approx(before, rel=1e-6, abs=1e-6)


def _save_gpt2_dcp(out: str) -> float:
    m = ml.Mesh(dp=2)
    par = parallelize(rm.build_gpt2(), mesh=m, rules=rm.rules_gpt2(m), example_inputs=rm.hf_batch(0))
    opt = par.optimizer(lr=1e-3)
    par.train_step(rm.hf_batch(0), opt)
    checkpoint.save(out, par, opt, step=1)
    return par.evaluate(rm.hf_batch(3))


def _gpt2_from_dcp(out: str) -> float:
    m = ml.Mesh(tp=2)
    par = parallelize(meta_model("gpt2"), mesh=m, rules=rm.rules_gpt2(m), example_inputs=rm.hf_batch(0), weights=out)
    return par.evaluate(rm.hf_batch(3))


def test_a_dcp_checkpoint_loads_into_a_fused_projection_split_in_groups(tmp_path):
    """GPT-2's c_attn split in 3 groups over tp (DTensor's strided shard) reads its rows from a DCP checkpoint
    saved whole: DCP's own reading of a strided shard took other rows (the loss moved by 8e-4)."""
    out = str(tmp_path / "dcp")
    before = get_pool(2).run(_save_gpt2_dcp, out)[0]
    assert get_pool(2).run(_gpt2_from_dcp, out)[0] == pytest.approx(before, rel=1e-6, abs=1e-6)


def _bad(path: str) -> None:
    m = ml.Mesh(dp=2)
    parallelize(meta_model("gpt2"), mesh=m, rules=rm.rules_gpt2(m), example_inputs=rm.hf_batch(0), weights=path)


def test_weights_that_do_not_fit_fail_on_every_rank_naming_them(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(os.listdir(saved["gpt2"])):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(saved["gpt2"], f)))
    tensors.pop("transformer.h.1.mlp.c_fc.bias")
    tensors["transformer.h.0.attn.c_proj.weight"] = torch.zeros(3, 3)
    tensors["transformer.extra.weight"] = torch.zeros(2)
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 4, 4)  # old GPT-2 files' mask: transformers ignores it
    bad = str(tmp_path / "bad.safetensors")
    save_file(tensors, bad)
    with pytest.raises(RankError) as err:
        get_pool(2).run(_bad, bad)
    assert sorted(err.value.failures) == [0, 1]
    want = (r"do not fit this model: missing transformer\.h\.1\.mlp\.c_fc\.bias; unexpected transformer\.extra\.weight; "
            r"mis-shaped transformer\.h\.0\.attn\.c_proj\.weight is \(3, 3\), the model's transformer\.h\.0\.attn\.c_proj\.weight \(32, 32\)")  # fmt: skip
    assert all(re.search(want, why) for why in err.value.failures.values()), err.value.failures
    with pytest.raises(RankError, match=r"weights='/nowhere': no such file or directory"):
        get_pool(2).run(_bad, "/nowhere")
