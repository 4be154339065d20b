"""Experts stored one tensor per expert in a checkpoint, read as the 3-D tensors transformers' models hold.

transformers 5 holds a mixture-of-experts layer's experts as `experts.gate_up_proj` (E, 2I, H) and
`experts.down_proj` (E, H, I), but saves and publishes them as before, one tensor per expert and
projection (Mixtral's `block_sparse_moe.experts.<e>.w1.weight`, Qwen's and DeepSeek's
`mlp.experts.<e>.gate_proj.weight`); its checkpoint conversion mapping says how they stack
(`transformers.conversion_mapping`: a renaming of the module path, then per target the per-expert
source patterns, merged over experts on dim 0 and concatenated on dim 1). `expert_stacks` reads
that mapping for the parameters a checkpoint lacks by name and returns, for each, the key of every
piece of every expert: a `Stack`. Reading a `Stack` at some indices (`read`) opens only the
experts those indices name, so a rank of an expert-parallel run reads its own experts and no other.
Only those two operations are understood; a parameter whose conversion uses others stays missing
(and `hub.match` names it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stack:
    """A 3-D parameter made of per-expert tensors: `parts[j][e]` is the key of piece j of expert e; the
    pieces of one expert are concatenated on their dim 0 (the parameter's dim 1)."""

    parts: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]  # each piece's rows

    def read(self, read_key, index: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The elements at the product of `index` (sorted global indices per dim), reading only the experts
        in `index[0]`, each piece's rows in `index[1]`: `read_key(key, index, dtype)` reads one key."""
        experts, rows, rest = index[0], index[1], list(index[2:])
        out = torch.empty((len(experts), len(rows), *(len(ix) for ix in rest)), dtype=dtype)
        start = 0
        for keys, n in zip(self.parts, self.rows, strict=True):
            mine = (rows >= start) & (rows < start + n)
            if mine.any():
                for i, e in enumerate(experts.tolist()):
                    out[i, mine] = read_key(keys[e], [rows[mine] - start, *rest], dtype)
            start += n
        return out


def renames(model) -> list[tuple[str, str]]:
    """`(in the file, in the model)` module-path renamings of `model`'s checkpoints (Mixtral's
    `.block_sparse_moe.` is `.mlp.`), from transformers' conversion mapping; plain substrings only."""
    out = []
    for r in _conversions(model):
        if type(r).__name__ == "WeightRenaming" and len(r.source_patterns) == len(r.target_patterns) == 1:
            old, new = r.source_patterns[0], r.target_patterns[0]
            if not any(c in old + new for c in "\\^$*+?()[]{}|"):
                out.append((old, new))
    return out


def file_names(name: str, renamings: list[tuple[str, str]]) -> list[str]:
    """`name` and what the checkpoint may call it under `renamings` (see `renames`)."""
    return [name] + [name.replace(new, old) for old, new in renamings if new in name]


def expert_stacks(model, missing: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], find) -> dict:
    """`name -> Stack` for each parameter in `missing` (name -> shape) that transformers' conversion mapping of
    `model` builds from per-expert tensors all present in `shapes` (the checkpoint's key -> shape), with the
    stacked shape; `find(candidates)` is the checkpoint's key for any of those names, or None."""
    conversions = _conversions(model)
    if not conversions:
        return {}
    renamings = renames(model)
    out = {}
    for name, shape in missing.items():
        for conv in conversions:
            stack = _stack(name, shape, conv, renamings, shapes, find)
            if stack is not None:
                out[name] = stack
                break
    return out


def _conversions(model) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - transformers absent or too old: no per-expert checkpoints to stack
        return []
    found = get_checkpoint_conversion_mapping(type(model).__name__)
    if found is None:
        found = get_checkpoint_conversion_mapping(getattr(config, "model_type", None))
    return list(found or [])


def _stack(name: str, shape, conv, renamings, shapes, find) -> Stack | None:
    if type(conv).__name__ != "WeightConverter" or len(shape) != 3 or len(conv.target_patterns) != 1:
        return None
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
    if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        return None
    target = conv.target_patterns[0]
    if not name.endswith(target) or any("*" not in s for s in conv.source_patterns):
        return None
    base, experts = name[: -len(target)], shape[0]
    parts = []
    for pattern in conv.source_patterns:
        keys = []
        for e in range(experts):
            key = find(file_names(base + pattern.replace("*", str(e)), renamings))
            if key is None:
                return None
            keys.append(key)
        parts.append(tuple(keys))
    pieces = [shapes[keys[0]] for keys in parts]
    if any(shapes[k] != pieces[j] for j, keys in enumerate(parts) for k in keys) or any(len(p) != 2 for p in pieces):
        return None
    if (experts, sum(p[0] for p in pieces), pieces[0][1]) != tuple(shape) or len({p[1] for p in pieces}) != 1:
        return None
    return Stack(tuple(parts), tuple(p[0] for p in pieces))


__all__ = ["Stack", "expert_stacks", "file_names", "renames"]
