"""transformers' mixture-of-experts models, unmodified, as test subjects for expert parallelism.

- `MixtralForCausalLM`: a softmax router over 8 experts, top-2, renormalised by an in-place `/=`;
  optionally its load-balancing loss (`output_router_logits=True`) added to the loss;
- `DeepseekV3ForCausalLM`: MLA attention, a first dense layer, a sigmoid router with a correction
  bias, a group limit (`topk(sorted=False)`, `scatter_` into zeros, `masked_fill` by a bool mask),
  normalised top-k weights scaled by 2.5, and a shared expert;
- Qwen2-MoE (a gated shared expert), Qwen3-MoE (q/k norms) and OLMoE: softmax routers taken in fp32
  (`softmax(dtype=torch.float)`), their experts stored as Mixtral's.

Each `build_*` makes the same fp64 model, with the same random weights (all but the norms drawn
from N(0, 0.05), DeepSeek's correction bias from N(0, 0.1), so that routing is neither uniform nor
tied), from a tiny config and no download; its experts run transformers' "eager" loop and its
attention `sdpa` (fp64 throughout: eager attention takes its softmax in fp32). transformers casts
routers, norms and the loss's logits to fp32; `fp64_kept` leaves an fp64 tensor as it is there, and
`run_single_fp64` / `run_parallel_fp64` run the reference and the ranks under it, so both are fp64
throughout. Functions live at module level so that rank pools can run them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch import nn

from meshlib_torch.testing.reference import Trial, run_parallel, run_single

VOCAB, BATCH, SEQ = 256, 4, 8
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, pad_token_id=None, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    attn_implementation="sdpa", experts_implementation="eager",
)  # fmt: skip


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _randomised(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.double().train()


def mixtral_config(**overrides):
    tf = _transformers()
    options = dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)
    return tf.MixtralConfig(**{**_COMMON, **options, **overrides})


def build_mixtral() -> nn.Module:
    torch.manual_seed(0)
    return _randomised(_transformers().MixtralForCausalLM(mixtral_config()))


def build_mixtral_aux() -> nn.Module:
    """Mixtral with its load-balancing loss (coefficient 0.02) added to the loss."""
    torch.manual_seed(0)
    cfg = mixtral_config(output_router_logits=True, router_aux_loss_coef=0.02)
    return _randomised(_transformers().MixtralForCausalLM(cfg))


def build_deepseek() -> nn.Module:
    tf = _transformers()
    cfg = tf.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    return _randomised(tf.DeepseekV3ForCausalLM(cfg))


def build_deepseek_fp32() -> nn.Module:
    """DeepSeek-V3 as above, in fp32: its casts to fp32 as they are, nothing patched."""
    return build_deepseek().float()


def build_qwen2_moe() -> nn.Module:
    tf = _transformers()
    cfg = tf.Qwen2MoeConfig(
        **_COMMON, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return _randomised(tf.Qwen2MoeForCausalLM(cfg))


def build_qwen3_moe() -> nn.Module:
    tf = _transformers()
    cfg = tf.Qwen3MoeConfig(
        **_COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return _randomised(tf.Qwen3MoeForCausalLM(cfg))


def build_olmoe() -> nn.Module:
    tf = _transformers()
    cfg = tf.OlmoeConfig(**_COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return _randomised(tf.OlmoeForCausalLM(cfg))


def batch(step: int) -> dict:
    """Keyword inputs, as a Hugging Face training loop passes them."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


@contextmanager
def fp64_kept():
    """While it is open, `.float()`, `.to(...)` and `.type(...)` give an fp64 tensor back as it is where
    they would make it fp32 (transformers computes routers, norms, rotary angles and the loss in fp32)."""

    def keeping(method):
        def kept(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            downcast = isinstance(out, torch.Tensor) and out.dtype == torch.float32 and self.dtype == torch.float64
            return self if downcast else out

        return kept

    with ExitStack() as stack:
        for name in ("float", "to", "type"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, keeping(getattr(torch.Tensor, name))))
        yield


def run_single_fp64(trial: Trial):
    with fp64_kept():
        return run_single(trial)


def run_parallel_fp64(trial: Trial):
    """`run_parallel` on every rank, its tracing and its steps under `fp64_kept`."""
    with fp64_kept():
        return run_parallel(trial)


def meta_mixtral() -> nn.Module:
    """`build_mixtral`'s model (fp64, training mode) on the meta device, for `weights=`."""
    with torch.device("meta"):
        return _transformers().MixtralForCausalLM(mixtral_config()).double().train()
