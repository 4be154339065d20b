"""The recompute step: each block of the lowered graph under activation checkpointing (`compiler.split`)."""

from __future__ import annotations

from ..compiler.split import Recompute


def apply_recompute(par) -> None:
    """Wrap every layer block in `Recompute` ("block": keep its inputs only; "selective": keep its
    matmuls' and attention's outputs too). With a pipeline the stages are not cut into blocks: the
    plan says recompute, the stages keep their activations (not built yet)."""
    mode = par.compiled.options.recompute
    if mode == "none" or par.compiled.stages is not None:
        return
    for i in range(par.compiled.layers):
        setattr(par.gm, f"layer_{i}", Recompute(getattr(par.gm, f"layer_{i}"), mode))


__all__ = ["apply_recompute"]
