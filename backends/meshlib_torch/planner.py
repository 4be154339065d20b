"""`meshlib plan --auto`: the planner's search on a torch model, and the winners compiled into full plans.

`model_shape(model)` reads the closed-form shape (`meshlib.transformer.ModelShape`) from a bundled model's
config or a transformers model's `config`; `auto_plans(model, ...)` searches (`meshlib.planner`) and compiles
the best configurations on the meta device, each a `Plan` whose prediction comes from its own dry run
(every op the ranks run, every collective the plan lists). `run_command` is the `meshlib run` line that
trains the plan.
"""

from __future__ import annotations

import math

import torch

from meshlib import Plan, device_profile, predict_plan
from meshlib.planner import Candidate, search
from meshlib.transformer import ModelShape

from . import models

__all__ = ["auto_plans", "compile_candidate", "model_shape", "run_command"]


def model_shape(model) -> ModelShape:
    """The shape of a bundled model (its config), or of a transformers model (`model.config`); else a
    ValueError naming what the planner reads."""
    cfg = model if not isinstance(model, torch.nn.Module) else getattr(model, "cfg", None) or getattr(
        model, "config", None)  # fmt: skip
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
    raise ValueError(
        f"the planner reads a model's shape from a bundled model's config or a transformers model's `config`; "
        f"{type(model).__name__} has neither. Fix: give the model a transformers-style `config` (hidden_size, "
        "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size), or plan it by hand with "
        "meshlib plan --mesh ... --profile ..."
    )


def _hf_shape(cfg) -> ModelShape:
    """transformers' config names: Llama, Mistral, Qwen2 (gated, RMSNorm), GPT-2 (n_embd, n_layer), Mixtral and
    DeepSeek-V3 (experts)."""
    get = lambda *names, default=0: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), default)  # noqa: E731
    gpt2 = hasattr(cfg, "n_embd")
    hidden = get("hidden_size", "n_embd")
    experts = get("num_local_experts", "n_routed_experts", "num_experts")
    return ModelShape(
        layers=get("num_hidden_layers", "n_layer"), hidden=hidden, heads=get("num_attention_heads", "n_head"),
        kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
        ffn=get("intermediate_size", "n_inner", default=4 * hidden), vocab=get("vocab_size"), gated=not gpt2,
        norm="layernorm" if gpt2 else "rmsnorm", bias=gpt2, positions=get("n_positions") if gpt2 else 0,
        tied=bool(getattr(cfg, "tie_word_embeddings", gpt2)), experts=experts,
        top_k=get("num_experts_per_tok") if experts else 0, moe_ffn=get("moe_intermediate_size") if experts else 0,
        shared_experts=get("n_shared_experts") if experts else 0,
        dense_layers=get("first_k_dense_replace") if experts else 0,
    )  # fmt: skip


def compile_candidate(model, candidate: Candidate, *, rules, batch: int, seq: int, profile, example=None) -> Plan:
    """The full per-rank plan of `candidate` (compiled on the meta device with its dry run), predicted on
    `profile` from what its ranks compute and move."""
    from .compiler.compile import compile_model

    c = candidate.config
    mesh = c.mesh
    example = example or tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    precision = "bf16" if c.dtype == "bfloat16" else ("fp16" if c.dtype == "float16" else None)
    m = batch // (c.dp * c.ep * c.microbatch)
    compiled = compile_model(
        model, mesh=mesh, rules=rules(mesh) if callable(rules) and not _is_rule(rules) else rules,
        example_inputs=example, estimate_memory=True, zero=c.zero, recompute=c.recompute,
        sequence_parallel=c.sp, microbatches=m, precision=precision, **_pipeline(c), cp_method=c.cp_method,
        idle_axes=tuple(a for a in mesh.axis_names if mesh.axis_size(a) == 1),
    )  # fmt: skip
    plan = compiled.plan
    return plan.replace(prediction=predict_plan(plan, profile))


def _is_rule(rules) -> bool:
    """A rule (path, leaf) -> P is itself callable; a rules factory takes the mesh alone."""
    import inspect

    try:
        return len(inspect.signature(rules).parameters) == 2
    except (TypeError, ValueError):
        return False


def _pipeline(c) -> dict:
    if c.pp == 1:
        return {}
    return {"schedule": c.schedule, "chunks": c.chunks if c.schedule == "interleaved-1f1b" else None}


def auto_plans(
    model, /, *, devices: int, profile, batch: int, seq: int, rules=None, device_memory: float | None = None,
    top: int = 5, compile_top: int = 1, dtype: str = "bfloat16",
) -> tuple[list[Candidate], list[Plan]]:  # fmt: skip
    """The search's `top` candidates for `model` and the first `compile_top` of them compiled into full plans
    (each with its prediction). `rules`: a function of the mesh (default: a bundled model's own)."""
    profile = device_profile(profile)
    shape = model_shape(model)
    found = search(shape, devices=devices, batch=batch, seq=seq, profile=profile, device_memory=device_memory,
                   dtype=dtype, top=top)  # fmt: skip
    if rules is None:
        cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
        if cfg is None or type(cfg) not in {type(c) for c in models.CONFIGS.values()}:
            raise ValueError("auto_plans: give rules= (a function of the mesh) for a model that is not bundled")
        rules = lambda mesh: models.default_rules(cfg, mesh)  # noqa: E731
    plans = [compile_candidate(model, c, rules=rules, batch=batch, seq=seq, profile=profile)
             for c in found[:compile_top]]  # fmt: skip
    return found, plans


def run_command(candidate: Candidate, *, model: str, batch: int, seq: int, devices_per_node: int) -> str:
    """The `meshlib run` line that trains `candidate` (one node's share per `meshlib run`, under torchrun's
    rendezvous on several nodes)."""
    c = candidate.config
    mesh = ",".join(f"{a}={n}" for a, n in zip(c.mesh.axis_names, c.mesh.axis_sizes) if n > 1) or "dp=1"
    world = c.mesh.size
    per_node = min(world, devices_per_node)
    nodes = math.ceil(world / per_node)
    m = batch // (c.dp * c.ep * c.microbatch)
    parts = [f"meshlib run --nproc-per-node {per_node}"] + ([f"--nnodes {nodes}"] if nodes > 1 else [])
    parts += [f"--model {model}", f"--mesh {mesh}", f"--batch {batch}", f"--seq {seq}", f"--zero {c.zero}"]
    parts += [f"--recompute {c.recompute}"] if c.recompute != "none" else []
    parts += ["--sp"] if c.sp else []
    parts += [f"--microbatches {m}"] if m > 1 else []
    if c.pp > 1:
        parts += [f"--schedule {c.schedule}"] + ([f"--chunks {c.chunks}"] if c.schedule == "interleaved-1f1b" else [])
    parts += [f"--cp-method {c.cp_method}"] if c.cp > 1 else []
    parts += ["--precision bf16"] if c.dtype == "bfloat16" else []
    return " ".join(parts)
