"""Weights in: the model's own values, or values drawn by `init=`, each rank keeping its shard.

A model handed over with real parameters trains from those values. Each rank
takes its shard of a parameter and the model's full copy is released at once
(the model's parameter becomes a meta tensor), so a rank's peak while
building is the model it was given plus one parameter's shard. Every rank must
hold the same weights (seed every rank alike, or load the same checkpoint);
`agree` checks that with one small all-reduce of exact integer checksums and
raises on every rank, naming the parameters that differ.

A model on the meta device has no values: `weights=` reads them from a
checkpoint (`hub`), or `init=` draws them (the single process's values, see
`materialize`). Giving either for a model that has weights, or neither for a
meta model, is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..compiler.placement.placements import Layout
from ..compiler.placement.shapes import local_shape, shard_indices
from ..torch_private import own_parameters
from .materialize import init_full, init_local

_CHUNK = 1 << 20  # elements checksummed at a time


def check_source(model: nn.Module, init, weights=None) -> str:
    """"model" (use the model's values), "init" (draw them) or "file" (read `weights=`); raises on a mixed or
    contradictory model."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if meta and real:
        raise ValueError(
            f"the model has parameters on the meta device ({_some(meta)}) and parameters with values "
            f"({_some(real)}). Fix: build it wholly on the meta device (then pass init= or weights=), or wholly "
            "with its weights"
        )
    if init is not None and weights is not None:
        raise ValueError("init= draws the weights and weights= reads them: give one of the two")
    if real and (init is not None or weights is not None):
        raise ValueError(
            f"the model has its own weights, and {'init=' if init is not None else 'weights='} would replace them. "
            "Fix: drop it to train from the model's weights, or build the model on the meta device "
            "(`with torch.device('meta'):`) to take them from there"
        )
    if meta and init is None and weights is None:
        raise ValueError(
            "the model is on the meta device and has no values, and neither weights= (a checkpoint to read) nor "
            "init= (how to draw them) says where they come from. Fix: pass weights='path/to/checkpoint', or "
            "init=lambda name: ('normal', 0.02) (or ('zeros', 0) / ('ones', 0) per parameter), or build the model "
            "with its weights (on the CPU) so that parallelize takes them"
        )
    return "file" if weights is not None else "init" if meta else "model"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@dataclass
class Source:
    """Where the weights come from: the model ("model"), `init=` ("init") or a checkpoint ("file": `hub`)."""

    kind: str
    init: Callable | None = None
    seed: int = 0
    files: object = None  # a `hub.SafetensorsWeights` or `hub.DCPWeights`
    keys: dict = field(default_factory=dict)  # parameter -> key in `files`
    buffer_keys: dict = field(default_factory=dict)  # buffer -> key in `files`

    def shard(self, name: str, p: torch.Tensor, layout: Layout, sizes, coords) -> torch.Tensor:
        """This rank's shard of parameter `name` (a DCP checkpoint's: empty, filled by `finish`)."""
        if self.kind == "file":
            if self.files.kind == "dcp":
                return torch.empty(local_shape(tuple(p.shape), layout, sizes, coords), dtype=p.dtype)
            index = shard_indices(tuple(p.shape), layout, sizes, coords)
            return self.files.read(self.keys[name], index, p.dtype)
        return local_value(name, p, layout, sizes, coords, init=self.init, seed=self.seed)

    def whole(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The whole parameter (a DCP checkpoint's: empty, filled by `finish`)."""
        if self.kind == "file":
            if self.files.kind == "dcp":
                return torch.empty(tuple(p.shape), dtype=p.dtype)
            return self.files.read(self.keys[name], [torch.arange(n) for n in p.shape], p.dtype)
        return full_value(name, p, init=self.init, seed=self.seed)

    def finish(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], orders=None) -> None:
        """Read a DCP checkpoint into this rank's parameters and buffers (one collective); else nothing.
        `orders`: the parameters held in unequal parts, each with its rank order (`runtime.dtensor`)."""
        if self.kind == "file" and self.files.kind == "dcp":
            tensors = {self.keys[n]: p for n, p in params.items()}
            tensors |= {self.buffer_keys[n]: b for n, b in buffers.items() if n in self.buffer_keys}
            by_key = {self.keys[n]: order for n, order in (orders or {}).items() if n in params}
            with torch.no_grad():
                self.files.load(tensors, by_key)

    def buffer(self, name: str) -> torch.Tensor | None:
        """A buffer's value from a safetensors checkpoint, if it has one (DCP's: `finish`)."""
        if self.kind == "file" and self.files.kind != "dcp" and name in self.buffer_keys:
            return self.files.whole(self.buffer_keys[name])
        return None


def source(model: nn.Module, *, init=None, seed: int = 0, weights=None, compiled=None) -> Source:
    """The weights' `Source`, every check done (a checkpoint's names and shapes against the model's)."""
    kind = check_source(model, init, weights)
    if kind != "file":
        return Source(kind, init, seed)
    from .hub import match, open_weights

    files = open_weights(weights)
    traced = compiled.traced
    keys, buffer_keys = match(files, model, traced.params, compiled.buffers, traced.aliases)
    return Source(kind, files=files, keys=keys, buffer_keys=buffer_keys)


def take_shard(value: torch.Tensor, layout: Layout, sizes, coords) -> torch.Tensor:
    """This rank's shard of a whole tensor (a copy: the whole may be freed)."""
    idx = shard_indices(tuple(value.shape), layout, sizes, coords)
    out = value.detach()
    for d, ix in enumerate(idx):
        if ix.numel() != value.shape[d]:
            out = out.index_select(d, ix.to(out.device))
    return out.clone() if out is value.detach() else out


def local_value(name: str, p: torch.Tensor, layout: Layout, sizes, coords, *, init, seed: int) -> torch.Tensor:
    """This rank's shard of parameter `name`: drawn by `init`, or taken from the model's value `p`."""
    if init is not None:
        return init_local(name, tuple(p.shape), p.dtype, layout, sizes, coords, init, seed)
    return take_shard(p, layout, sizes, coords)


def full_value(name: str, p: torch.Tensor, *, init, seed: int) -> torch.Tensor:
    """The whole parameter: drawn by `init`, or the model's own (a copy)."""
    if init is not None:
        return init_full(name, tuple(p.shape), p.dtype, init, seed)
    return p.detach().clone()


def checksum(t: torch.Tensor) -> int:
    """An exact, order-sensitive checksum of a tensor's bytes (the same on every device and kernel)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool or flat.element_size() == 1:
        words = flat.view(torch.uint8).to(torch.int64)
    else:
        words = flat.view(torch.int16).to(torch.int64) if flat.element_size() >= 2 else flat.to(torch.int64)
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        weight = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) % 65521 + 1
        total = (total + int((chunk * weight).sum())) % (1 << 61)
    return total


def agree(sums: dict[str, int], device: torch.device) -> None:
    """Raise on every rank unless every rank's checksums are equal (one all-reduce of max and -min)."""
    if not sums or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names = sorted(sums)
    local = torch.tensor([sums[n] for n in names], dtype=torch.int64, device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    hi, lo = both[: len(names)], -both[len(names) :]
    differ = [n for n, a, b in zip(names, hi.tolist(), lo.tolist()) if a != b]
    if differ:
        raise ValueError(
            f"the ranks were given different weights: {_some(differ)} differ between ranks. Every rank must hold "
            "the same model: seed every rank alike before building it (torch.manual_seed), or load the same "
            "checkpoint on every rank"
        )


class Holders:
    """Every place some modules hold each parameter (tied ones: several), to free a whole copy once taken."""

    def __init__(self, *modules: nn.Module):
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}
        for mod in modules:
            for sub in mod.modules():
                for key, p in own_parameters(sub).items():
                    if p is not None and not p.is_meta:
                        self.places.setdefault(id(p), []).append((sub, key))

    def release(self, p: torch.Tensor) -> None:
        """Put a meta tensor of the same shape wherever `p` was held."""
        for sub, key in self.places.pop(id(p), []):
            own_parameters(sub)[key] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)


__all__ = [
    "Holders", "Source", "agree", "check_source", "checksum", "full_value", "local_value", "source", "take_shard",
]  # fmt: skip
