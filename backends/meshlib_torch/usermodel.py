"""The user's own model for `meshlib plan --model package.module:factory`: the factory called on
the meta device, its rules (`--rules`, else the module's `rules`, else all replicated) and its
example inputs (`--inputs`, else the module's `example_inputs(batch, seq)`, else token ids).
"""

from __future__ import annotations

import importlib
import inspect
import os
import runpy
import sys
from collections.abc import Mapping

import torch

from meshlib import Mesh, P, pattern_rules


def own_subject(args, mesh: Mesh, seq: int, dtype: torch.dtype) -> tuple:
    """(model on meta, rules, example inputs, example keyword inputs, notes) for `--model
    package.module:factory`, with `--rules` and `--inputs` (see `meshlib plan --help`)."""
    factory = _named(args.model, "--model")
    if not callable(factory):
        raise ValueError(f"--model {args.model}: {type(factory).__name__} is not callable; name a function or class")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {args.model} returned a {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device="meta", dtype=dtype)
    module = sys.modules[args.model.partition(":")[0]]
    rules, said = _own_rules(args, module, mesh)
    inputs, kwargs = _own_inputs(args, module, model, seq)
    return model, rules, inputs, kwargs, (("rules", said),)


def _named(ref: str, flag: str):
    """The object `package.module:name` names (the current directory is searched first, as for
    `python -m`); or, for --rules, the `rules` a Python file defines."""
    if flag == "--rules" and ref.endswith(".py"):
        if not os.path.isfile(ref):
            raise ValueError(f"{flag} {ref}: no such file")
        space = runpy.run_path(ref)
        if "rules" not in space:
            raise ValueError(f"{flag} {ref} defines no `rules`. Fix: define rules(mesh) there, or a rules object")
        return space["rules"]
    name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"{flag} {ref!r}: give package.module:name, e.g. mypkg.model:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"{flag} {ref}: cannot import {name} ({err}). Fix: put its directory on PYTHONPATH") from None
    if not hasattr(module, attr):
        raise ValueError(f"{flag} {ref}: module {name} has no {attr!r}")
    return getattr(module, attr)


def _own_rules(args, module, mesh: Mesh) -> tuple:
    """The rules and how they were found: --rules, else the module's `rules`, else all replicated."""
    if args.rules:
        found, said = _named(args.rules, "--rules"), args.rules
    elif hasattr(module, "rules"):
        found, said = module.rules, f"{module.__name__}:rules"
    else:
        return pattern_rules({}, default=P()), "none given: every parameter replicated"
    if callable(found) and not isinstance(found, Mapping) and _arity(found) == 1:
        found = found(mesh)  # rules(mesh)
    if isinstance(found, Mapping):
        found = pattern_rules(found)
    if not callable(found):
        raise ValueError(
            f"--rules {said}: got a {type(found).__name__}; give rules(mesh), a rule (path, leaf) -> P, "
            "or a {pattern: P} dict"
        )
    return found, said


def _arity(fn) -> int | None:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _own_inputs(args, module, model: torch.nn.Module, seq: int) -> tuple[tuple, dict]:
    """(positional, keyword) example inputs: --inputs, else the module's `example_inputs`, else token ids."""
    make = _named(args.inputs, "--inputs") if args.inputs else getattr(module, "example_inputs", None)
    with torch.device("meta"):
        if make is None:
            ids = torch.empty(args.batch, seq, dtype=torch.long)
            return (ids,), _targets(inspect.signature(model.forward).parameters, ids)
        out = make(args.batch, seq)
    if isinstance(out, Mapping):
        return (), dict(out)
    return ((out,) if torch.is_tensor(out) else tuple(out)), {}


def _targets(names, ids) -> dict:
    """`targets=ids` or `labels=ids` when the forward takes one (so that it returns its loss)."""
    return next(({k: ids} for k in ("targets", "labels") if k in names), {})


__all__ = ["own_subject"]
