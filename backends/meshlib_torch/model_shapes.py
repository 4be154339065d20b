"""The closed-form shape (`meshlib.transformer.ModelShape`) of a torch model, for the planner's search.

Three readers, tried in order by `model_shape`:

1. a bundled model's config (`models.GPTConfig`, `LlamaConfig`, `MoEConfig`);
2. a transformers model's `config` (Llama, Mistral, Qwen2, GPT-2, Mixtral, DeepSeek-V3 field names);
3. the module itself (`module_shape`), for a user's own decoder: its repeated blocks, its token embedding,
   the linear layers of one block, an attribute naming the attention heads, its norms.

Whichever reads it, a module's norms are run once on a bfloat16 input (meta tensors, no data) to read
whether they compute in fp32 (`ModelShape.norm_fp32`: transformers' RMSNorm upcasts its input and keeps
that copy for backward, which the closed form's activations count).

Whatever reads the shape, the shape's exact parameter count must equal the module's own (tied weights
once), or the reading is refused with both counts and the fix: a shape the planner would price wrongly is
never used quietly.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from meshlib.transformer import ModelShape

from . import models

__all__ = ["model_shape", "module_shape"]

# attributes a model's attention (or its block, or the model) names its head counts by
HEADS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "nhead", "heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "kv_heads")
FIX = ("give the model a transformers-style `config` (hidden_size, num_hidden_layers, num_attention_heads, "
       "num_key_value_heads, intermediate_size, vocab_size), or plan it by hand with meshlib plan --mesh ... "
       "--profile ...")  # fmt: skip


def model_shape(model) -> ModelShape:
    """The shape of a bundled model (its config), of a transformers model (`model.config`), or read off the
    module (`module_shape`); else a ValueError naming what the planner reads and why it failed."""
    cfg = model if not isinstance(model, nn.Module) else getattr(model, "cfg", None) or getattr(model, "config", None)
    shape = _config_shape(cfg)
    if shape is None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"the planner reads a model's shape from a torch module or a config; got {type(model)}")
        shape = module_shape(model)
    elif isinstance(model, nn.Module):
        _same_count(shape, model, "its config")
    return dataclasses.replace(shape, norm_fp32=norm_fp32(model)) if isinstance(model, nn.Module) else shape


class _Upcasts(TorchFunctionMode):
    """Records whether any torch function returns a float32 tensor."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen |= isinstance(out, torch.Tensor) and out.dtype == torch.float32
        return out


def norm_fp32(model: nn.Module) -> bool:
    """Whether the first repeated block's first norm (a leaf module holding only a weight, and a bias, of the
    hidden width) computes in fp32 when its input and weights are bfloat16: run once on meta tensors. False
    where the model has no such norm, or it does not run on meta tensors."""
    blocks = _blocks(model)
    norms = [m for m in (blocks[0].modules() if blocks is not None else ()) if _is_norm(m)]
    if not norms:
        return False
    norm = norms[0]
    width = norm.weight.shape[0]
    params = {n: torch.empty(p.shape, dtype=torch.bfloat16, device="meta") for n, p in norm.named_parameters()}
    probe = _Upcasts()
    try:
        with probe:
            functional_call(norm, params, (torch.empty(1, 2, width, dtype=torch.bfloat16, device="meta"),))
    except Exception:  # noqa: BLE001 - a norm that cannot run on meta tensors is read as computing in bf16
        return False
    return probe.seen


def _is_norm(m: nn.Module) -> bool:
    names = {n for n, _ in m.named_parameters(recurse=False)}
    weight = getattr(m, "weight", None)
    return (not list(m.children()) and names <= {"weight", "bias"} and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and not isinstance(m, (nn.Linear, nn.Embedding)))  # fmt: skip


def _config_shape(cfg) -> ModelShape | None:
    if isinstance(cfg, models.GPTConfig):
        return ModelShape(layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, ffn=4 * cfg.n_embd,
                          vocab=cfg.vocab_size, tied=True, bias=cfg.bias, positions=cfg.block_size)  # fmt: skip
    if isinstance(cfg, models.MoEConfig):
        return ModelShape(
            layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, kv_heads=cfg.kv_heads, ffn=cfg.hidden_dim,
            vocab=cfg.vocab_size, gated=True, norm="rmsnorm", experts=cfg.n_experts, top_k=cfg.top_k,
            moe_ffn=cfg.moe_hidden_dim, shared_experts=cfg.n_shared_experts, dense_layers=cfg.n_dense_layers,
        )  # fmt: skip
    if isinstance(cfg, models.LlamaConfig):
        return ModelShape(layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, kv_heads=cfg.kv_heads,
                          ffn=cfg.hidden_dim, vocab=cfg.vocab_size, gated=True, norm="rmsnorm")  # fmt: skip
    if cfg is not None and (hasattr(cfg, "num_hidden_layers") or hasattr(cfg, "n_layer")):
        return _hf_shape(cfg)
    return None


def _hf_shape(cfg) -> ModelShape:
    """transformers' config names: Llama, Mistral, Qwen2 (gated, RMSNorm; Qwen2's q/k/v biases), GPT-2 (n_embd,
    n_layer), Mixtral and DeepSeek-V3 (experts)."""
    get = lambda *names, default=0: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), default)  # noqa: E731
    gpt2 = hasattr(cfg, "n_embd")
    hidden = get("hidden_size", "n_embd")
    experts = get("num_local_experts", "n_routed_experts", "num_experts")
    qkv_bias = getattr(cfg, "model_type", "") == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    return ModelShape(
        layers=get("num_hidden_layers", "n_layer"), hidden=hidden, heads=get("num_attention_heads", "n_head"),
        kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
        ffn=get("intermediate_size", "n_inner", default=4 * hidden), vocab=get("vocab_size"), gated=not gpt2,
        norm="layernorm" if gpt2 else "rmsnorm", bias=gpt2, qkv_bias=qkv_bias and not gpt2,
        positions=get("n_positions") if gpt2 else 0, tied=bool(getattr(cfg, "tie_word_embeddings", gpt2)),
        experts=experts, top_k=get("num_experts_per_tok") if experts else 0,
        moe_ffn=get("moe_intermediate_size") if experts else 0,
        shared_experts=get("n_shared_experts") if experts else 0,
        dense_layers=get("first_k_dense_replace") if experts else 0,
    )  # fmt: skip


# -- read off the module -------------------------------------------------------------------------------
def module_shape(model: nn.Module) -> ModelShape:
    """The shape of a dense decoder read off its modules:

    - `layers`: the longest `nn.ModuleList` (or `nn.Sequential`) of blocks of one class;
    - `vocab`, `hidden`: the largest `nn.Embedding` outside the blocks; another one of the same width is
      learned positions; `tied`: no output `nn.Linear` of `vocab` features, or one sharing the embedding;
    - in the first block: `ffn`, the widest input of a linear layer back to `hidden`; `gated`, when the
      layers into that width hold two matrices' worth; `bias`, any linear bias; `norm`, a `LayerNorm`
      (else RMSNorm);
    - `heads`, `kv_heads`: an attribute of the block or below (`HEADS`, `KV_HEADS`), or
      `nn.MultiheadAttention`'s `num_heads`.

    The shape's parameter count must be the module's: else a ValueError naming both and the fix."""
    blocks = _blocks(model)
    if blocks is None:
        raise ValueError(f"the planner could not read {type(model).__name__}'s shape: it has no `config` and no "
                         f"nn.ModuleList of repeated blocks. Fix: {FIX}")  # fmt: skip
    inside = {id(m) for b in blocks for m in b.modules()}
    embeds = sorted((m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside),
                    key=lambda e: e.num_embeddings, reverse=True)  # fmt: skip
    if not embeds:
        raise ValueError(f"the planner could not read {type(model).__name__}'s shape: no nn.Embedding outside its "
                         f"blocks (the token embedding). Fix: {FIX}")  # fmt: skip
    token = embeds[0]
    vocab, hidden = token.num_embeddings, token.embedding_dim
    positions = next((e.num_embeddings for e in embeds[1:] if e.embedding_dim == hidden), 0)
    heads_out = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside
                 and m.out_features == vocab]  # fmt: skip
    tied = not heads_out or heads_out[0].weight is token.weight
    block = blocks[0]
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    back = [m.in_features for m in linears if m.out_features == hidden]
    ffn = max(back, default=0)
    into = sum(m.out_features for m in linears if m.in_features == hidden and m.out_features in (ffn, 2 * ffn))
    heads, kv = _heads(block, model)
    if not heads or not ffn:
        what = ("attribute naming its attention heads (" + ", ".join(HEADS) + ")" if not heads
                else f"MLP (a linear layer from a wider input back to the hidden width {hidden})")  # fmt: skip
        raise ValueError(f"the planner could not read {type(model).__name__}'s shape: its block "
                         f"{type(block).__name__}: found no {what}. Fix: {FIX}")  # fmt: skip
    shape = ModelShape(
        layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, gated=into >= 2 * ffn,
        bias=any(m.bias is not None for m in linears), positions=positions, tied=tied,
        norm="layernorm" if any(isinstance(m, nn.LayerNorm) for m in block.modules()) else "rmsnorm",
    )  # fmt: skip
    _same_count(shape, model, "its modules")
    return shape


def _blocks(model: nn.Module):
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0
             and len({type(b) for b in m}) == 1]  # fmt: skip
    return max(lists, key=len, default=None)


def _heads(block: nn.Module, model: nn.Module) -> tuple[int, int]:
    """(heads, kv heads; 0 where not found) named by an attribute of the block, its submodules or the model."""
    heads = kv = 0
    for m in (*block.modules(), model):
        if isinstance(m, nn.MultiheadAttention):
            heads = heads or m.num_heads
        for name in HEADS:
            value = getattr(m, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                heads = heads or value
        for name in KV_HEADS:
            value = getattr(m, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                kv = kv or value
    return heads, kv


def _same_count(shape: ModelShape, model: nn.Module, read: str) -> None:
    own = sum({id(p): p.numel() for p in model.parameters()}.values())  # tied weights once
    if shape.params() != own:
        raise ValueError(
            f"the planner read {type(model).__name__}'s shape from {read} as {shape}, which has "
            f"{shape.params():,} parameters; the module has {own:,}. The planner would price another model. "
            f"Fix: {FIX}"
        )
