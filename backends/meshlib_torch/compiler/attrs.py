"""Module attributes by dotted name, and a model's parameters by their canonical (first) name."""

from __future__ import annotations

import torch
from torch import nn


def canonical_params(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`(canonical name -> parameter, every name -> its canonical name)`: a tied parameter is named
    by the first of its names, in `named_parameters` order."""
    first: dict[int, str] = {}
    canon: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        main = first.setdefault(id(p), name)
        aliases[name] = main
        if main == name:
            canon[name] = p
    return canon, aliases


def has_attr(mod: nn.Module, target: str) -> bool:
    try:
        resolve(mod, target)
        return True
    except AttributeError:
        return False


def resolve(mod: nn.Module, target: str):
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod


def set_attr(root: nn.Module, target: str, value) -> None:
    """Put `value` at dotted `target` under `root`, making empty modules on the way; a Parameter is
    registered as one, a tensor as a buffer."""
    *parents, last = target.split(".")
    mod = root
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(last, value)
    elif torch.is_tensor(value):
        mod.register_buffer(last, value)
    else:
        setattr(mod, last, value)



__all__ = ["canonical_params", "has_attr", "resolve", "set_attr"]
