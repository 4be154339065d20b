"""The model's call: its inputs bound to names, and which of its outputs is the loss.

A model is called as its `forward` is written: positional inputs, keyword
inputs (Hugging Face's `input_ids=`, `labels=`, `attention_mask=`), or both.
`bind_call` binds an example call to the forward's signature once; its tensors
become the compiled graph's inputs, in call order and by parameter name, and
its other values (`use_cache=False`, `None`, flags) are fixed at trace time.
Every later call is bound the same way and checked against it.

The loss is picked from what the forward returns (`pick_loss`): a tensor is
itself; a dict or `ModelOutput` gives its `"loss"`; a tuple needs `loss=` (an
index, a key, an attribute name or a function of the output) unless exactly
one of its tensors is a floating-point scalar.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

LossSpec = int | str | Callable[[Any], torch.Tensor] | None


class LossChoiceError(ValueError):
    """The loss cannot be picked from the model's outputs (raised as it is, never as a trace failure)."""


@dataclass(frozen=True)
class Call:
    """An example call bound by name: `tensors` become graph inputs (in this order), `constants` are fixed."""

    tensors: dict[str, torch.Tensor]
    constants: dict[str, Any] = field(default_factory=dict)
    signature: inspect.Signature | None = None
    loss: LossSpec = None
    chosen: tuple[str, ...] = ()  # constants meshlib fixed that the call did not give (see `bind_call`)

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def bind(self, args: tuple = (), kwargs: Mapping | None = None) -> list[torch.Tensor]:
        """The tensors of a later call `model(*args, **kwargs)`, in graph-input order; its other
        values must equal the example call's (they were fixed when the model was traced)."""
        named = _bind(self.signature, args, kwargs or {}) if self.signature is not None else _positional(self, args)
        missing = [n for n in self.tensors if not torch.is_tensor(named.get(n))]
        extra = sorted(n for n in named if n not in self.tensors and n not in self.constants)
        changed = sorted(n for n, v in self.constants.items() if n in named and not _same(named[n], v))
        if missing or extra or changed:
            raise TypeError(
                f"this call does not match the one the model was compiled for ({self.describe()}): "
                + "; ".join(
                    part for part in (
                        f"tensor inputs {missing} not given" if missing else "",
                        f"unexpected inputs {extra}" if extra else "",
                        f"{changed} differ from the compiled values {[self.constants[n] for n in changed]}"
                        if changed else "",
                    ) if part
                )
                + ". Fix: call it as it was compiled, or compile again with these inputs"
            )  # fmt: skip
        return [named[n] for n in self.tensors]

    def arguments(self, tensors: Mapping[str, torch.Tensor]) -> tuple[tuple, dict]:
        """`(args, kwargs)` that call the forward with these tensors (by name) and the fixed values."""
        named = {**self.constants, **tensors}
        if self.signature is None:
            return tuple(named[n] for n in self.tensors), {}
        args = []
        for name, p in self.signature.parameters.items():
            if p.kind is inspect.Parameter.POSITIONAL_ONLY and name in named:
                args.append(named.pop(name))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                i = 0
                while f"{name}_{i}" in named:
                    args.append(named.pop(f"{name}_{i}"))
                    i += 1
        return tuple(args), named

    def micro(self, k: int) -> Call:
        """The call on the first of `k` microbatches (every tensor split along dim 0)."""
        return dataclasses.replace(self, tensors={n: x.chunk(k)[0] for n, x in self.tensors.items()})

    def describe(self) -> str:
        parts = [f"{n}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for n, t in self.tensors.items()]
        parts += [f"{n}={v!r}" for n, v in self.constants.items()]
        return ", ".join(parts)


def batch_call(batch) -> tuple[tuple, dict]:
    """`(args, kwargs)` of a batch given as a tuple of positional inputs or a dict of keyword inputs."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if torch.is_tensor(batch):
        return (batch,), {}
    raise TypeError(f"a batch is a tuple of positional inputs or a dict of keyword inputs, not {type(batch).__name__}")


def bind_call(
    model: nn.Module, example_inputs=(), example_kwargs: Mapping | None = None, *, loss: LossSpec = None
) -> Call:
    """Bind an example call of `model` (`example_inputs` a tuple or a dict, plus `example_kwargs`)."""
    args, kwargs = batch_call(example_inputs)
    kwargs = {**kwargs, **dict(example_kwargs or {})}
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C-level forward: positional only
        sig = None
    named = _bind(sig, args, kwargs) if sig is not None else {f"input_{i}": x for i, x in enumerate(args)}
    tensors, constants = {}, {}
    for name, value in named.items():
        if torch.is_tensor(value):
            tensors[name] = value
        elif _constant(value):
            constants[name] = value
        else:
            raise TypeError(
                f"input {name!r} is a {type(value).__name__}; the compiled model takes tensors and plain values "
                "(None, bool, int, float, str). Fix: pass the tensors inside it as inputs of their own"
            )
    if not tensors:
        raise ValueError("the example call has no tensor inputs; pass the model's inputs as example_inputs")
    chosen = ()
    if sig is not None and "use_cache" in sig.parameters and "use_cache" not in named:
        constants["use_cache"] = False  # training keeps no KV cache (Hugging Face models build one by default)
        chosen = ("use_cache",)
    return Call(tensors, constants, sig, loss, chosen)


def _bind(sig: inspect.Signature, args: tuple, kwargs: Mapping) -> dict[str, Any]:
    """Name -> value of a call; keywords that land in `**kwargs` keep their own names."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"the inputs do not fit the model's forward{sig}: {err}. Fix: pass keyword inputs by name "
            "(example_kwargs=, or a dict), e.g. {'input_ids': ids, 'labels': labels}"
        ) from None
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}_{i}": v for i, v in enumerate(value)})
        else:
            out[name] = value
    return out


def _positional(call: Call, args: tuple) -> dict[str, Any]:
    return dict(zip(call.tensors, args))


def _constant(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def pick_loss(out, loss: LossSpec = None):
    """The loss among the forward's outputs (see the module docstring); raises naming the outputs."""
    if callable(loss):
        return loss(out)
    if loss is not None:
        try:
            if isinstance(loss, str) and not isinstance(out, Mapping):
                return getattr(out, loss)
            return out[loss]
        except (KeyError, IndexError, AttributeError, TypeError):
            raise LossChoiceError(
                f"loss={loss!r}: the model's output has no such entry; it returns {describe(out)}"
            ) from None
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping) and torch.is_tensor(out.get("loss")):
        return out["loss"]
    leaves = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    scalars = [x for x in leaves if torch.is_tensor(x) and x.dim() == 0 and x.is_floating_point()]
    if len(scalars) == 1:
        return scalars[0]
    raise LossChoiceError(
        f"which output is the loss? The model returns {describe(out)}. Fix: pass loss= its index (e.g. loss=1 for "
        "`return logits, loss`), its key or attribute name (loss='loss'), or a function of the output"
    )


def describe(out) -> str:
    """A short description of a forward's output, for errors."""
    if torch.is_tensor(out):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, Mapping):
        return f"{type(out).__name__}({', '.join(f'{k}={_short(v)}' for k, v in out.items())})"
    if isinstance(out, (tuple, list)):
        return f"({', '.join(_short(v) for v in out)})"
    return type(out).__name__


def _short(v) -> str:
    return f"tensor{tuple(v.shape)}" if torch.is_tensor(v) else type(v).__name__


__all__ = ["Call", "LossChoiceError", "LossSpec", "batch_call", "bind_call", "describe", "pick_loss"]
