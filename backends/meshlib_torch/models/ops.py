"""A small attention model written with the ops the bundled GPT and Llama do not use.

`chunk`, `permute`, `einsum`, `softmax`, `bmm`, `matmul` against a buffer and
`cat` all run on head-sharded tensors here, so the parity tests cover their
placement rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class OpsConfig:
    vocab_size: int = 256  # the bundled corpus is bytes
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 1
    max_seq_len: int = 64


class OpsModel(nn.Module):
    def __init__(self, cfg: OpsConfig):
        super().__init__()
        self.config = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.ln = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        hd = cfg.dim // cfg.n_heads
        self.register_buffer("mix", torch.empty(hd, hd), persistent=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B, T, C = x.shape
        H = self.config.n_heads
        D = C // H
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q = q.view(B, T, H, D).permute(0, 2, 1, 3)
        k = k.view(B, T, H, D).permute(0, 2, 1, 3)
        v = v.view(B, T, H, D).permute(2, 0, 1, 3)  # heads first, so they stay the major merged dim
        p = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5, dim=-1)
        o = torch.bmm(p.permute(1, 0, 2, 3).reshape(H * B, T, T), v.reshape(H * B, T, D))
        o = torch.matmul(o.reshape(H, B, T, D), self.mix)
        o = torch.cat([o[..., : D // 2], -o[..., D // 2 :]], dim=-1)
        x = x + self.proj(o.permute(1, 2, 0, 3).reshape(B, T, C))
        return F.cross_entropy(self.head(x).view(-1, self.config.vocab_size), targets.view(-1))

    def init_buffers(self) -> None:
        hd = self.config.dim // self.config.n_heads
        self.mix = torch.eye(hd, dtype=self.mix.dtype, device=self.mix.device) + 0.1

    @staticmethod
    def param_init(name: str, cfg: OpsConfig) -> tuple[str, float]:
        if name.endswith("bias"):
            return ("zeros", 0.0)
        if name.startswith("ln."):
            return ("ones", 0.0)
        return ("normal", 0.02)
