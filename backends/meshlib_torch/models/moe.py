"""A Llama-family mixture-of-experts model (Mixtral, DeepSeek-V3's routing), in one process.

Attention, norms, dense feed-forwards and the rotary tables are Llama's (`llama.py`). The first
`n_dense_layers` layers are Llama's `TransformerBlock`; every later one is a `MoEBlock`, whose
feed-forward `moe` (a `MoE`) has the submodules and parameter names of transformers 5's Mixtral and
DeepSeek-V3 blocks:

- `moe.gate`, a `TopKRouter`: `weight` (E, dim); for the sigmoid router the persistent buffer
  `e_score_correction_bias` (E,); `tokens_per_expert` (E,), not persistent, counts routed (token, slot)
  pairs in every forward, for `update_balancing_bias`.
- `moe.experts`, an `Experts`: `gate_up_proj` (E, 2 * moe_hidden_dim, dim), `down_proj` (E, dim, moe_hidden_dim).
- `moe.shared_experts`: a Llama `FeedForward` of width moe_hidden_dim * n_shared_experts (absent when 0).

The model's forward returns the loss: cross entropy, plus `aux_loss_coef` times the sum over MoE layers
of `load_balancing_loss` when that is above 0. Written for torch.fx's symbolic tracer: shapes are read
with `x.shape[i]`, no Python branch reads a tensor's values or dtype, every shape is static (the experts
run densely, see `Experts`). The one side effect is the routers' in-place count (`tokens_per_expert.add_`,
under `torch.no_grad()`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .llama import Attention, FeedForward, Llama, RMSNorm, TransformerBlock
from .moe_config import MoEConfig


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32, or as it is when wider (fp64): an add of an fp32 zero, whose dtype type promotion
    picks, since a branch on `x.dtype` is no branch torch.fx can trace (the dtype is a proxy there)."""
    return x + x.new_zeros(1, dtype=torch.float32)


def _expert_counts(top_k_index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """How many (token, slot) pairs chose each expert: (E,), the dtype and device of `like` (E,)."""
    experts = torch.arange(like.shape[0], device=like.device)
    return (top_k_index.unsqueeze(-1) == experts).to(like.dtype).sum(dim=(0, 1))  # a sum over tokens: splits


class TopKRouter(nn.Module):
    """`moe.gate`: (T, dim) -> (logits (T, E), top_k_weights (T, k), top_k_index (T, k)).

    softmax (Mixtral): probabilities over all experts, the top k. sigmoid (DeepSeek-V3): scores
    sigmoid(logits); experts chosen by scores + `e_score_correction_bias`, among the `topk_groups`
    groups with the best sums of their two best choice scores; weighted by the scores (no bias).
    Then the k weights are renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`).
    Computed in fp32 at least (fp64 stays fp64), as transformers computes its routers in fp32.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.kind, self.n_experts, self.top_k = cfg.router, cfg.n_experts, cfg.top_k
        self.n_groups, self.topk_groups = cfg.n_groups, cfg.topk_groups
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.bias_update_rate = cfg.bias_update_rate
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        nn.init.normal_(self.weight, std=0.02)
        if cfg.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts, dtype=torch.float32), persistent=False)

    def forward(self, x):
        logits = F.linear(_at_least_fp32(x), _at_least_fp32(self.weight))
        scores = self.scores(logits)
        choice = scores + self.e_score_correction_bias if self.kind == "sigmoid" else scores
        top_k_index = torch.topk(self._in_best_groups(choice), self.top_k, dim=-1)[1]
        top_k_weights = scores.gather(1, top_k_index)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            top_k_weights = top_k_weights * self.routed_scaling_factor
        with torch.no_grad():
            self.tokens_per_expert.add_(_expert_counts(top_k_index, self.tokens_per_expert))
        return logits, top_k_weights, top_k_index

    def scores(self, logits):
        """Each token's expert scores: softmax probabilities, or sigmoids."""
        return logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()

    def probs(self, logits):
        """Each token's distribution over experts, for the load-balancing loss: the scores, normalised."""
        scores = self.scores(logits)
        return scores if self.kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)

    def _in_best_groups(self, choice):
        """`choice` with -inf for the experts outside each token's `topk_groups` best groups."""
        if self.n_groups == 1:
            return choice
        groups = choice.unflatten(-1, (self.n_groups, self.n_experts // self.n_groups))
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best = group_scores.topk(self.topk_groups, dim=-1)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        return groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)

    def init_buffers(self) -> None:
        """Zero the balancing bias and the counts (in place: on the meta device, nothing happens)."""
        if self.kind == "sigmoid":
            self.e_score_correction_bias.zero_()
        self.tokens_per_expert.zero_()


class Experts(nn.Module):
    """`moe.experts`: (hidden (T, dim), top_k_index (T, k), top_k_weights (T, k)) -> (T, dim), each token's
    sum over its slots j of w_j * down_e(silu(gate_e(x)) * up_e(x)), gate and up the halves of
    x @ gate_up_proj[e].T (transformers' layout).

    Dense: every expert runs on every token, weighted by 0 where it was not chosen (E / k times the routed
    FLOPs). Exact, static in shape, with a zero gradient for an expert no token chose; the reference
    the expert-parallel dispatch replaces.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, hidden, top_k_index, top_k_weights):
        combine = top_k_weights.new_zeros(hidden.shape[0], self.n_experts).scatter_add(1, top_k_index, top_k_weights)
        gate, up = torch.matmul(hidden, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, hidden_dim)
        out = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # (E, T, dim)
        return torch.einsum("te,etd->td", combine.to(out.dtype), out)


def load_balancing_loss(probs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's balancing loss (arXiv:2101.03961, eq. 4-6) over all the tokens given:
    E * sum_e f_e * P_e, f_e the fraction of (token, slot) pairs routed to expert e (no gradient), P_e
    the mean of `probs` (T, E) over tokens. 1 when both are uniform. transformers'
    `load_balancing_loss_func` gives k times this for one layer (its f_e sums to k)."""
    counts = _expert_counts(top_k_index, probs.new_zeros(probs.shape[-1]))
    return probs.shape[-1] * (counts / counts.sum() * probs.mean(dim=0)).sum()


class MoE(nn.Module):
    """An MoE layer's feed-forward, (b, t, dim) -> (b, t, dim): route, run the chosen experts, add the shared one."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_hidden_dim)
        shared = cfg.moe_hidden_dim * cfg.n_shared_experts
        self.shared_experts = FeedForward(cfg.dense(shared)) if shared else None

    def forward(self, x):
        return self._mix(x)[0]

    def forward_with_aux(self, x):
        """(forward(x), this call's `load_balancing_loss`, a 0-dim tensor)."""
        y, logits, top_k_index = self._mix(x)
        return y, load_balancing_loss(self.gate.probs(logits), top_k_index)

    def _mix(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits, top_k_weights, top_k_index = self.gate(flat)
        y = self.experts(flat, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view_as(x), logits, top_k_index


class MoEBlock(nn.Module):
    """Llama's `TransformerBlock` with `moe` for its feed-forward; returns (h, aux): aux this layer's
    load-balancing loss, or None when the config's `aux_loss_coef` is 0 (then none is computed)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dense())
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)
        self.with_aux = cfg.aux_loss_coef > 0

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        if not self.with_aux:
            return h + self.moe(self.ffn_norm(h)), None
        y, aux = self.moe.forward_with_aux(self.ffn_norm(h))
        return h + y, aux


class MoETransformer(Llama):
    """Llama with `MoEBlock`s after the first `n_dense_layers` layers; the loss adds `aux_loss_coef` times
    the MoE layers' summed load-balancing losses (when above 0)."""

    @staticmethod
    def blocks(cfg: MoEConfig) -> list[nn.Module]:
        return [TransformerBlock(cfg.dense()) if i < cfg.n_dense_layers else MoEBlock(cfg) for i in range(cfg.n_layers)]

    def run_layers(self, h, cos, sin):
        for layer in self.layers[: self.config.n_dense_layers]:
            h = layer(h, cos, sin)
        aux = []
        for layer in self.layers[self.config.n_dense_layers :]:
            h, layer_aux = layer(h, cos, sin)
            aux.append(layer_aux)
        if self.config.aux_loss_coef > 0 and aux:
            return h, self.config.aux_loss_coef * torch.stack(aux).sum()
        return h, None

    def init_buffers(self) -> None:
        """Fill the rotary tables; zero every router's balancing bias and counts."""
        super().init_buffers()
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.init_buffers()

    @staticmethod
    def param_init(name: str, cfg: MoEConfig) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return ("ones", 0.0)
        if name.endswith(("wo.weight", "w2.weight", "experts.down_proj")):
            return ("normal", 0.02 / math.sqrt(2 * cfg.n_layers))
        return ("normal", 0.02)


@torch.no_grad()
def update_balancing_bias(model: nn.Module, /) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step (arXiv:2412.19437, sec. 2.1.2), once per optimizer
    step: every router with `bias_update_rate` > 0 adds rate * sign(mean(counts) - counts) to its
    `e_score_correction_bias` (an underloaded expert's bias rises) and zeroes its `tokens_per_expert`.

    In a parallel run meshlib's runtime takes this step itself after each update, with the counts already
    summed over every rank that routes (`runtime/parallelisms/expert.py`).
    Recomputing the forward (activation checkpointing) counts a layer's tokens twice; the step, a sign,
    is the same. torchtitan also subtracts the step's mean, which leaves every routing choice unchanged.

    Example:
        >>> from meshlib_torch.models import build
        >>> model = build("moe-tiny-ds", device="cpu", dtype=torch.float64)
        >>> model.init_buffers()
        >>> _ = model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
        >>> update_balancing_bias(model)
        >>> [round(v, 4) for v in model.layers[1].moe.gate.e_score_correction_bias.tolist()].count(0.001)
        6
    """
    for module in model.modules():
        if isinstance(module, TopKRouter) and module.bias_update_rate > 0:
            counts = module.tokens_per_expert
            module.e_score_correction_bias.add_(module.bias_update_rate * torch.sign(counts.mean() - counts))
            counts.zero_()
