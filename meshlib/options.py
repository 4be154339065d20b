"""The options of the backend's `compile_model` and `parallelize`, each defined once: its default, its
meaning, its check. Pure: the core's command line reads its choices and defaults here too.

They come as three values, as torchtitan's job config groups its parallelism settings:

- `Parallelism`: how values are laid out and what the data-parallel axes shard;
- `Pipelining`: the microbatches a step holds and, with a pipeline axis, how its stages run them;
- `Running`: what only a run on ranks needs (the weights, the seed, offload, timeouts).

The functions take them as values (`parallelism=Parallelism(zero=1)`) or as flat keywords (`zero=1`),
which `gather` sorts into the values; a keyword that is no option names the nearest one.

Example:
    >>> gather({"zero": "1", "microbatches": 4})[:2]
    (Parallelism(zero=1), Pipelining(microbatches=4))
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from .cost import zero_level
from .plan import Precision
from .schedules import resolve_schedule
from .sharding import UNEVEN_POLICIES
from .spec import P

RECOMPUTE = ("none", "block", "selective")
CP_METHODS = ("ring", "all-gather", "all-to-all")  # context parallelism's attention across the cp ranks
CP_LAYOUTS = ("zigzag", "contiguous")  # where each cp rank's tokens lie in the sequence
BALANCE = ("flops", "params", "layers")


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, repr=False)
class _Options:
    def __repr__(self) -> str:  # only what differs from the defaults: reads like the call that made it
        fields = [f for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"


@dataclass(frozen=True, repr=False)
class Parallelism(_Options):
    """How each value is laid out over the mesh, and what the data-parallel axes shard.

    `in_specs`: each input's spec, by name or in order (default: the batch dim over `dp` and the
    HSDP replicate axes). `sequence_parallel`: the regions between the tensor-parallel blocks are
    split on `seq_dim` over `tp_axis` (Megatron's sequence parallelism). `zero`: 0 all-reduces the
    gradients, 1 shards the optimizer state over the data axes, 2 and 3 hand them to FSDP2
    (`replicate_axes` makes that HSDP). `precision`: a `Precision` or its text (`"bf16"`,
    `"param=bf16,reduce=fp32"`; default the model's own dtype). `recompute`: "none", "block" or
    "selective". Gathering an activation over a data axis is an error unless `allow_data_gather`;
    a mesh axis nothing is split over is an error unless named in `idle_axes`. `uneven`: "error"
    (JAX's rule) or "chunk" (torch.chunk's pieces, DTensor's Shard) for a dim its axis does not divide.
    `capacity_factor`: a mixture-of-experts layer's experts take at most C = ceil(c·T·k/E) of the T·k
    (token, expert) pairs a rank routes (the first C to each expert, in token order), the rest dropped,
    counted and reported; fixed-size exchanges and no host read. None (the default): dropless.
    `expert_load`: what a plan's dry run gives a dropless mixture-of-experts layer's experts on each expert-
    parallel rank, in even shares of the pairs (1.0, the default: routing spread evenly; 1.5: the busiest
    rank's experts draw 1.5 times the mean, as `meshlib run`'s routing table reports it). Only plans read it:
    a run routes as its router says.
    `cp_method`: how attention over a sequence split on `cp` reaches the other ranks' keys and values:
    "ring" (they travel around the ring of cp ranks, the default), "all-gather" (gathered once; small cp)
    or "all-to-all" (DeepSpeed-Ulysses: sequence shards swapped for head shards; heads must divide by cp).
    `cp_layout`: which tokens each cp rank holds: "zigzag" (the default: the sequence cut in 2·cp chunks, rank i
    holding chunks i and 2·cp−1−i, so causal attention's work is the same on every rank; the length must be a
    multiple of 2·cp) or "contiguous" (rank i holds the i-th 1/cp of the sequence, as `P("cp")` cuts it).
    """

    in_specs: dict[str, P] | tuple[P, ...] | None = None
    sequence_parallel: bool = False
    tp_axis: str = "tp"
    seq_dim: int = 1
    zero: int = 0
    precision: Precision | None = None
    recompute: str = "none"
    replicate_axes: tuple[str, ...] = ()
    allow_data_gather: bool = False
    idle_axes: tuple[str, ...] = ()
    uneven: str = "error"
    capacity_factor: float | None = None
    expert_load: float = 1.0
    cp_method: str = "ring"
    cp_layout: str = "zigzag"

    def __post_init__(self):
        _set(self, "zero", zero_level(self.zero))
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ValueError(f"capacity_factor={c!r}: give a positive number (1.25: 25% above an even share), or None")
        r = self.expert_load
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 1 <= r < float("inf"):
            raise ValueError(f"expert_load={r!r}: give a number >= 1 (1.0: an even share; 1.5: the busiest rank's "
                             "experts draw 1.5 times the mean)")
        if isinstance(self.precision, str):
            _set(self, "precision", Precision.parse(self.precision))
        elif self.precision is not None and not isinstance(self.precision, Precision):
            raise TypeError(
                f"precision={self.precision!r}: pass a meshlib.Precision, or text such as 'bf16' or "
                "'param=bf16,reduce=fp32'"
            )
        _choose("recompute", self.recompute, RECOMPUTE)
        _choose("cp_method", self.cp_method, CP_METHODS)
        _choose("cp_layout", self.cp_layout, CP_LAYOUTS)
        _choose("uneven", self.uneven, UNEVEN_POLICIES)
        _set(self, "replicate_axes", tuple(self.replicate_axes))
        _set(self, "idle_axes", tuple(self.idle_axes))


@dataclass(frozen=True, repr=False)
class Pipelining(_Options):
    """The `microbatches` a step's batch holds: with a pipeline axis (`pp_axis` in the mesh) the
    pipeline's, run by `schedule` with `chunks` stages per rank, split at `split_points` (the layers
    where stages 2, 3, ... begin) or balanced by `balance`: "flops" or "params" (each stage's share, the
    first's embedding and the last's head included), or "layers" (as many layers a stage, the first and
    last giving up one each where they do not divide: `meshlib.schedules.even_layers`, Megatron's split and
    the one the planner prices; up to two stages more than layers, the first holding only the embedding and
    the last only the head, as Llama 3 405B's 126 layers on 128 stages); else gradient accumulation's."""

    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int | None = None
    pp_axis: str = "pp"
    split_points: tuple[int, ...] | None = None
    balance: str = "flops"

    def __post_init__(self):
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r}: give a whole number of at least 1")
        resolve_schedule(self.schedule, self.chunks)  # an unknown schedule, or chunks it cannot take
        _choose("balance", self.balance, BALANCE)
        if self.split_points is not None:
            _set(self, "split_points", tuple(self.split_points))


@dataclass(frozen=True, repr=False)
class Running(_Options):
    """What a run on ranks needs besides the plan. `weights`: a safetensors file, a directory saved by
    `save_pretrained` or a DCP checkpoint, for a model built on the meta device; `init`: name ->
    ("normal", std) | ("zeros", 0) | ("ones", 0), the single process's values with `seed` (which also
    seeds every rank alike, so that replicas draw the same dropout masks). `offload` keeps FSDP2's
    shards on the CPU, `prefetch` gathers the next block ahead, `timeout` (seconds) bounds every
    collective and send/receive of the model's process groups."""

    weights: object = None
    init: object = None
    seed: int = 0
    offload: bool = False
    prefetch: bool = True
    timeout: float | None = None


GROUPS = (Parallelism, Pipelining, Running)


def _choose(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: choose one of {tuple(allowed)}")


def gather(keywords: dict, parallelism=None, pipelining=None, running=None, *, accept=GROUPS) -> tuple:
    """(`Parallelism`, `Pipelining`, `Running`) from flat `keywords` and any values given whole; a group
    not in `accept` takes no keyword (`compile_model` has no use for `Running`'s)."""
    given = {Parallelism: parallelism, Pipelining: pipelining, Running: running}
    names = {f.name: group for group in accept for f in dataclasses.fields(group)}
    unknown = sorted(k for k in keywords if k not in names)
    if unknown:
        near = {k: difflib.get_close_matches(k, list(names), n=1, cutoff=0.6) for k in unknown}
        hints = "; ".join(f"{k!r}" + (f" (did you mean {n[0]!r}?)" if n else "") for k, n in near.items())
        raise TypeError(f"unknown option {hints}. The options: {', '.join(sorted(names))}")
    out = []
    for group in GROUPS:
        mine = {k: v for k, v in keywords.items() if names.get(k) is group}
        if given[group] is not None and mine:
            raise TypeError(
                f"{sorted(mine)} and {group.__name__.lower()}= both given: pass the options as keywords or "
                f"inside {group.__name__}(...), not both"
            )
        out.append(given[group] if given[group] is not None else group(**mine))
    return tuple(out)


__all__ = [
    "BALANCE", "CP_LAYOUTS", "CP_METHODS", "GROUPS", "Parallelism", "Pipelining", "RECOMPUTE", "Running", "gather",
]  # fmt: skip
