"""A deterministic synthetic corpus, so the main job needs no download.

Lines of small arithmetic (`37+5=42.`), words and counting drawn from a seeded
generator, encoded as bytes (vocab 256). Every rank draws the same global
batch for a step; the compiled model takes each rank's part of it.
"""

from __future__ import annotations

import random

import torch

_WORDS = (
    "mesh shard rank axis tensor layout plan stage pipeline gather scatter reduce "
    "gradient optimizer step batch sequence head layer norm embed vocab token"
).split()


def corpus(n_bytes: int = 1 << 16, *, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            line = f"{a}+{b}={a + b}."
        elif kind == 1:
            line = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 8))) + "."
        else:
            start = rng.randrange(50)
            line = ",".join(str(start + i) for i in range(rng.randrange(3, 7))) + "."
        out.append(line)
        size += len(line) + 1
    return ("\n".join(out) + "\n").encode()[:n_bytes]


def batch(step: int, *, batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global `(tokens, targets)` of one step, the same on every rank."""
    data = torch.frombuffer(bytearray(corpus(seed=seed)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
