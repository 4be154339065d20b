"""Parameters built directly in their shards, with the values a single process would draw.

Each parameter has its own generator, seeded from the run's seed and the
parameter's name, and is drawn row block by row block in a fixed order. A rank
keeps only the rows and columns of its shard from each block, so it never
holds more than one block of a parameter it does not own, and the values equal
`init_full`'s (the single-process reference) exactly.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from ..compiler.placement.placements import Layout
from ..compiler.placement.shapes import shard_indices

InitSpec = Callable[[str], tuple[str, float]]  # name -> ("normal", std) | ("zeros", 0) | ("ones", 0)
_BLOCK = 1 << 20  # elements drawn at a time


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _blocks(name: str, shape: tuple[int, ...], dtype: torch.dtype, init: InitSpec, seed: int):
    """Yield `(row_start, block)` covering `shape` row by row (dim 0), deterministically."""
    kind, std = init(name)
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    step = max(1, _BLOCK // max(1, row_numel))
    gen = _generator(seed, name) if kind == "normal" else None
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        block_shape = (n,) + tuple(shape[1:]) if shape else ()
        if kind == "normal":
            block = torch.randn(block_shape, generator=gen, dtype=dtype) * std
        elif kind == "ones":
            block = torch.ones(block_shape, dtype=dtype)
        elif kind == "zeros":
            block = torch.zeros(block_shape, dtype=dtype)
        else:
            raise ValueError(f"{name}: unknown init {kind!r}; use normal, zeros or ones")
        yield r0, block


def init_full(name: str, shape, dtype: torch.dtype, init: InitSpec, seed: int) -> torch.Tensor:
    """The whole parameter, as the single-process reference builds it."""
    parts = [b for _, b in _blocks(name, tuple(shape), dtype, init, seed)]
    return torch.cat(parts) if shape else parts[0]


def init_local(name: str, shape, dtype, layout: Layout, sizes, coords, init: InitSpec, seed: int) -> torch.Tensor:
    """This rank's shard of the parameter `init_full` would build."""
    shape = tuple(shape)
    idx = shard_indices(shape, layout, sizes, coords)
    if not shape:
        return init_full(name, shape, dtype, init, seed)
    rows = idx[0]
    out = torch.empty((rows.numel(),) + tuple(i.numel() for i in idx[1:]), dtype=dtype)
    for r0, block in _blocks(name, shape, dtype, init, seed):
        mask = (rows >= r0) & (rows < r0 + block.shape[0])
        if not mask.any():
            continue
        part = block[rows[mask] - r0]
        for d, ix in enumerate(idx[1:], start=1):
            if ix.numel() != shape[d]:
                part = part.index_select(d, ix)
        out[mask] = part
    return out
