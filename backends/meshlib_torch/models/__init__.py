"""Bundled reference models: the main job's default and the test subjects.

`build(name)` makes one on the meta device by default: no memory is used
until the runtime fills each parameter in its shard.
"""

from __future__ import annotations

import torch

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig, MoETransformer, update_balancing_bias
from .ops import OpsConfig, OpsModel

CONFIGS = {
    "gpt-tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32),
    "gpt-small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=128),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "ops-tiny": OpsConfig(),
    "llama-tiny": LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=64),
    "llama-tiny-gqa": LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64),
    "llama-small": LlamaConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, hidden_dim=688, max_seq_len=256),
    "llama-1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=18, n_heads=16, hidden_dim=5632, max_seq_len=2048),
    "llama-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, hidden_dim=11008, max_seq_len=4096),
    "llama-70b": LlamaConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672, max_seq_len=4096
    ),
    # Llama 3.1 405B's shape (arXiv:2407.21783, table 3): for dry runs at scale
    "llama-405b": LlamaConfig(
        vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, hidden_dim=53248, max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "moe-tiny": MoEConfig(
        vocab_size=256, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=64, n_experts=8, top_k=2,
        moe_hidden_dim=16, router="softmax", aux_loss_coef=0.01,
    ),
    "moe-tiny-ds": MoEConfig(
        vocab_size=256, dim=32, n_layers=3, n_heads=4, hidden_dim=64, max_seq_len=64, n_experts=8, top_k=2,
        moe_hidden_dim=16, n_shared_experts=1, n_dense_layers=1, router="sigmoid", n_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, bias_update_rate=1e-3,
    ),
    # Mixtral 8x7B's shape (arXiv:2401.04088, table 1; mistralai/Mixtral-8x7B-v0.1 config.json): 46.7B parameters.
    # aux_loss_coef is config.json's router_aux_loss_coef (transformers' loss is top_k times this model's per layer)
    "mixtral-8x7b": MoEConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, max_seq_len=32768,
        rope_theta=1e6, n_experts=8, top_k=2, moe_hidden_dim=14336, router="softmax", aux_loss_coef=0.02,
    ),
    # DeepSeek-V3's shape (arXiv:2412.19437, sec. 4.2; deepseek-ai/DeepSeek-V3 config.json), 4K pre-training
    # context. Its multi-head latent attention is approximated by Llama's (128 heads of dim 56, no kv
    # compression), which has ~1.1B more parameters over 61 layers; the multi-token prediction module is left out
    "deepseek-v3": MoEConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, hidden_dim=18432, max_seq_len=4096, norm_eps=1e-6,
        n_experts=256, top_k=8, moe_hidden_dim=2048, n_shared_experts=1, n_dense_layers=3, router="sigmoid",
        n_groups=8, topk_groups=4, routed_scaling_factor=2.5, bias_update_rate=1e-3,
    ),
}


def model_class(cfg) -> type[torch.nn.Module]:
    return {GPTConfig: GPT, LlamaConfig: Llama, MoEConfig: MoETransformer, OpsConfig: OpsModel}[type(cfg)]


def config(name: str, **overrides):
    """The named config, with fields replaced (e.g. `n_layers=160`)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; bundled models: {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    return cfg


def max_seq_len(cfg) -> int:
    """The longest sequence a bundled model's config takes (GPT's learned positions, the others' rotary table)."""
    return getattr(cfg, "block_size", None) or cfg.max_seq_len


def build(name_or_cfg, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32, **overrides):
    """A bundled model, by name or config, on `device` (meta: shapes only)."""
    cfg = config(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else name_or_cfg
    with torch.device(device):
        model = model_class(cfg)(cfg)
    return model.to(dtype)


__all__ = [
    "CONFIGS", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MoE", "MoEConfig", "MoETransformer", "OpsConfig",
    "OpsModel", "build", "config", "max_seq_len", "model_class", "update_balancing_bias",
]  # fmt: skip


def default_rules(name_or_cfg, mesh):
    """Megatron-style tensor parallel specs for a bundled model, written as meshlib rules.

    Column-parallel projections split their output features, row-parallel ones
    their input features, embeddings and the output head split the vocabulary
    (so the loss is computed vocab-parallel), norms are replicated. On a mesh
    without a `tp` axis every spec is replicated.
    """
    import meshlib as ml

    cfg = config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    tp = "tp" if "tp" in mesh else None
    logical = ml.logical_rules({"vocab": tp, "heads": tp, "mlp": tp, "embed": None, "pos": None})
    if isinstance(cfg, OpsConfig):
        table = {
            "emb.weight": "vocab embed",
            "qkv.weight": "heads embed",
            "qkv.bias": "heads",
            "proj.weight": "embed heads",
            "head.weight": "vocab embed",
        }
    elif isinstance(cfg, GPTConfig):
        table = {
            "wte.weight": "vocab embed",
            "wpe.weight": "pos embed",
            "h.*.attn.c_attn.weight": "heads embed",
            "h.*.attn.c_attn.bias": "heads",
            "h.*.attn.c_proj.weight": "embed heads",
            "h.*.mlp.c_fc.weight": "mlp embed",
            "h.*.mlp.c_fc.bias": "mlp",
            "h.*.mlp.c_proj.weight": "embed mlp",
        }
    else:  # Llama; MoE models add their shared experts (routers and 3-D expert weights: replicated for now)
        table = {
            "tok_embeddings.weight": "vocab embed",
            "layers.*.attention.w[qkv].weight": "heads embed",
            "layers.*.attention.wo.weight": "embed heads",
            "layers.*.feed_forward.w[13].weight": "mlp embed",
            "layers.*.feed_forward.w2.weight": "embed mlp",
            "output.weight": "vocab embed",
        }
        if isinstance(cfg, MoEConfig):
            table["layers.*.moe.shared_experts.w[13].weight"] = "mlp embed"
            table["layers.*.moe.shared_experts.w2.weight"] = "embed mlp"
    return ml.pattern_rules(table, logical=logical, default=ml.P())


__all__ += ["default_rules"]
