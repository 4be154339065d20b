"""Mixture-of-experts blocks: their experts become one `shard_map` region over `ep` (expert parallelism).

An experts module is recognised by its layout, the one transformers 5 stores (Mixtral, DeepSeek-V3,
Qwen-MoE) and the bundled MoE model shares: two 3-D parameters, `gate_up_proj` (E, 2I, H) and
`down_proj` (E, H, I), no others, SwiGLU (`act_fn` SiLU when it has one), called as
`experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`. While the model is traced
(`experts_as_regions`), each such module's forward is a call of `experts.experts_ep` mapped over the
mesh: the tokens split over the data axes (`ep` among them: it borrows data ranks), the experts split
over `ep` (rank r holds E/ep of them), the tokens moved to them and back by all-to-all. The router and
the shared expert stay in the graph as ordinary ops; the region is one node the compiler places by
its specs, its collectives in the plan.

Anything else that looks like a MoE block (an `experts` child of another layout, or a class named like
one) is refused before tracing, naming it; so is an option meshlib does not run (router jitter noise).
"""

from __future__ import annotations

import contextlib
import re

from torch import nn

from meshlib import Mesh, P

# a MoE block's class, not every class of a family named *Moe* (Qwen2MoeAttention, OlmoeRMSNorm)
_MOE_CLASS = re.compile(r"(moe|mixture_?of_?experts)(_?block|_?layer)?$", re.IGNORECASE)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of `model` (see the module docstring), by qualified name."""
    return {name: mod for name, mod in model.named_modules() if _is_experts(mod)}


def _is_experts(mod: nn.Module) -> bool:
    # transformers' experts decorator states its layout; gate and up interleaved, transposed weights or
    # biases (gpt-oss) have the same shapes but other math
    flags = {"is_transposed": False, "has_bias": False, "is_concatenated": True, "has_gate": True}
    if any(getattr(mod, flag, want) != want for flag, want in flags.items()):
        return False
    params = dict(mod.named_parameters(recurse=False))
    if set(params) != set(EXPERT_PARAMS) or any(True for _ in mod.children() if not _is_act(_)):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, inner2, hidden = gate_up.shape
    return inner2 % 2 == 0 and tuple(down.shape) == (experts, hidden, inner2 // 2)


def _is_act(mod: nn.Module) -> bool:
    return isinstance(mod, nn.SiLU) or type(mod).__name__ in ("SiLUActivation", "SiLU")


def moe_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """`(fqn, class name)` of the outermost mixture-of-experts blocks of `model`."""
    found: list[tuple[str, str]] = []
    for name, mod in model.named_modules():
        if any(name == f or name.startswith(f"{f}.") for f, _ in found):
            continue
        has_experts = any(child == "experts" for child, _ in mod.named_children())
        if has_experts or _MOE_CLASS.search(type(mod).__name__):
            found.append((name, type(mod).__name__))
    return found


def _moe_modules(model: nn.Module) -> list[tuple[str, str]]:
    """Every module with an `experts` child, or named like a MoE block: `(fqn, class name)`."""
    return [
        (name, type(mod).__name__) for name, mod in model.named_modules()
        if any(child == "experts" for child, _ in mod.named_children()) or _MOE_CLASS.search(type(mod).__name__)
    ]  # fmt: skip


def _within(fqn: str, outer: str) -> bool:
    return not outer or fqn == outer or fqn.startswith(f"{outer}.")


def check_moe(model: nn.Module) -> None:
    """Raise, naming them, on MoE blocks whose experts meshlib does not recognise or whose options it does
    not run (see the module docstring)."""
    experts = expert_modules(model)
    unknown = [(n, c) for n, c in _moe_modules(model) if not any(_within(e, n) for e in experts)]
    if unknown:
        shown = ", ".join(f"{n or '(the model)'} ({cls})" for n, cls in unknown[:2])
        more = f" and {len(unknown) - 2} more" if len(unknown) > 2 else ""
        raise NotImplementedError(
            f"{shown}{more}: mixture-of-experts blocks whose experts meshlib does not recognise. It runs experts "
            "stored as transformers 5 stores them: a module with 3-D parameters gate_up_proj (E, 2I, H) and "
            "down_proj (E, H, I), SwiGLU, called as experts(hidden, top_k_index, top_k_weights). Fix: store the "
            "experts that way (the bundled MoE model shows how), or use a dense model"
        )
    for name, mod in model.named_modules():
        noise = getattr(mod, "jitter_noise", 0.0)
        inside = any(_within(e, name) and e != name for e in experts)
        if mod.training and isinstance(noise, float) and noise > 0 and inside:
            raise NotImplementedError(
                f"{name} ({type(mod).__name__}): router jitter noise {noise} in training multiplies the tokens by "
                "random values each step, which no parallel run reproduces. Fix: set router_jitter_noise=0 in the "
                "model's config"
            )


def expert_spec(mesh: Mesh) -> P:
    """What an expert weight is split as: its expert dim over `ep`, when the mesh has it (of size > 1)."""
    return P("ep") if _has_ep(mesh) else P()


def _has_ep(mesh: Mesh) -> bool:
    return "ep" in mesh.axis_names and mesh.axis_size("ep") > 1


@contextlib.contextmanager
def experts_as_regions(model: nn.Module, mesh: Mesh, data: tuple[str, ...], capacity_factor: float | None = None):
    """While the block runs, each experts module's forward is `experts_ep` mapped over `mesh`."""
    from ...experts import experts_ep
    from ...spmd.shard_map import shard_map

    axis = "ep" if _has_ep(mesh) else None
    tokens, weights = P(data or None), expert_spec(mesh)
    mapped = shard_map(
        _with(experts_ep, axis, capacity_factor), mesh=mesh, in_specs=(tokens, tokens, tokens, weights, weights),
        out_specs=tokens,
    )  # fmt: skip
    # experts compute each token alone: over `cp` its tokens may come in any order (the batch and the head-tail
    # chunks of the sequence, merged: `Shard(0, groups, mirror)`), so no row moves to reach the region
    mapped.any_rows = ("cp",)
    patched = expert_modules(model)
    for mod in patched.values():
        mod.forward = _region_forward(mod, mapped)
    try:
        yield patched
    finally:
        for mod in patched.values():
            del mod.forward


def _with(fn, axis, capacity_factor):
    def experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        return fn(x, top_k_index, top_k_weights, gate_up_proj, down_proj, axis=axis, capacity_factor=capacity_factor)

    experts.__name__ = experts.__qualname__ = "experts_ep"
    return experts


def _region_forward(mod: nn.Module, mapped):
    def forward(hidden_states, top_k_index, top_k_weights):
        return mapped(hidden_states, top_k_index, top_k_weights, mod.gate_up_proj, mod.down_proj)

    return forward





def full_buffers(model: nn.Module) -> frozenset[str]:
    """The floating buffers that stay in their own (full) precision when the model computes in bf16 or fp16:
    the routers' token counts and balancing biases (`balancing_routers`: a count past 256 is not a bf16
    integer, and the bias moves by steps of 1e-3), and those a transformers model keeps in fp32
    (`_keep_in_fp32_modules` and `_keep_in_fp32_modules_strict`, as transformers matches them: a pattern
    equal to the name or one of its dotted parts; DeepSeek-V3's `e_score_correction_bias`)."""
    names = {n for n, b in model.named_buffers() if b.is_floating_point()}
    out = {name for counts, bias, _ in balancing_routers(model) for name in (counts, bias) if name in names}
    patterns = [*(getattr(model, "_keep_in_fp32_modules", None) or ()),
                *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())]  # fmt: skip
    for name in names:
        parts = name.split(".")
        if any(p in parts or p == name or name.endswith("." + p) for p in patterns):
            out.add(name)
    return frozenset(out)


def balancing_routers(model: nn.Module) -> tuple[tuple[str, str, float], ...]:
    """`(counts buffer, bias buffer or "", rate)` of each router that counts its tokens per expert (a
    buffer `tokens_per_expert`: the runtime reports them); one that balances by a bias (DeepSeek-V3's
    auxiliary-loss-free balancing: a buffer `e_score_correction_bias` and `bias_update_rate` above 0)
    has its bias updated by the runtime after each optimizer step."""
    out = []
    for name, mod in model.named_modules():
        buffers = dict(mod.named_buffers(recurse=False))
        if "tokens_per_expert" not in buffers:
            continue
        rate = getattr(mod, "bias_update_rate", 0.0)
        prefix = f"{name}." if name else ""
        balances = isinstance(rate, float) and rate > 0 and "e_score_correction_bias" in buffers
        bias = f"{prefix}e_score_correction_bias" if balances else ""
        out.append((f"{prefix}tokens_per_expert", bias, rate if balances else 0.0))
    return tuple(out)


def expert_weight_specs(specs: dict[str, P], experts: dict[str, nn.Module], mesh: Mesh) -> dict[str, P]:
    """`specs` with every expert weight split over `ep` (`expert_spec`): the rules need not say it. A rule
    that says something else for one is refused (expert tensor parallelism is not run)."""
    want = expert_spec(mesh)
    out = dict(specs)
    for fqn in experts:
        for name in (f"{fqn}.{p}" if fqn else p for p in EXPERT_PARAMS):
            given = specs.get(name, P())
            entries = tuple(given)
            if given != P() and (entries[:1] != tuple(want)[:1] or any(e is not None for e in entries[1:])):
                raise ValueError(
                    f"{name}: the rules give this expert weight {given!r}, but experts are split over ep by their "
                    f"first dim ({want!r}) and nothing else (expert tensor parallelism is not run). Fix: give it "
                    f"{want!r}, or leave it to the default"
                )
            out[name] = want
    return out

__all__ = [
    "EXPERT_PARAMS", "balancing_routers", "check_moe", "expert_modules", "expert_spec", "expert_weight_specs",
    "experts_as_regions", "full_buffers", "moe_blocks",
]  # fmt: skip
