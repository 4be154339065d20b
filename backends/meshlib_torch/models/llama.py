"""A Llama-style model: separate q/k/v, RMSNorm, SwiGLU, rotary embeddings, optional GQA.

Written so that torch.fx's symbolic tracer follows it (shapes are read with
`x.shape[i]`, never unpacked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    hidden_dim: int = 64
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary tables (cos, sin), (max_seq_len, head_dim), computed in fp64."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.blocks(cfg))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    @staticmethod
    def blocks(cfg: LlamaConfig) -> list[nn.Module]:
        return [TransformerBlock(cfg) for _ in range(cfg.n_layers)]

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        h, extra = self.run_layers(self.tok_embeddings(tokens), self.rope_cos[:t], self.rope_sin[:t])
        logits = self.output(self.norm(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss if extra is None else loss + extra

    def run_layers(self, h, cos, sin):
        """The residual stream through the layers, and a term the loss adds (None: none)."""
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h, None

    def init_buffers(self) -> None:
        """Fill the rotary tables (they are computed, not learned or saved)."""
        cos, sin = rope_tables(self.config)
        self.rope_cos = cos.to(self.rope_cos.dtype, copy=True).to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.dtype, copy=True).to(self.rope_sin.device)

    @staticmethod
    def param_init(name: str, cfg: LlamaConfig) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return ("ones", 0.0)
        if name.endswith(("wo.weight", "w2.weight")):
            return ("normal", 0.02 / math.sqrt(2 * cfg.n_layers))
        return ("normal", 0.02)
