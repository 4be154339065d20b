"""Mixture-of-experts blocks: refused, by name, until expert parallelism lands.

A MoE block routes each token to a few experts chosen by value (top-k of a
router), which needs expert parallelism's all-to-all: the compiler cannot
place that yet. `check_not_moe` finds such blocks before anything is traced
(a module with an `experts` child, or a class named like one: `...MoE...`,
`...SparseMoeBlock`, `MixtureOfExperts`) and raises, naming them.
"""

from __future__ import annotations

import re

from torch import nn

_MOE_CLASS = re.compile(r"moe|mixture_?of_?experts", re.IGNORECASE)


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


def check_not_moe(model: nn.Module) -> None:
    """Raise if `model` has mixture-of-experts blocks (see the module docstring)."""
    blocks = moe_blocks(model)
    if not blocks:
        return
    shown = ", ".join(f"{n or '(the model)'} ({cls})" for n, cls in blocks[:2])
    more = f" and {len(blocks) - 2} more" if len(blocks) > 2 else ""
    raise NotImplementedError(
        f"{shown}{more}: mixture-of-experts blocks, which route tokens to experts by value. Expert parallelism "
        "(the ep axis and its all-to-all) is not supported yet, so meshlib cannot place them. Fix: use a dense "
        "model for now"
    )


__all__ = ["check_not_moe", "moe_blocks"]
