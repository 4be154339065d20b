"""transformers' Llama and Qwen2, wrapped and not, built on the meta device and given `weights=`.

Method: each model is built from a small config with random weights (no download) and saved: the
transformers model with `save_pretrained`, a user's thin wrapper around it (a `forward(input_ids,
labels)` returning `.loss`) with safetensors' `save_model`. Every rank of a `RankPool` builds the same
model on the meta device and hands `parallelize` the saved weights. The rotary `inv_freq` buffers are not
persistent, so no checkpoint holds them: the transformers model's `_init_weights(rotary_emb)` re-makes
them, below the wrapper, which has no init code. Losses, first-step gradients and parameters after three
AdamW steps must equal the unmodified model's in one process (fp32, 1e-5): on dp=2 for all four, on tp=2
for the wrapped Qwen2, and on a pipeline (pp=2) cut by module name for a wrapper no tracer can follow.
"""

from __future__ import annotations

import functools

import pytest
import real_models as rm
import torch
from torch import nn

import meshlib as ml
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytest.importorskip("transformers")
pytestmark = pytest.mark.ranks


def _causal_lm(kind: str) -> nn.Module:
    tf = rm._quiet_transformers()
    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    config, model = classes[kind]
    cfg = config(
        vocab_size=rm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    return model(cfg)


class LossOnly(nn.Module):
    """A user's thin wrapper: the transformers model inside, the loss out."""

    def __init__(self, kind: str):
        super().__init__()
        self.lm = _causal_lm(kind)

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


class Untraceable(LossOnly):
    """The wrapper branching on its input's data pointer (as launchers of custom kernels do): neither fx nor
    torch.export can follow it, so a pipeline cuts it by module name."""

    def forward(self, input_ids, labels):
        if input_ids.data_ptr() % 16:
            input_ids = input_ids.clone()
        return super().forward(input_ids, labels)


WRAPPERS = {"bare": None, "wrapped": LossOnly, "untraceable": Untraceable}


def build(kind: str, wrapper: str) -> nn.Module:
    torch.manual_seed(0)
    model = _causal_lm(kind) if WRAPPERS[wrapper] is None else WRAPPERS[wrapper](kind)
    return model.train()


def meta_build(kind: str, wrapper: str) -> nn.Module:
    with torch.device("meta"):
        return build(kind, wrapper)


def rules(mesh: ml.Mesh):
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "**.embed_tokens.weight": ml.P(tp, None),
            "**.self_attn.[qkv]_proj.weight": ml.P(tp, None),
            "**.self_attn.[qkv]_proj.bias": ml.P(tp),
            "**.self_attn.o_proj.weight": ml.P(None, tp),
            "**.mlp.gate_proj.weight": ml.P(tp, None),
            "**.mlp.up_proj.weight": ml.P(tp, None),
            "**.mlp.down_proj.weight": ml.P(None, tp),
            "**.lm_head.weight": ml.P(tp, None),
        },
        default=ml.P(),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Where each model's weights are: a `save_pretrained` directory, or the wrapper's safetensors file."""
    from safetensors.torch import save_model

    out = {}
    for kind in ("llama", "qwen2"):
        for wrapper in WRAPPERS:
            path = tmp_path_factory.mktemp(f"{kind}-{wrapper}")
            if wrapper == "bare":
                build(kind, wrapper).save_pretrained(path)
                out[kind, wrapper] = str(path)
            else:
                save_model(build(kind, wrapper), str(path / "model.safetensors"))
                out[kind, wrapper] = str(path / "model.safetensors")
    return out


CASES = [
    ("llama", "bare", "dp=2", {}),
    ("llama", "wrapped", "dp=2", {}),
    ("qwen2", "bare", "dp=2", {}),
    ("qwen2", "wrapped", "dp=2", {}),
    ("qwen2", "wrapped", "tp=2", {}),
    ("llama", "untraceable", "pp=2", {"microbatches": 2}),
]


@pytest.mark.parametrize("kind, wrapper, mesh, options", CASES, ids=["-".join(c[:3]) for c in CASES])
def test_a_meta_model_with_weights_trains_as_the_unmodified_model(saved, kind, wrapper, mesh, options):
    loss = "loss" if wrapper == "bare" else None
    trial = Trial(functools.partial(meta_build, kind, wrapper), rm.hf_batch, mesh=mesh, rules=rules, loss=loss,
                  options={"weights": saved[kind, wrapper], **options})  # fmt: skip
    want = run_single(Trial(functools.partial(build, kind, wrapper), rm.hf_batch, loss=loss))
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)[0]
    assert_same(want, got, rtol=1e-5, atol=1e-5)
    assert dict(got.plan.notes)["trace"].startswith("failed") == (wrapper == "untraceable")  # the eager path
