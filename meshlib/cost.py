"""Closed-form costs: model-state memory per rank under ZeRO, and communication volumes.

These are the analytical limits the benchmarks and tests compare against (the
ZeRO paper's model-state figures, Megatron-LM's communication volumes). Ψ is the
parameter count, N the data-parallel degree.

- Mixed-precision Adam keeps 16Ψ bytes of model state: 2Ψ of bf16/fp16
  parameters, 2Ψ of gradients, and 12Ψ of fp32 optimizer state (a 4-byte master
  copy and two 4-byte moments). ZeRO-1 shards the optimizer state, ZeRO-2 the
  gradients too, ZeRO-3 the parameters too: per rank 16Ψ, 4Ψ + 12Ψ/N,
  2Ψ + 14Ψ/N and 16Ψ/N. In fp32 there is no master copy: 4Ψ + 4Ψ + 8Ψ.
- Data parallelism all-reduces the gradients: 2Ψ(N-1)/N bytes-equivalent per
  rank in a ring. ZeRO-1 and -2 reduce-scatter them and all-gather the
  parameters, the same volume; ZeRO-3 gathers the parameters twice (forward
  and backward): 3Ψ(N-1)/N, 1.5x.
- Megatron tensor parallelism all-reduces b*s*h twice forward and twice
  backward per layer; sequence parallelism swaps each for an all-gather and a
  reduce-scatter of the same bus volume.

Example:
    >>> zero_memory(1_000, 4, zero=2)
    ModelState(params=2000.0, grads=500.0, optimizer=3000.0)
    >>> dp_comm_bytes(1_000, 4, zero=3) / dp_comm_bytes(1_000, 4, zero=0)
    1.5
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ModelState", "ZERO_ALIASES", "activation_bytes", "dp_comm_bytes", "fsdp2_memory", "min_max_partition",
    "tp_comm_bytes", "zero_level", "zero_memory",
]  # fmt: skip

# FSDP's and DeepSpeed's names for the levels
ZERO_ALIASES = {"no_shard": 0, "shard_grad_op": 2, "full": 3, "full_shard": 3}


def zero_level(value: int | str) -> int:
    """0-3 from an int, a digit, or an alias (`no_shard`, `shard_grad_op`, `full`)."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key.isdigit():
            value = int(key)
        elif key in ZERO_ALIASES:
            return ZERO_ALIASES[key]
        else:
            raise ValueError(f"zero={value!r}: use 0, 1, 2, 3 or one of {sorted(ZERO_ALIASES)}")
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise ValueError(f"zero={value!r}: use 0, 1, 2, 3 or one of {sorted(ZERO_ALIASES)}")
    return int(value)


@dataclass(frozen=True, slots=True)
class ModelState:
    """Bytes per rank of parameters, gradients and optimizer state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_memory(psi: float, n: int, *, zero: int | str, mixed: bool = True, itemsize: int = 4) -> ModelState:
    """Model-state bytes per rank for `psi` parameters over `n` data-parallel ranks (the ZeRO
    paper's formulas; `itemsize` is the full-precision dtype's, 4 for fp32 and 8 for fp64)."""
    level = zero_level(zero)
    if n < 1:
        raise ValueError(f"data-parallel degree {n} must be at least 1")
    params, grads, optimizer = (2, 2, 3 * itemsize) if mixed else (itemsize, itemsize, 2 * itemsize)

    def share(nbytes: int, sharded: bool) -> float:
        return nbytes * psi / n if sharded else float(nbytes * psi)

    return ModelState(share(params, level >= 3), share(grads, level >= 2), share(optimizer, level >= 1))


def dp_comm_bytes(psi_bytes: float, n: int, *, zero: int | str) -> float:
    """Ring bus bytes per rank per step to synchronize `psi_bytes` of gradients (and gather parameters)."""
    level = zero_level(zero)
    volume = 3.0 if level == 3 else 2.0
    return volume * psi_bytes * (n - 1) / n if n > 1 else 0.0


def tp_comm_bytes(b: int, s: int, h: int, layers: int, t: int, *, itemsize: int = 4) -> float:
    """Megatron's minimum: per layer two all-reduces of b*s*h forward and two backward (bus bytes per rank)."""
    return 4 * layers * 2 * b * s * h * itemsize * (t - 1) / t if t > 1 else 0.0


def activation_bytes(
    s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4): the bytes one GPT layer keeps for backward, in 16-bit activations with 1-byte dropout
    masks, for sequence `s`, microbatch `b`, hidden `h`, `a` heads, tensor-parallel degree `t`.

    - none: sbh(34 + 5as/h) on one device; with tensor parallelism sbh(10 + 24/t + 5as/(ht)) (the
      norms', dropouts' and first projections' inputs are not split); with sequence parallelism
      too, sbh(34/t + 5as/(ht)) (everything is split);
    - "selective" (recompute the attention's softmax, its dropout and the product with the values:
      the 5as/h term): sbh(10 + 24/t), or sbh(34/t) with sequence parallelism;
    - "block" (full recompute: keep each layer's input): 2sbh, or 2sbh/t with sequence parallelism.

    Example:
        >>> activation_bytes(2048, 1, 12288, 96, t=8, sp=True) / (2048 * 12288)  # GPT-3 175B's layer
        14.25
    """
    sbh = s * b * h
    scores = 5 * a * s / (h * t)
    if recompute == "block":
        return 2 * sbh / (t if sp else 1)
    split = 34 / t if sp else 10 + 24 / t
    return sbh * (split + (scores if recompute == "none" else 0.0))


def fsdp2_memory(psi: float, n: int, *, itemsize: int = 4) -> ModelState:
    """Model state per rank at rest under FSDP2 (ZeRO-2 and -3 alike, mixed precision or not).

    FSDP2 keeps each parameter's shard in full precision (it is the master),
    its gradient's shard in full precision, and AdamW's two moments: 4Ψ/N each
    for fp32. The bf16 copies it computes with exist only during the step:
    one block at a time under ZeRO-3, all of them from forward to backward
    under ZeRO-2 (reshard_after_forward=False). So at rest the total is
    the ZeRO paper's ZeRO-3 figure, 16Ψ/N, for both levels; DeepSpeed's ZeRO-2
    figure (2Ψ + 14Ψ/N) counts the bf16 copies as always resident.
    """
    return ModelState(itemsize * psi / n, itemsize * psi / n, 2 * itemsize * psi / n)


def min_max_partition(
    costs: list[float], parts: int, *, first: float = 0.0, last: float = 0.0
) -> list[tuple[int, int]]:
    """Split `costs` into `parts` contiguous runs whose largest sum is as small as it can be.

    `first` and `last` are fixed costs the first and the last run carry on top
    of their items (in a pipeline: the embedding, and the head and loss), as
    Megatron's options to account for them in the split do. Among the splits
    with the smallest largest run, the most even one wins (the least sum of
    squares), so runs below the bottleneck are not left nearly empty: with
    several stages per rank that keeps the ranks' totals even too. Exact
    (two dynamic programs over prefix sums, O(parts * n^2)). Returns
    `[(start, stop), ...]`.

    Example:
        >>> min_max_partition([1, 2, 3, 4, 5], 2)
        [(0, 3), (3, 5)]
        >>> min_max_partition([1, 2, 3, 4, 5], 2, last=4)
        [(0, 4), (4, 5)]
        >>> min_max_partition([1] * 10, 4)  # not 3, 3, 3, 1
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot split {n} items into {parts} non-empty contiguous parts")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    extra = [(first if k == 1 else 0.0) + (last if k == parts else 0.0) for k in range(parts + 1)]
    run = lambda k, j, i: prefix[i] - prefix[j] + extra[k]  # noqa: E731 - part k holds items j..i-1
    bottleneck = _best_split(n, parts, lambda k, j, i, before: max(before, run(k, j, i)))[0]
    cap = bottleneck * (1 + 1e-12) + 1e-300
    even = lambda k, j, i, before: before + run(k, j, i) ** 2 if run(k, j, i) <= cap else float("inf")  # noqa: E731
    return _best_split(n, parts, even)[1]


def _best_split(n: int, parts: int, combine) -> tuple[float, list[tuple[int, int]]]:
    """The split of n items into `parts` runs minimizing `combine`d run values (a DP over where
    each run ends; `combine(k, j, i, best_before)` scores run k over items j..i-1)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(i - 1, k - 2, -1):
                if best[k - 1][j] == inf:
                    continue
                value = combine(k, j, i, best[k - 1][j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return best[parts][n], bounds[::-1]
