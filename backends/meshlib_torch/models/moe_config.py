"""`MoEConfig`: the shape and routing of a bundled mixture-of-experts model (`moe.py`), validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .llama import LlamaConfig

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class MoEConfig(LlamaConfig):
    """Llama's fields (`hidden_dim`: the dense layers' feed-forward width), then the experts'.

    `router`: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3); `n_groups`/`topk_groups`: group-limited
    routing (each token picks from its `topk_groups` best groups); `norm_topk_prob`: renormalise the k
    weights; `routed_scaling_factor` multiplies them; `aux_loss_coef`: weight of the load-balancing loss
    (0: off); `bias_update_rate`: DeepSeek-V3's auxiliary-loss-free balancing step (0: off; sigmoid
    router only)."""

    n_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 16  # each routed expert's width
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    router: str = "softmax"
    n_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self):
        problems = _problems(self)
        if problems:
            raise ValueError(f"MoEConfig: {'; '.join(problems)}")

    def dense(self, hidden_dim: int | None = None) -> LlamaConfig:
        """The Llama config of a dense layer whose feed-forward is `hidden_dim` wide (default: `self.hidden_dim`)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig)}
        return LlamaConfig(**(shared | {"hidden_dim": self.hidden_dim if hidden_dim is None else hidden_dim}))


def _problems(cfg: MoEConfig) -> list[str]:
    per_group = cfg.n_experts // cfg.n_groups if cfg.n_groups > 0 else 0
    checks = [
        (cfg.router in ROUTERS, f"router={cfg.router!r} is not one of {ROUTERS}"),
        (1 <= cfg.top_k <= cfg.n_experts, f"top_k={cfg.top_k} is not in 1..n_experts={cfg.n_experts}"),
        (cfg.n_groups >= 1 and cfg.n_experts % cfg.n_groups == 0,
         f"n_groups={cfg.n_groups} does not divide n_experts={cfg.n_experts}"),
        (1 <= cfg.topk_groups <= cfg.n_groups, f"topk_groups={cfg.topk_groups} is not in 1..n_groups={cfg.n_groups}"),
        (cfg.n_groups == 1 or per_group >= 2,
         f"n_groups={cfg.n_groups} leaves {per_group} expert per group; a group's score sums its best 2"),
        (cfg.topk_groups * per_group >= cfg.top_k,
         f"topk_groups={cfg.topk_groups} groups of {per_group} experts hold fewer than top_k={cfg.top_k}"),
        (0 <= cfg.n_dense_layers <= cfg.n_layers,
         f"n_dense_layers={cfg.n_dense_layers} is not in 0..n_layers={cfg.n_layers}"),
        (cfg.aux_loss_coef >= 0 and cfg.bias_update_rate >= 0,
         f"aux_loss_coef={cfg.aux_loss_coef} and bias_update_rate={cfg.bias_update_rate} must be >= 0"),
        (cfg.bias_update_rate == 0 or cfg.router == "sigmoid",
         f"bias_update_rate={cfg.bias_update_rate} needs router='sigmoid' (it holds the bias), not {cfg.router!r}"),
        (cfg.dim % cfg.n_heads == 0 and cfg.n_heads % cfg.kv_heads == 0,
         f"dim={cfg.dim}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}: heads must divide dim, kv heads heads"),
    ]  # fmt: skip
    return [say for ok, say in checks if not ok]
