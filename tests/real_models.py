"""Models nobody here wrote, built the way their users build them, for the parity tests.

- transformers' `GPT2LMHeadModel` (HF `Conv1D` projections, a fused qkv, tied
  embeddings, mask construction from positions, keyword inputs, `ModelOutput`);
- transformers' `LlamaForCausalLM` with grouped-query attention (fewer kv heads
  than heads, expanded before attention) and a rotary embedding under no_grad;
- a plain nanoGPT-style model written as such models usually are: it unpacks
  `B, T, C = x.size()`, asserts on the sequence length and returns `(logits, loss)`;
- transformers' Gemma, Phi-3 and OPT as their released configs set them up: a
  padding row in the embedding (Gemma's 0, Phi-3's inside the vocabulary, OPT's 1
  beside learned positions offset by 2), and Phi-3's fused `qkv_proj` of unequal
  parts under grouped-query attention, cut by slicing, and its `gate_up_proj`.

Each `build_*` makes the same model with the same (random) weights on every
call, from a small config with no download; `rules_*` are Megatron's column /
row split written against the model's own parameter names. Functions live at
module level so that rank pools can run them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import meshlib as ml

VOCAB, BATCH, SEQ = 96, 8, 16


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# -- transformers' GPT-2 -----------------------------------------------------------------------
def build_gpt2(dtype=torch.float32, vocab: int = VOCAB, **sizes) -> nn.Module:
    """transformers' GPT-2 at this file's small size, `sizes` (GPT2Config fields) on top; no dropout."""
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(**{
        "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, **sizes, "vocab_size": vocab,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0,
    })  # fmt: skip
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).to(dtype).train()


def rules_gpt2(mesh: ml.Mesh):
    """Conv1D keeps its weight as (in, out): column-parallel splits dim 1, row-parallel dim 0."""
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "transformer.wte.weight": ml.P(tp, None),  # vocab-parallel, tied to lm_head
            "**.attn.c_attn.weight": ml.P(None, tp),
            "**.attn.c_attn.bias": ml.P(tp),
            "**.attn.c_proj.weight": ml.P(tp, None),
            "**.mlp.c_fc.weight": ml.P(None, tp),
            "**.mlp.c_fc.bias": ml.P(tp),
            "**.mlp.c_proj.weight": ml.P(tp, None),
        },
        default=ml.P(),
    )


# -- transformers' Llama with grouped-query attention ------------------------------------------
def build_llama(dtype=torch.float32) -> nn.Module:
    tf = _quiet_transformers()
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(dtype).train()


def build_hf(family: str, dtype=torch.float32, layers: int = 2, **extra) -> nn.Module:
    """transformers' `<family>ForCausalLM` from `<family>Config` at this file's small size (4 query heads, 2
    key/value heads), `extra` config fields on top (sizes too); random weights, the same on every call."""
    tf = _quiet_transformers()
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    cfg = getattr(tf, f"{family}Config")(**{**sizes, "bos_token_id": 0, "eos_token_id": 0, **extra})
    torch.manual_seed(0)
    return getattr(tf, f"{family}ForCausalLM")(cfg).to(dtype).train()


def rules_llama(mesh: ml.Mesh):
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "model.embed_tokens.weight": ml.P(tp, None),
            "**.self_attn.[qkv]_proj.weight": ml.P(tp, None),
            "**.self_attn.o_proj.weight": ml.P(None, tp),
            "**.mlp.gate_proj.weight": ml.P(tp, None),
            "**.mlp.up_proj.weight": ml.P(tp, None),
            "**.mlp.down_proj.weight": ml.P(None, tp),
            "lm_head.weight": ml.P(tp, None),
        },
        default=ml.P(),
    )



# -- families whose released configs set a padding row and fuse projections of unequal parts ----
def rules_hf(mesh: ml.Mesh):
    """Megatron's split of Llama and Qwen2 (Qwen2's q, k, v biases split with their rows)."""
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "model.embed_tokens.weight": ml.P(tp, None), "**.self_attn.[qkv]_proj.weight": ml.P(tp, None),
            "**.self_attn.[qkv]_proj.bias": ml.P(tp), "**.self_attn.o_proj.weight": ml.P(None, tp),
            "**.mlp.gate_proj.weight": ml.P(tp, None), "**.mlp.up_proj.weight": ml.P(tp, None),
            "**.mlp.down_proj.weight": ml.P(None, tp), "lm_head.weight": ml.P(tp, None),
        },
        default=ml.P(),
    )  # fmt: skip


def build_gemma(dtype=torch.float32) -> nn.Module:
    """Gemma: an embedding with `padding_idx` 0 (as its released config), scaled, tied to the head."""
    tf = _quiet_transformers()
    cfg = tf.GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.GemmaForCausalLM(cfg).to(dtype).train()


PHI3_PAD = 88  # inside the vocabulary, as Phi-3's own 32000 of 32064: the last tp rank's row


def build_phi3(dtype=torch.float32) -> nn.Module:
    """Phi-3: a fused `qkv_proj` of unequal parts under grouped-query attention (q 32 rows, k and v 16
    each), cut by slicing; a fused `gate_up_proj` cut by `chunk`; a padding row inside the vocab."""
    tf = _quiet_transformers()
    cfg = tf.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PHI3_PAD, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.Phi3ForCausalLM(cfg).to(dtype).train()


def build_opt(dtype=torch.float32) -> nn.Module:
    """OPT: learned positions with an offset of 2, the token embedding's `padding_idx` 1, tied head."""
    tf = _quiet_transformers()
    cfg = tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.OPTForCausalLM(cfg).to(dtype).train()


def rules_gemma(mesh: ml.Mesh):
    return rules_llama(mesh)  # the same names: q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head


def rules_phi3(mesh: ml.Mesh):
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "model.embed_tokens.weight": ml.P(tp, None),
            "**.self_attn.qkv_proj.weight": ml.P(tp, None),
            "**.self_attn.o_proj.weight": ml.P(None, tp),
            "**.mlp.gate_up_proj.weight": ml.P(tp, None),
            "**.mlp.down_proj.weight": ml.P(None, tp),
            "lm_head.weight": ml.P(tp, None),
        },
        default=ml.P(),
    )


def rules_opt(mesh: ml.Mesh):
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "model.decoder.embed_tokens.weight": ml.P(tp, None),  # tied to lm_head
            "**.self_attn.[qkv]_proj.weight": ml.P(tp, None),
            "**.self_attn.[qkv]_proj.bias": ml.P(tp),
            "**.self_attn.out_proj.weight": ml.P(None, tp),
            "**.fc1.weight": ml.P(tp, None),
            "**.fc1.bias": ml.P(tp),
            "**.fc2.weight": ml.P(None, tp),
        },
        default=ml.P(),
    )

def hf_batch(step: int, vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ) -> dict:
    """Keyword inputs, as a Hugging Face training loop passes them."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _right_padded(step: int, pad: int) -> dict:
    """A right-padded batch: every row ends in 3 padding ids (in the labels too, as a loop that does not
    mask them passes them), so the padding row is looked up on every step."""
    batch = hf_batch(step)
    batch["input_ids"][:, -3:] = pad
    batch["labels"] = batch["input_ids"].clone()
    return batch


def gemma_batch(step: int) -> dict:
    return _right_padded(step, 0)


def phi3_batch(step: int) -> dict:
    return _right_padded(step, PHI3_PAD)


def opt_batch(step: int) -> dict:
    return _right_padded(step, 1)


ODD_VOCAB = 97  # GPT-2's own 50257 is odd too: no tensor-parallel size divides it


def build_gpt2_odd_vocab(dtype=torch.float32) -> nn.Module:
    return build_gpt2(dtype, vocab=ODD_VOCAB)


def odd_vocab_batch(step: int) -> dict:
    return hf_batch(step, vocab=ODD_VOCAB)


# -- a plain nanoGPT-style model ----------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = _Attention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, block_size: int = 32, n_layer: int = 2, n_head: int = 4, n_embd: int = 32):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build_nanogpt(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT().to(dtype)


def rules_nanogpt(mesh: ml.Mesh):
    tp = "tp" if "tp" in mesh else None
    return ml.pattern_rules(
        {
            "lm_head.weight": ml.P(tp, None),  # tied to wte: vocab-parallel
            "h.*.attn.c_attn.weight": ml.P(tp, None),
            "h.*.attn.c_attn.bias": ml.P(tp),
            "h.*.attn.c_proj.weight": ml.P(None, tp),
            "h.*.mlp.0.weight": ml.P(tp, None),
            "h.*.mlp.0.bias": ml.P(tp),
            "h.*.mlp.2.weight": ml.P(None, tp),
        },
        default=ml.P(),
    )


def nanogpt_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


MODELS = {
    "gpt2": (build_gpt2, rules_gpt2, hf_batch, "loss"),
    "llama": (build_llama, rules_llama, hf_batch, "loss"),
    "nanogpt": (build_nanogpt, rules_nanogpt, nanogpt_batch, 1),
    "gemma": (build_gemma, rules_gemma, gemma_batch, "loss"),
    "phi3": (build_phi3, rules_phi3, phi3_batch, "loss"),
    "opt": (build_opt, rules_opt, opt_batch, "loss"),
}


# -- a forward with a no_grad block and an autocast block -----------------------------------------
class Regions(nn.Module):
    """A statistic under `torch.no_grad()` (no gradient may flow through it) and a head under CPU
    bf16 autocast, as mixed-precision code writes them; `trace_with` picks fx or torch.export."""

    def __init__(self, trace_with: str = "fx"):
        super().__init__()
        self.trace_with = trace_with
        self.inp = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.out = nn.Linear(32, 8)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.trace_with == "export":
            assert x.shape[0] > 0  # fx cannot trace an assert on a tensor's value: export does it
        with torch.no_grad():
            stat = h.square().mean(-1, keepdim=True) + 0.05
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.out(h * self.scale / stat)
        return F.cross_entropy(logits.float(), y)


def build_regions_fx() -> nn.Module:
    torch.manual_seed(0)
    return Regions("fx")


def build_regions_export() -> nn.Module:
    torch.manual_seed(0)
    return Regions("export")


def regions_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(3000 + step)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 8, (8,), generator=gen)


def build_gpt2_dropout() -> nn.Module:
    """GPT-2 with its default dropout (0.1 on embeddings, attention and residuals)."""
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).train()


class UntraceableNanoGPT(NanoGPT):
    """The nanoGPT-style model branching on its input's data pointer: neither fx nor torch.export can
    trace it, so a pipeline cuts it by module FQN; it still returns `(logits, loss)`."""

    def forward(self, idx, targets=None):
        if idx.data_ptr() % 16:
            idx = idx.clone()
        return super().forward(idx, targets)


def build_untraceable_nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return UntraceableNanoGPT().double()


# -- a nanoGPT-style model with grouped-query attention and one fused qkv of unequal parts ------------
class _GQAttention(nn.Module):
    """q (4 heads), k and v (2 heads each) from one Linear with a bias, cut as its author wrote it: by
    slicing (`qkv[..., :q]`, as Phi-3) or by `split` into the three sizes."""

    def __init__(self, n_embd: int, n_head: int, n_kv: int, cut: str):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.cut = n_head, n_kv, n_embd // n_head, cut
        self.c_attn = nn.Linear(n_embd, (n_head + 2 * n_kv) * self.hd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        qkv, kv = self.c_attn(x), self.n_kv * self.hd
        if self.cut == "slice":
            q, k, v = qkv[..., :C], qkv[..., C : C + kv], qkv[..., C + kv :]
        else:
            q, k, v = qkv.split([C, kv, kv], dim=-1)
        q = q.view(B, T, self.n_head, self.hd).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv, self.hd).transpose(1, 2) for t in (k, v))
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GQANanoGPT(NanoGPT):
    """Without nanoGPT's assert on the length, so that torch.fx traces it (`qkv[..., :q]` is a getitem
    there, an `aten.slice` under torch.export)."""

    def __init__(self, cut: str = "slice", n_kv: int = 2):
        super().__init__()
        for block in self.h:
            block.attn = _GQAttention(32, 4, n_kv, cut)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_gqa_sliced() -> nn.Module:
    torch.manual_seed(0)
    return GQANanoGPT("slice").double()


def build_gqa_split() -> nn.Module:
    torch.manual_seed(0)
    return GQANanoGPT("split").double()


MODELS["gqa-sliced"] = (build_gqa_sliced, rules_nanogpt, nanogpt_batch, 1)
MODELS["gqa-split"] = (build_gqa_split, rules_nanogpt, nanogpt_batch, 1)
