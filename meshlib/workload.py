"""What one training step asks of each rank, in the terms a time model reads.

A `Workload` is built from a compiled plan (the torch backend reads its graph: every op's FLOPs and bytes,
every collective the plan lists) or from closed forms (`meshlib.transformer`, for shapes too large to
trace in a search). `meshlib.predict` turns it and a `DeviceProfile` into a step time.

- `Compute`: the ops of one pass (forward, backward, recompute) of one pipeline stage over one microbatch on
  one rank: its matrix products by size, and the rest as FLOPs, bytes of memory traffic and an op count.
- `Comm`: a collective as the time model sees it: kind, the mesh axes it runs over, its payload per rank
  (a `Collective`'s `bytes`), how often, and what it can hide behind (`overlap`).
- `StageWork`: what the ranks at one pipeline coordinate do per microbatch and per step.

Example:
    >>> c = Compute(matmuls=((2e9, 1e7, 4),), flops=1e6, bytes=4e6, ops=10)
    >>> c.total_flops, c.op_count
    (8001000000.0, 14)
    >>> (c + c).matmuls
    ((2000000000.0, 10000000.0, 8),)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .mesh import Mesh

__all__ = ["OVERLAPS", "Comm", "Compute", "StageCompute", "StageWork", "Workload"]

# what a collective can run behind: nothing (it waits for its input and its output is needed at once), the
# backward of the last microbatch (gradient reductions, bucketed as backward frees them), the forward
# (ZeRO-3's prefetched all-gathers), or the compute of its own op (the ring's hops behind its blocks)
OVERLAPS = ("none", "backward", "forward", "compute")


@dataclass(frozen=True, slots=True)
class Compute:
    """One pass of one stage over one microbatch on one rank.

    `matmuls`: `(flops, bytes, count)` per size of matrix product: `count` products of `flops` FLOPs each,
    each reading and writing `bytes`; `flops`, `bytes`, `ops`: every other op together (elementwise, norms,
    softmax: bound by memory traffic); `reused`: `(working set, bytes)` pairs, traffic beyond `bytes` that
    re-reads and re-writes tensors a run of ops has just touched, `working set` bytes of them at a time (the
    optimizer's ops over one parameter and its state): served from cache where the working set fits in it
    (`DeviceProfile.cache`), from memory where not; `attention`: `(flops, queries, head dim, backward, count)`
    per shape of fused attention call (a flash kernel, forward or backward: `count` calls of `flops` FLOPs
    each, over `queries` query rows per sequence, priced by `DeviceProfile.attention_fraction`). Its calls
    and their bytes are in `ops` and `bytes`, its FLOPs apart from `flops`."""

    matmuls: tuple[tuple[float, float, int], ...] = ()
    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0
    reused: tuple[tuple[float, float], ...] = ()
    attention: tuple[tuple[float, int, int, bool, int], ...] = ()

    def __post_init__(self):
        _set = object.__setattr__
        mm = self.matmuls
        if len(mm) > 1 or (mm and not mm[0][2]) or type(mm) is not tuple:  # else already one entry per size
            _set(self, "matmuls", tuple((f, b, n) for (f, b), n in _merged(((f, b), n) for f, b, n in mm)))
        if self.attention:  # one entry per shape
            calls = _merged(((float(f), int(s), int(d), bool(back)), n) for f, s, d, back, n in self.attention)
            _set(self, "attention", tuple((*key, n) for key, n in calls))
        if len(self.reused) > 1 or type(self.reused) is not tuple:  # one entry per working set
            reused: dict[float, float] = {}
            for w, b in self.reused:
                reused[float(w)] = reused.get(float(w), 0.0) + float(b)
            _set(self, "reused", tuple(reused.items()))
        if (self.flops < 0 or self.bytes < 0 or self.ops < 0 or any(min(w, b) < 0 for w, b in self.reused)
                or any(f < 0 or s < 1 or d < 1 for f, s, d, _, _ in self.attention)):  # fmt: skip
            raise ValueError(f"Compute: flops={self.flops}, bytes={self.bytes}, ops={self.ops}, reused={self.reused} "
                             f"must be >= 0, attention={self.attention} (flops >= 0, queries and head dim >= 1)")

    @staticmethod
    def attention_call(heads: float, queries: int, keys: int, dim: int, v_dim: int, *, causal: bool = True,
                       backward: bool = False) -> tuple[float, int, int, bool, int]:  # fmt: skip
        """One fused attention call as `attention` counts it, `(flops, queries, dim, backward, 1)`: over `heads`
        (batch times heads) of `queries` query rows against `keys` keys, the scores' and the context's
        products, 2·heads·queries·keys·(dim + v_dim) FLOPs, halved under a causal mask (half the blocks),
        2.5 times that in backward (the kernel recomputes the scores).

        >>> Compute.attention_call(2, 128, 128, 64, 64)  # 2·2·128·128·128, halved
        (4194304.0, 128, 64, False, 1)
        """
        flops = 2.0 * heads * queries * keys * (dim + v_dim) * (0.5 if causal else 1.0)
        return (2.5 * flops if backward else flops), int(queries), int(dim), bool(backward), 1

    @staticmethod
    def accumulation(elements: float, microbatches: int, new: int, held: int, tensors: int = 0) -> Compute:
        """Per microbatch, the adds that sum a step's `microbatches` gradients of `elements` weights (in `tensors`
        tensors) outside the products: autograd adds each later microbatch's gradient into the one held
        (`new`-byte elements read, `held`-byte ones read and written), m - 1 adds a step.

        >>> Compute.accumulation(1000, 4, 4, 4, tensors=2)  # 3/4 of 12 bytes an element, 3/4 of 2 adds
        Compute(matmuls=(), flops=0.0, bytes=9000.0, ops=2, reused=(), attention=())
        """
        if microbatches <= 1:
            return Compute()
        share = (microbatches - 1) / microbatches
        return Compute(bytes=share * (new + 2 * held) * elements, ops=round(share * tensors))

    @property
    def matmul_flops(self) -> float:
        return sum(f * n for f, _, n in self.matmuls)

    @property
    def attention_flops(self) -> float:
        return sum(f * n for f, _, _, _, n in self.attention)

    @property
    def total_flops(self) -> float:
        return self.matmul_flops + self.attention_flops + self.flops

    @property
    def op_count(self) -> int:
        return self.ops + sum(n for _, _, n in self.matmuls)

    def __add__(self, other: Compute) -> Compute:
        return Compute(self.matmuls + other.matmuls, self.flops + other.flops, self.bytes + other.bytes,
                       self.ops + other.ops, self.reused + other.reused, self.attention + other.attention)  # fmt: skip

    def scaled(self, k: float) -> Compute:
        """`k` times the work (k a whole number of repeats for the op counts)."""
        return Compute(tuple((f, b, round(n * k)) for f, b, n in self.matmuls), self.flops * k, self.bytes * k,
                       round(self.ops * k), tuple((w, b * k) for w, b in self.reused),
                       tuple((*a[:4], round(a[4] * k)) for a in self.attention))  # fmt: skip


def _merged(items) -> list[tuple]:
    """`(key, count)` pairs summed per key, in the order first seen, keys counted 0 times dropped."""
    out: dict = {}
    for key, n in items:
        if n:
            out[key] = out.get(key, 0) + n
    return list(out.items())


@dataclass(frozen=True, slots=True)
class StageCompute:
    """What the ranks at one pipeline coordinate compute, as a plan's dry run counts it: per microbatch, the
    forward, backward and recompute passes of their stages (`weight`: the part of backward a zero-bubble
    schedule runs apart), and per step the optimizer's update."""

    forward: Compute = field(default_factory=Compute)
    backward: Compute = field(default_factory=Compute)
    recompute: Compute = field(default_factory=Compute)
    weight: Compute | None = None
    optimizer: Compute = field(default_factory=Compute)


@dataclass(frozen=True, slots=True)
class Comm:
    """A collective: `count` runs per step (per microbatch in `StageWork.comm`) of `bytes` payload per rank
    over `axes`, in `phase`; `overlap` (one of `OVERLAPS`) says what it can hide behind."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    phase: str = "forward"
    count: float = 1
    overlap: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        if self.overlap not in OVERLAPS:
            raise ValueError(f"Comm overlap={self.overlap!r}: use one of {OVERLAPS}")


@dataclass(frozen=True, slots=True)
class StageWork:
    """The ranks at one pipeline coordinate (every rank without a pipeline).

    Per microbatch and stage chunk: `forward`, `backward` (input and weight gradients; `weight` is the part of
    it a zero-bubble schedule runs apart, W), `recompute` (the forward again under recompute); `comm`, the
    collectives each runs (phase forward, backward or recompute), and `send`, the bytes a stage sends its
    neighbour (activations forward, their gradient backward). Per step: `step_comm` (gradient sync, ZeRO's
    gathers), `optimizer` (the update: memory traffic and op count), `memory` (peak bytes per rank)."""

    forward: Compute
    backward: Compute
    recompute: Compute = field(default_factory=Compute)
    weight: Compute | None = None
    comm: tuple[Comm, ...] = ()
    send: float = 0.0
    step_comm: tuple[Comm, ...] = ()
    optimizer: Compute = field(default_factory=Compute)
    memory: int = 0

    def __post_init__(self):
        object.__setattr__(self, "comm", tuple(self.comm))
        object.__setattr__(self, "step_comm", tuple(self.step_comm))


@dataclass(frozen=True, slots=True)
class Workload:
    """One step on `mesh`: `stages` per pipeline coordinate (one without a pipeline), the pipeline's
    `schedule`, `microbatches` and `chunks` per rank, the step's `tokens` (global), the `model_flops` that
    count toward MFU (forward and backward of the model once, global: no recompute, no padding) and the
    `dtype` matrix products run in."""

    mesh: Mesh
    stages: tuple[StageWork, ...]
    tokens: int
    model_flops: float
    dtype: str = "bfloat16"
    schedule: str = ""
    microbatches: int = 1
    chunks: int = 1
    pp_axis: str = "pp"

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("Workload needs at least one stage")
        if self.microbatches < 1 or self.chunks < 1:
            raise ValueError(f"Workload: microbatches={self.microbatches} and chunks={self.chunks} must be >= 1")

    @property
    def pp(self) -> int:
        return len(self.stages) if self.schedule else 1
