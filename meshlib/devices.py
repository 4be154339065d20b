"""Device profiles: what a time model needs to know of the hardware, one set of constants per device kind.

A `DeviceProfile` holds a device's peak FLOP/s per dtype, the fraction of it a matrix product of a given size
reaches, its memory and memory bandwidth, and the network as `Link` levels (inside a node, then across
nodes), each with a latency per algorithm step and a bandwidth per device. The constants are cited (the
built-in GPU profiles) or measured by a stated micro-benchmark (`meshlib calibrate` for CPU ranks); they
are never fitted to a configuration.

Example:
    >>> A100.flops_per_s("bfloat16") / 1e12
    312.0
    >>> round(A100.matmul_fraction(1e12), 3)  # a 1 TFLOP matrix product
    0.796
    >>> [link.name for link in H100.links]
    ['nvlink', 'infiniband']
    >>> DeviceProfile.from_json(H100.to_json()) == H100
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "A100", "COLLECTIVE_ALGORITHMS", "DeviceProfile", "H100", "Link", "PROFILES", "PROFILE_DIR_ENV", "device_profile",
    "find_profile", "profile_dir",
]  # fmt: skip

# what a collective's time is read from: `Link.efficiency` per kind of collective
COLLECTIVE_ALGORITHMS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def _in_log_n(rows: list[tuple[int, float]], n: float, mix) -> float:
    """The value at `n` of measured `(N, value)` rows sorted by N: `mix(v0, v1, x)` between the two rows around
    it, with x its position between them in log N; below the first row the first row's value, past the last
    the last row's."""
    if n <= rows[0][0]:
        return rows[0][1]
    for (n0, v0), (n1, v1) in zip(rows, rows[1:]):
        if n <= n1:
            return mix(v0, v1, math.log(n / n0) / math.log(n1 / n0))
    return rows[-1][1]


def _linear(a: float, b: float, x: float) -> float:
    return a + (b - a) * x


def _geometric(a: float, b: float, x: float) -> float:
    return a ** (1 - x) * b**x


@functools.lru_cache(maxsize=4096)  # a search prices the same few shapes for thousands of plans
def _attention_fraction(rows, fallback: float, queries: int, dim: int, backward: bool) -> float:
    which = "backward" if backward else "forward"
    grid = {(q, d): f for p, q, d, f in rows if p == which}
    if not grid:
        return fallback
    dims = sorted({d for _, d in grid})
    by_q = [(q, _in_log_n(sorted((d, grid[q, d]) for d in dims), dim, _linear)) for q in sorted({q for q, _ in grid})]
    return _in_log_n(by_q, queries, _linear)


def _attention_problems(rows) -> list[str]:
    """What is wrong with a profile's `attention` rows: each pass's rows must fill a grid of query lengths by
    head dims, with fractions of peak in (0, 1]."""
    problems = []
    for which in {p for p, _, _, _ in rows}:
        mine = [(q, d) for p, q, d, _ in rows if p == which]
        grid = {(q, d) for q, _ in mine for _, d in mine}
        if which not in ("forward", "backward") or len(set(mine)) != len(mine) or set(mine) != grid:
            problems.append(f"attention rows of {which!r}: one per (queries, head dim) of a full grid, pass "
                            "'forward' or 'backward'")
    if any(q < 1 or d < 1 or not 0 < f <= 1 for _, q, d, f in rows):
        problems.append("attention rows: queries and head dim >= 1, fraction in (0, 1]")
    return problems


@dataclass(frozen=True, slots=True)
class Link:
    """One level of the network, as each device sees it.

    `alpha`: seconds per step of a collective algorithm (a ring all-reduce over n devices takes 2(n-1) steps,
    a tree 2·log2(n)); `bandwidth`: bytes per second a device sends in one direction at best; `efficiency`:
    the fraction of `bandwidth` a collective of each kind reaches on large messages (`(kind, fraction)`
    pairs; a kind not named reaches 1.0); `alphas`: seconds per step of the kinds whose latency is not
    `alpha` (`(kind, seconds)` pairs, `alpha_for`; measured by `meshlib calibrate`, where gloo's all-to-all
    and send/recv wait far less per step than its all-reduce); `tree`: an all-reduce runs as a tree where
    that takes fewer steps (NCCL chooses ring or tree by size); False: always a ring, as gloo's does (its
    `gloo::allreduce`, which torch's ProcessGroupGloo calls without naming an algorithm, runs `ring` then);
    `by_ranks`: `(N, kind, alpha, bus bandwidth)` rows measured while N ranks share one host's cores (`meshlib
    calibrate`): a kind with rows is priced by them (`terms`), not by `alpha` and `bandwidth`."""

    name: str
    alpha: float
    bandwidth: float
    efficiency: tuple[tuple[str, float], ...] = ()
    alphas: tuple[tuple[str, float], ...] = ()
    tree: bool = True
    by_ranks: tuple[tuple[int, str, float, float], ...] = ()

    def __post_init__(self):
        if not (self.alpha >= 0 and self.bandwidth > 0):
            raise ValueError(f"Link {self.name!r}: alpha={self.alpha} must be >= 0 and bandwidth={self.bandwidth} > 0")
        _set = object.__setattr__
        _set(self, "efficiency", tuple((str(k), float(v)) for k, v in dict(self.efficiency).items()))
        _set(self, "alphas", tuple((str(k), float(v)) for k, v in dict(self.alphas).items()))
        for kind, value in self.alphas:
            if kind not in COLLECTIVE_ALGORITHMS or not value >= 0:
                raise ValueError(f"Link {self.name!r}: alphas {kind!r}={value} must name one of "
                                 f"{COLLECTIVE_ALGORITHMS} with seconds >= 0")  # fmt: skip
        for kind, value in self.efficiency:
            if kind not in COLLECTIVE_ALGORITHMS or not 0 < value <= 1:
                raise ValueError(
                    f"Link {self.name!r}: efficiency {kind!r}={value} must name one of {COLLECTIVE_ALGORITHMS} "
                    "with a fraction in (0, 1]"
                )
        _set(self, "by_ranks", tuple(sorted((int(n), str(k), float(a), float(b)) for n, k, a, b in self.by_ranks)))
        for n, kind, a, b in self.by_ranks:
            if kind not in COLLECTIVE_ALGORITHMS or n < 1 or not (a >= 0 and b > 0):
                raise ValueError(f"Link {self.name!r}: by_ranks row {(n, kind, a, b)} must be (ranks >= 1, one of "
                                 f"{COLLECTIVE_ALGORITHMS}, alpha >= 0, bandwidth > 0)")  # fmt: skip

    def bus_bandwidth(self, kind: str) -> float:
        """Bytes per second a collective of `kind` moves per device on this link."""
        return self.bandwidth * dict(self.efficiency).get(kind, 1.0)

    def alpha_for(self, kind: str) -> float:
        """Seconds per algorithm step of a collective of `kind` on this link."""
        return dict(self.alphas).get(kind, self.alpha)

    def terms(self, kind: str, ranks: int) -> tuple[float, float, int]:
        """(alpha, bus bandwidth, N) of a `kind` collective while `ranks` ranks share the host: from `by_ranks`,
        between the two measured N around `ranks` interpolated in log N (alpha linearly, bandwidth
        geometrically), below the first the first, past the last the last (N: the row's, which the caller
        extrapolates from); without rows for `kind`, `alpha_for` and `bus_bandwidth` (N = 0)."""
        rows = [(n, a, b) for n, k, a, b in self.by_ranks if k == kind]
        if not rows:
            return self.alpha_for(kind), self.bus_bandwidth(kind), 0
        if ranks <= rows[0][0]:
            return rows[0][1], rows[0][2], rows[0][0]
        alpha = _in_log_n([(n, a) for n, a, _ in rows], ranks, _linear)
        bandwidth = _in_log_n([(n, b) for n, _, b in rows], ranks, _geometric)
        return alpha, bandwidth, min(ranks, rows[-1][0])


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One kind of device and the network between them.

    - `flops`: peak dense FLOP/s per dtype (`(dtype, flop/s)` pairs, dtype names as torch spells them);
    - `matmul_efficiency`, `matmul_half`: a matrix product of f FLOPs reaches the fraction
      `matmul_efficiency * f / (f + matmul_half)` of peak (large ones `matmul_efficiency`, one of
      `matmul_half` FLOPs half of that);
    - `memory`, `memory_bandwidth`, `memory_efficiency`: bytes per device, bytes per second at peak, and the
      fraction of it that elementwise ops reach (they are bound by memory traffic);
    - `cache`, `cache_bandwidth`: the bytes a run of ops may keep touching and find in cache, and the bytes
      per second it then moves (0: no cache is modelled, every byte goes to memory). It prices `Compute.reused`,
      the traffic of ops that re-read what the ops before them just touched (an unfused optimizer's dozen ops
      over one parameter and its state); on GPUs the fused optimizer reads each tensor once, so their profiles
      leave it at 0;
    - `fused_efficiency`: the fraction of peak that FLOPs outside plain matrix products reach (a fused
      attention kernel: its softmax and masking run between its products);
    - `attention`: what a fused attention kernel reaches by shape, `(pass, queries, head dim, fraction of peak)`
      rows over a grid of query lengths and head dims, per pass ("forward", "backward"; measured by `meshlib
      calibrate`: a kernel's rate falls with the head dim, as its softmax costs the same per score whatever
      the dim, and moves with the query length, which sets its blocks). Without rows for a pass, its calls
      reach `fused_efficiency` (`attention_fraction`);
    - `devices_per_node`, `links`: the network, innermost level first (inside a node, then across nodes);
    - `host_per_op`: seconds of host time per op (launch, dispatch); `host_per_update_op`: the same for the
      optimizer's update (None: `host_per_op`; on CPU ranks each update op runs through DTensor's dispatch);
      `host_overlaps`: whether the host runs ahead of the device (GPUs: a step takes the longer of the two)
      or computes itself (CPUs: the sum);
    - `cores`: on a CPU host, the cores its ranks share (0: every device computes alone), counted as the
      matrix-product work ranks computing at once do together, in units of one rank alone (two SMT threads
      of one core count less than 2); `sharing`: what was measured, `(work, N, speed)` rows: each of N ranks
      computing `work` ("matmul", "memory", "host") at once runs at `speed` times its speed alone. A kind of
      work with rows is priced by them (`share`), one without at `min(1, cores / N)`; `drift`: `(N, seconds)`
      rows: N such ranks computing between two collectives drift apart, as the scheduler serves them in
      turns, by `sqrt(drift * compute)`, and each collective (and each pipeline receive) waits for the last
      of them (`lockstep_wait`);
    - `comm_oversubscription`: on such a host, a collective takes `(ranks / cores) ** comm_oversubscription`
      times its link's alpha-beta time while the ranks outnumber the cores (`comm_slowdown`; measured by
      `meshlib calibrate`, where gloo's steps wait for a rank to get a core; 0: no slowdown); where the link
      measured its alpha-beta terms at N ranks sharing the host (`Link.by_ranks`), only the ranks beyond the
      most it measured slow it, by `(ranks / N) ** comm_oversubscription`;
    - `source`: where the figures come from."""

    name: str
    flops: tuple[tuple[str, float], ...]
    matmul_efficiency: float
    matmul_half: float
    memory: int
    memory_bandwidth: float
    devices_per_node: int
    links: tuple[Link, ...]
    memory_efficiency: float = 0.8
    cache: int = 0
    cache_bandwidth: float = 0.0
    fused_efficiency: float = 1.0
    attention: tuple[tuple[str, int, int, float], ...] = ()
    host_per_op: float = 0.0
    host_per_update_op: float | None = None
    host_overlaps: bool = True
    cores: float = 0.0
    sharing: tuple[tuple[str, int, float], ...] = ()
    drift: tuple[tuple[int, float], ...] = ()
    comm_oversubscription: float = 0.0
    source: str = ""
    extra: tuple[tuple[str, float], ...] = field(default=())  # measured figures a profile carries along

    def __post_init__(self):
        _set = object.__setattr__
        _set(self, "flops", tuple((str(k), float(v)) for k, v in dict(self.flops).items()))
        _set(self, "links", tuple(self.links))
        _set(self, "extra", tuple((str(k), float(v)) for k, v in dict(self.extra).items()))
        _set(self, "sharing", tuple(sorted((str(w), int(n), float(v)) for w, n, v in self.sharing)))
        _set(self, "drift", tuple(sorted((int(n), float(v)) for n, v in self.drift)))
        _set(self, "attention", tuple(sorted((str(p), int(q), int(d), float(f)) for p, q, d, f in self.attention)))
        problems = _attention_problems(self.attention)
        if not self.flops or any(v <= 0 for _, v in self.flops):
            problems.append(f"flops={dict(self.flops)} must give a positive FLOP/s for at least one dtype")
        if not 0 < self.matmul_efficiency <= 1 or self.matmul_half < 0:
            problems.append(f"matmul_efficiency={self.matmul_efficiency} in (0, 1], matmul_half >= 0")
        if not 0 < self.memory_efficiency <= 1 or self.memory_bandwidth <= 0 or self.memory <= 0:
            problems.append("memory, memory_bandwidth > 0 and memory_efficiency in (0, 1]")
        if self.cache < 0 or self.cache_bandwidth < 0 or (self.cache > 0) != (self.cache_bandwidth > 0):
            problems.append(f"cache={self.cache} and cache_bandwidth={self.cache_bandwidth}: both 0 or both > 0")
        if not 0 < self.fused_efficiency <= 1:
            problems.append(f"fused_efficiency={self.fused_efficiency} in (0, 1]")
        if self.devices_per_node < 1 or not self.links or len(self.links) > 2:
            problems.append(f"devices_per_node={self.devices_per_node} >= 1 and one or two links ({self.links})")
        if min(self.host_per_op, self.host_per_update_op or 0, self.cores, self.comm_oversubscription) < 0:
            problems.append("host_per_op, host_per_update_op, cores and comm_oversubscription >= 0")
        if any(n < 1 or not 0 < v <= 1 for _, n, v in self.sharing):
            problems.append(f"sharing={self.sharing}: rows (work, ranks >= 1, speed in (0, 1])")
        if any(n < 1 or v < 0 for n, v in self.drift):
            problems.append(f"drift={self.drift}: rows (ranks >= 1, seconds >= 0)")
        if problems:
            raise ValueError(f"DeviceProfile {self.name!r}: " + "; ".join(problems))

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s in `dtype` (float32 where the profile has no figure for it: a CPU's bf16 runs as such)."""
        table = dict(self.flops)
        if dtype in table:
            return table[dtype]
        if "float32" in table:
            return table["float32"]
        raise ValueError(f"profile {self.name!r} gives no FLOP/s for {dtype} (it has {sorted(table)})")

    def attention_fraction(self, queries: int, dim: int, backward: bool = False) -> float:
        """The fraction of peak one fused attention call over `queries` query rows of head dim `dim` reaches,
        forward or `backward`: the `attention` rows of that pass interpolated linearly in log head dim, then in
        log queries, between the measured values around it (past the grid's edge, the edge's value);
        `fused_efficiency` where the profile has no rows for the pass."""
        return _attention_fraction(self.attention, self.fused_efficiency, queries, dim, backward)

    def matmul_fraction(self, flops: float) -> float:
        """The fraction of peak a matrix product of `flops` FLOPs reaches."""
        return self.matmul_efficiency * flops / (flops + self.matmul_half) if flops > 0 else 0.0

    @property
    def update_host(self) -> float:
        """Seconds of host time per op of the optimizer's update."""
        return self.host_per_op if self.host_per_update_op is None else self.host_per_update_op

    def share(self, ranks: int, work: str = "matmul") -> float:
        """The fraction of its speed alone each of `ranks` ranks on one host gets for `work` ("matmul",
        "memory" or "host"): 1.0 on devices that do not share cores. Between two measured rank counts, the
        work they do together (N x speed) is interpolated in log N; past the largest, it stays as there."""
        if not self.cores or ranks <= 1:
            return 1.0
        rows = [(1, 1.0)] + [(n, n * v) for w, n, v in self.sharing if w == work and n > 1]
        if len(rows) == 1:
            return min(1.0, self.cores / ranks)
        return min(1.0, _in_log_n(rows, ranks, _geometric) / ranks)

    def lockstep_wait(self, ranks: int, compute: float, collectives: float) -> float:
        """Seconds `ranks` ranks sharing this host's cores wait at `collectives` collectives spread over
        `compute` seconds of each one's compute: each waits `sqrt(drift * compute / collectives)` for the last
        rank, `sqrt(drift * compute * collectives)` in all (`drift` interpolated linearly in log N from 0 at one
        rank, constant past the last row; 0 on devices that do not share cores)."""
        rows = [(1, 0.0)] + [(n, v) for n, v in self.drift if n > 1]
        if not self.cores or ranks <= 1 or len(rows) == 1 or collectives <= 0 or compute <= 0:
            return 0.0
        return math.sqrt(_in_log_n(rows, ranks, _linear) * compute * collectives)

    def comm_slowdown(self, ranks: int, measured: int = 0) -> float:
        """How many times longer than its link's alpha-beta time a collective takes while `ranks` ranks share
        this host's `cores` (1.0 where they do not outnumber them, or on devices that do not share cores);
        `measured`: the alpha-beta time was measured with that many ranks sharing the host (`Link.terms`),
        and only the ranks beyond those slow it further."""
        base = max(self.cores, measured)
        if not self.cores or ranks <= base:
            return 1.0
        return (ranks / base) ** self.comm_oversubscription

    @property
    def intra(self) -> Link:
        return self.links[0]

    @property
    def inter(self) -> Link:
        return self.links[-1]

    def replace(self, **changes) -> DeviceProfile:
        return dataclasses.replace(self, **changes)

    # -- JSON -----------------------------------------------------------------------------------------
    def to_json(self, **dumps) -> str:
        data = dataclasses.asdict(self)
        data["links"] = [dataclasses.asdict(link) for link in self.links]
        return json.dumps(data, **dumps)

    @classmethod
    def from_json(cls, text: str) -> DeviceProfile:
        data = json.loads(text)
        if "lockstep" in data:
            raise ValueError(
                f"device profile {data.get('name')!r} carries `lockstep` factors, which meshlib no longer reads "
                "(collectives now wait by `drift`). Fix: run `meshlib calibrate` again to write it afresh"
            )
        if str(data.get("source", "")).startswith("meshlib calibrate") and not data.get("attention"):
            raise ValueError(
                f"device profile {data.get('name')!r} was measured by a `meshlib calibrate` that did not time fused "
                "attention by shape, so its attention calls would be priced at one figure read off other shapes "
                "(2-2.4x fast at a small head dim). Fix: run `meshlib calibrate` again to write it afresh"
            )
        links = tuple(Link(**{**link, "efficiency": tuple(map(tuple, link.get("efficiency", ()))),
                              "alphas": tuple(map(tuple, link.get("alphas", ()))),
                              "by_ranks": tuple(map(tuple, link.get("by_ranks", ())))})
                      for link in data.pop("links"))  # fmt: skip
        for name in ("flops", "extra", "sharing", "drift", "attention"):
            data[name] = tuple(map(tuple, data.get(name, ())))
        return cls(links=links, **data)


GIB = 1 << 30

# NVIDIA A100 SXM4 80 GB, in a DGX A100 node (8 GPUs). Peak: 312 TFLOP/s dense bf16/fp16 on tensor cores,
# 156 tf32, 19.5 fp32 and fp64 (NVIDIA A100 Tensor Core GPU datasheet, 2021); HBM2e 2,039 GB/s. NVLink 3:
# 12 links of 25 GB/s each way, 300 GB/s per direction per GPU (datasheet). Across nodes: 8 ConnectX-6 HDR
# InfiniBand adapters per node, 200 Gb/s = 25 GB/s each way per GPU (DGX A100 user guide).
# Achieved fractions: the largest bf16 products reach 268-271 TFLOP/s, 86-87% of peak, at the best shape a
# search finds (stas00/ml-engineering, compute/accelerator "Maximum Achievable Matmul FLOPS" table, CUDA 12);
# a training step's products run at 0.8 (0.92 of that ceiling), less a fixed 20 us each (`matmul_half`).
# NVLink collectives: nccl-tests all_reduce_perf on 8 A100-SXM4-80GB reaches 200-208 GB/s bus bandwidth,
# 0.67-0.69 of 300 (NVIDIA/nccl-tests issues #149 and #178): 0.7. InfiniBand: two HGX A100 nodes with four
# HDR adapters reach 91 GB/s bus bandwidth, 0.91 of 4 x 25 (NVIDIA/nccl-tests issue #100): 0.9. Memory: a
# read kernel reaches 1.80 TB/s, 88% (NVIDIA developer forum, "Trouble to reach peak bandwidth of A100");
# framework elementwise kernels that read and write: 0.8. Fused attention: FlashAttention-2 reaches 50-73%
# of peak on A100 (Dao 2023, arXiv:2307.08691): 0.6.
A100 = DeviceProfile(
    name="a100",
    flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12), ("float64", 19.5e12)),
    matmul_efficiency=0.8,
    matmul_half=5e9,
    memory=80 * GIB,
    memory_bandwidth=2.039e12,
    fused_efficiency=0.6,
    devices_per_node=8,
    links=(
        Link("nvlink", alpha=5e-6, bandwidth=300e9, efficiency=(("all_reduce", 0.7), ("all_gather", 0.7),
             ("reduce_scatter", 0.7), ("all_to_all", 0.7), ("send_recv", 0.7))),  # fmt: skip
        Link("infiniband", alpha=10e-6, bandwidth=25e9, efficiency=(("all_reduce", 0.9), ("all_gather", 0.9),
             ("reduce_scatter", 0.9), ("all_to_all", 0.7), ("send_recv", 0.9))),  # fmt: skip
    ),
    host_per_op=0.0,
    source="NVIDIA A100 datasheet (peak, HBM, NVLink 3); DGX A100 user guide (8x HDR 200 Gb/s); MAMF table "
    "(stas00/ml-engineering); nccl-tests issues #100, #149, #178; FlashAttention-2 (arXiv:2307.08691)",
)

# NVIDIA H100 SXM5 80 GB, in a DGX H100 node (8 GPUs). Peak: 989 TFLOP/s dense bf16/fp16, 67 fp32, 67 fp64
# tensor (NVIDIA H100 Tensor Core GPU datasheet, 2023); HBM3 3.35 TB/s. NVLink 4: 18 links, 450 GB/s per
# direction per GPU. Across nodes: 8 ConnectX-7 NDR 400 Gb/s = 50 GB/s each way per GPU (DGX H100 user
# guide; Meta's Llama 3 clusters use 400 Gb/s RoCE or InfiniBand per GPU, arXiv:2407.21783 sec. 3.3.1).
# Achieved fractions: the best bf16 product shape reaches 792-795 TFLOP/s, 80% of peak (stas00/ml-engineering
# MAMF table); a step's products run at 0.75 (0.93 of that ceiling, as for the A100), less a fixed 20 us each.
# NVLink 4: nccl-tests all_reduce_perf on 8 H200 (the same NVLink 4) reaches 475 GB/s bus bandwidth with
# NVLink SHARP (NVIDIA/nccl-tests issue #272), and peer copies 783 of 900 GB/s both ways (NVIDIA/nccl issue
# #1264): 0.8 for rings. Fused attention: FlashAttention-2, the kernel of 2023-24, reaches 35% of peak on
# H100 (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608; FlashAttention-3 reaches 75%): 0.35.
H100 = DeviceProfile(
    name="h100",
    flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12), ("float64", 67e12)),
    matmul_efficiency=0.75,
    matmul_half=15e9,
    memory=80 * GIB,
    memory_bandwidth=3.35e12,
    fused_efficiency=0.35,
    devices_per_node=8,
    links=(
        Link("nvlink", alpha=5e-6, bandwidth=450e9, efficiency=(("all_reduce", 0.8), ("all_gather", 0.8),
             ("reduce_scatter", 0.8), ("all_to_all", 0.7), ("send_recv", 0.8))),  # fmt: skip
        Link("infiniband", alpha=10e-6, bandwidth=50e9, efficiency=(("all_reduce", 0.9), ("all_gather", 0.9),
             ("reduce_scatter", 0.9), ("all_to_all", 0.7), ("send_recv", 0.9))),  # fmt: skip
    ),
    host_per_op=0.0,
    source="NVIDIA H100 datasheet (peak, HBM3, NVLink 4); DGX H100 user guide (8x NDR 400 Gb/s); MAMF table "
    "(stas00/ml-engineering); nccl-tests issue #272, nccl issue #1264; FlashAttention-3 (arXiv:2407.08608)",
)

PROFILES = {"a100": A100, "h100": H100}


PROFILE_DIR_ENV = "MESHLIB_PROFILE_DIR"
_PACKAGED = Path(__file__).parent / "profiles"  # measured profiles shipped with meshlib (package data)


def profile_dir() -> Path:
    """Where `meshlib calibrate` writes a measured profile and `device_profile` looks first:
    `$MESHLIB_PROFILE_DIR`, else `~/.cache/meshlib/profiles`."""
    return Path(os.environ.get(PROFILE_DIR_ENV) or Path.home() / ".cache" / "meshlib" / "profiles")


def find_profile(name: str) -> tuple[Path, str] | None:
    """The file a measured profile `name` is read from, and which: `"calibrated"` (`profile_dir()/name.json`,
    written by `meshlib calibrate` on this machine) or else `"packaged"` (`meshlib/profiles/name.json`, measured
    on the machine meshlib was released from); None when neither exists."""
    for path, kind in ((profile_dir() / f"{name}.json", "calibrated"), (_PACKAGED / f"{name}.json", "packaged")):
        if path.is_file():
            return path, kind
    return None


def device_profile(name_or_path: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name (`a100`, `h100`); a measured one by name (`cpu`: this machine's gloo ranks,
    see `find_profile`: the calibrated file, else the packaged one); or one read from a JSON file. A measured
    profile's `source` ends by naming the file it was read from and which kind it is."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    key = str(name_or_path).strip().lower()
    if key in PROFILES:
        return PROFILES[key]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return DeviceProfile.from_json(path.read_text())
    found = find_profile(key) if key.replace("-", "").replace("_", "").isalnum() else None
    if found is not None:
        profile = DeviceProfile.from_json(found[0].read_text())
        note = {"calibrated": "calibrated on this machine",
                "packaged": "packaged with meshlib, measured on its maintainers' machine; `meshlib calibrate` "
                "measures this one"}[found[1]]  # fmt: skip
        return profile.replace(source=f"{profile.source}; read from {found[0]} ({note})")
    if key == "cpu":
        raise ValueError(
            f"no CPU profile: none calibrated at {profile_dir() / 'cpu.json'} and none packaged with meshlib. "
            "Fix: run `meshlib calibrate` to measure this machine's gloo ranks (or set "
            f"${PROFILE_DIR_ENV} to the directory holding a cpu.json)"
        )
    raise ValueError(
        f"profile {name_or_path!r}: use one of {sorted(PROFILES)}, 'cpu' (measured: `meshlib calibrate`), "
        "or the path of a profile's .json file"
    )
