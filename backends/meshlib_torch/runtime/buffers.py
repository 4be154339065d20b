"""Meta buffers given values by the model's own init code: for each buffer, the nearest code that owns it.

A model built on the meta device has meta buffers. A checkpoint holds the persistent ones; the others
(rotary tables, masks: computed, never saved) are filled by init code, looked for from the module that
owns the buffer up to the root, the first found that fills it winning:

1. the owner's `init_buffers()`, then its `reset_parameters()` (torch's convention);
2. at the owner and then at each ancestor in turn: `init_buffers()`, `_init_weights(owner)` (Hugging Face
   calls it with each module; transformers 5 re-makes rotary `inv_freq` there), `init_weights()`.

A candidate runs with storage for the buffers it is to fill alone: every other parameter and buffer that
has values is swapped for a meta stand-in while it runs and put back after, so init code never
re-initialises a value the user's weights provide (in-place init of a meta tensor does nothing). A buffer
is marked before (NaN; 0x7F bytes for integers and bools), and one still marked after a candidate, or
left on the meta device, goes to the next. Init code runs on the CPU, without grad, on a forked random
generator. A buffer none fills raises on every rank alike, naming it, its owner, what was tried and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..torch_private import own_buffers, own_parameters

_MARK = 0x7F  # the byte integer and bool buffers are filled with before init code runs (floating ones: NaN)


def fill_meta_buffers(model: nn.Module, names, *, why: str = "the model holds them on the meta device") -> None:
    """Give each meta buffer in `names` (its FQN in `model`) CPU storage filled by the nearest init code that
    owns it; raise naming every buffer that none fills (`why`: why no value came from elsewhere)."""
    by_owner: dict[str, list[str]] = {}
    for name in names:
        path, _, key = name.rpartition(".")
        by_owner.setdefault(path, []).append(key)
    unfilled = []
    with torch.no_grad(), torch.device("cpu"), torch.random.fork_rng(devices=[]):
        for path, keys in by_owner.items():
            unfilled += _fill_owner(model, path, keys)
    if unfilled:
        raise ValueError(_message(model, unfilled, why))


def _fill_owner(model: nn.Module, path: str, keys: list[str]) -> list[tuple[str, str, list[str]]]:
    """Fill the buffers `keys` of the module at `path`; `(path, key, candidates tried)` for each left empty."""
    owner = model.get_submodule(path)
    want = {k: (tuple(own_buffers(owner)[k].shape), own_buffers(owner)[k].dtype) for k in keys}
    for k, (shape, dtype) in want.items():
        own_buffers(owner)[k] = _marked(torch.empty(shape, dtype=dtype))
    left, tried = list(keys), []
    for label, run in _candidates(model, path):
        tried.append(label)
        with _only(model, owner, left):
            try:
                run()
            except Exception as err:
                _back_to_meta(owner, left, want)
                raise ValueError(
                    f"{label}, run to fill the meta buffers {', '.join(_fqn(path, k) for k in left)}, raised "
                    f"{type(err).__name__}: {err}. Fix: make it fill them with the model's parameters on the meta "
                    "device (it runs with them so), or build the model with real buffers and only its parameters "
                    "on the meta device"
                ) from err
        left = [k for k in left if not _filled(owner, k, want[k], label, path)]
        if not left:
            return []
    _back_to_meta(owner, left, want)
    return [(path, k, tried) for k in left]


def _back_to_meta(owner: nn.Module, keys: list[str], want: dict) -> None:
    """The buffers `keys` of `owner` left as they came: on the meta device."""
    for k in keys:
        own_buffers(owner)[k] = torch.empty(want[k][0], dtype=want[k][1], device="meta")


def _candidates(model: nn.Module, path: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """`(label, call)` for each piece of init code that may fill the buffers of the module at `path`, nearest first."""
    owner = model.get_submodule(path)
    for name in ("init_buffers", "reset_parameters"):
        if (fn := _method(owner, name)) is not None:
            yield _label(owner, path, f"{name}()"), fn
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        at = ".".join(parts[:depth])
        mod = model.get_submodule(at)
        if mod is not owner and (fn := _method(mod, "init_buffers")) is not None:
            yield _label(mod, at, "init_buffers()"), fn
        if (fn := _method(mod, "_init_weights", owner)) is not None:
            yield _label(mod, at, f"_init_weights({type(owner).__name__})"), lambda fn=fn: fn(owner)
        if (fn := _method(mod, "init_weights")) is not None:
            yield _label(mod, at, "init_weights()"), fn


def _method(mod: nn.Module, name: str, *args) -> Callable | None:
    """`mod.<name>` if it is callable with `args`, else None."""
    fn = getattr(mod, name, None)
    if not callable(fn) or isinstance(fn, nn.Module):
        return None
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return None
    except ValueError:  # no signature to read (a builtin): let it be called
        pass
    return fn


@contextmanager
def _only(model: nn.Module, owner: nn.Module, keys: list[str]):
    """While it runs, every parameter and buffer of `model` with values, but the buffers `keys` of `owner`,
    is a meta stand-in; each is put back after (a replaced one too)."""
    saved = []
    for mod in model.modules():
        for store in (own_parameters(mod), own_buffers(mod)):
            for key, t in list(store.items()):
                if t is None or (mod is owner and store is own_buffers(mod) and key in keys):
                    continue
                saved.append((store, key, t))
                if not t.is_meta:
                    stand_in = torch.empty_like(t, device="meta")
                    store[key] = nn.Parameter(stand_in, t.requires_grad) if isinstance(t, nn.Parameter) else stand_in
    try:
        yield
    finally:
        for store, key, t in saved:
            store[key] = t


def _filled(owner: nn.Module, key: str, want: tuple, label: str, path: str) -> bool:
    """Whether init code left the buffer `key` of `owner` with values (raises if it changed its shape or dtype)."""
    t = own_buffers(owner).get(key)
    if t is None or t.is_meta:
        return False
    if (tuple(t.shape), t.dtype) != want:
        raise ValueError(
            f"{label} made the buffer {_fqn(path, key)} {tuple(t.shape)} {t.dtype}, but the model has it "
            f"{want[0]} {want[1]}. Fix: make the init code keep the buffer's shape and dtype"
        )
    return not _still_marked(t)


def _marked(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    t.reshape(-1).view(torch.uint8).fill_(_MARK)
    return t


def _still_marked(t: torch.Tensor) -> bool:
    """Whether some element of `t` still holds the mark (left unwritten by the init code)."""
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), -1)
    return bool((raw == _MARK).all(dim=1).any())


def _message(model: nn.Module, unfilled: list[tuple[str, str, list[str]]], why: str) -> str:
    lines, classes = [], []
    for path, key, tried in unfilled:
        owner = model.get_submodule(path)
        classes.append(type(owner).__name__)
        saved = "persistent" if key in owner.state_dict(keep_vars=True) else "not persistent: no checkpoint saves it"
        how = (
            f"tried {', '.join(tried)}: none wrote all of it" if tried
            else f"no init code owns it: {type(owner).__name__}.__init__ alone makes its value"
        )  # fmt: skip
        lines.append(f"  {_fqn(path, key)} (a buffer of {_where(owner, path)}, {saved}): {how}")
    return (
        f"the model's buffers are on the meta device and nothing gives them values ({why}):\n" + "\n".join(lines)
        + f"\nFix: give {' and '.join(sorted(set(classes)))} an init_buffers(self) that fills its buffers whole, as "
        "__init__ computes them, or build the model with real buffers and only its parameters on the meta device"
    )  # fmt: skip


def _where(mod: nn.Module, path: str) -> str:
    return f"{type(mod).__name__} at {path!r}" if path else f"{type(mod).__name__} (the root)"


def _label(mod: nn.Module, path: str, call: str) -> str:
    return f"{type(mod).__name__}.{call} at {path!r}" if path else f"{type(mod).__name__}.{call} (the root)"


def _fqn(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


__all__ = ["fill_meta_buffers"]
