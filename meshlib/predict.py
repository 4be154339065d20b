"""A step's time from its `Workload` and a `DeviceProfile`: compute, communication, the pipeline's bubble.

- **Compute.** A matrix product of f FLOPs runs at `profile.matmul_fraction(f)` of the dtype's peak, or as
  fast as memory feeds it, whichever is slower; every other op takes its memory traffic's time, plus its
  FLOPs at `profile.fused_efficiency` of peak (fused kernels that are not plain products), a fused attention
  call's at `profile.attention_fraction` of its shape. The host's time per op is hidden behind the device's
  where the host runs ahead (GPUs), added where it computes itself (CPUs). Ranks beyond a CPU host's cores
  share them.
- **Communication.** Each collective runs over the ranks its mesh axes span. Mesh axes map to links in
  row-major rank order, `profile.devices_per_node` consecutive ranks a node: a group within one node uses
  the inner link, any other the outer one. Time is alpha-beta: `steps * alpha + bus_bytes / bandwidth` (alpha
  per kind of collective where the link measured one; on a CPU host, as measured with as many ranks sharing
  its cores, `Link.by_ranks`), slowed where CPU ranks outnumber their host's cores beyond that,
  with the ring's steps (n-1, or 2(n-1) for an all-reduce) or a tree's (2·log2 n) where fewer, and the bus
  bytes of a ring ((n-1)/n of the payload, twice for an all-reduce).
- **Overlap**, where the runtime overlaps: gradient reductions run behind the last microbatch's backward,
  ZeRO-3's prefetched gathers behind the compute of the step, ring hops behind their attention blocks;
  everything else waits.
- **Pipeline.** The stages' per-microbatch times (compute and exposed communication) run through the
  schedule simulator (`meshlib.simulate`), each activation send `t_comm` over the pp axis's link; the bubble
  is the busiest rank's idle time. Where ranks share a host's cores, a rank waiting in the bubble lends its
  core to the others: the step takes the longer of the schedule at each rank's speed alone and the busiest
  rank's work at the shared speed (never more than the schedule at the shared speed throughout).
- **Lockstep on shared cores.** Ranks sharing a host's cores drift apart while they compute, as the
  scheduler serves them in turns; each collective waits for the last of them, and in a pipeline each
  receive (a middle stage's 2 per microbatch and chunk) for its sender. Over a step of K such waits among
  C seconds of each rank's compute that is `profile.lockstep_wait(N, C, K)`, `sqrt(drift * C * K)` (a
  random walk: the spread grows with the square root of the stretch of compute between collectives). It
  counts as exposed communication.

Example:
    >>> from meshlib import Mesh
    >>> from meshlib.devices import A100
    >>> from meshlib.workload import Compute, StageWork, Workload
    >>> work = StageWork(forward=Compute(((1e12, 0.0, 1),)), backward=Compute(((1e12, 0.0, 2),)))
    >>> p = predict(Workload(Mesh(dp=1), (work,), tokens=1024, model_flops=3e12), A100)
    >>> round(p.step_time * 1e3, 2), f"{p.mfu:.3f}"  # 3 TFLOP at 0.8 x 312 TFLOP/s
    (12.08, '0.796')
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .devices import DeviceProfile, Link
from .mesh import Mesh
from .schedules import schedule as build_schedule
from .simulation import bubble_formula, simulate
from .workload import Comm, Compute, StageWork, Workload

__all__ = ["Prediction", "collective_terms", "comm_time", "compute_time", "link_of", "predict"]


@dataclass(frozen=True, slots=True)
class Prediction:
    """One step's predicted time per rank (seconds) and what it is made of.

    `compute`: the busiest rank's compute (recompute included); `comm`: communication it waits for
    (not hidden); `bubble`: its idle time in the pipeline; `optimizer`: the update. They add up to
    `step_time`. `mfu`: model FLOPs (no recompute) per second over the devices' peak; `memory`: peak bytes
    per rank; `comm_bytes`: payload bytes per rank per step, hidden or not."""

    step_time: float
    compute: float
    comm: float
    bubble: float
    optimizer: float
    tokens_per_s: float
    mfu: float
    memory: int
    comm_bytes: float
    devices: int
    profile: str

    @property
    def shares(self) -> dict[str, float]:
        """Each part's share of the step."""
        t = self.step_time or 1.0
        return {"compute": self.compute / t, "comm": self.comm / t, "bubble": self.bubble / t,
                "optimizer": self.optimizer / t}  # fmt: skip

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["shares"] = self.shares
        return out

    def __str__(self) -> str:
        s = self.shares
        return (
            f"step {self.step_time:.4g} s ({self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}): compute "
            f"{s['compute']:.0%}, exposed comm {s['comm']:.0%}, bubble {s['bubble']:.0%}, optimizer "
            f"{s['optimizer']:.0%} [{self.profile}]"
        )


# -- links ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _group(sizes: tuple[int, ...], names: tuple[str, ...], axes: tuple[str, ...], node: int) -> tuple[int, int]:
    """(ranks in the group, of them in one node) for a collective over `axes` of a row-major mesh."""
    n, per_node = 1, 1
    for i, name in enumerate(names):
        if name not in axes:
            continue
        stride = math.prod(sizes[i + 1 :])
        n *= sizes[i]
        if stride < node:
            per_node *= min(sizes[i], max(1, node // stride))
    return n, min(per_node, n)


def link_of(mesh: Mesh, axes: tuple[str, ...], profile: DeviceProfile) -> tuple[Link, int]:
    """The link a collective over `axes` runs on, and the ranks in its group."""
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"collective over {unknown}: not axes of {mesh!r}")
    n, per_node = _group(tuple(mesh.axis_sizes), tuple(mesh.axis_names), tuple(axes), profile.devices_per_node)
    return (profile.intra if per_node == n else profile.inter), n


def comm_time(comm: Comm, mesh: Mesh, profile: DeviceProfile) -> float:
    """Seconds one run of `comm` takes (alpha-beta on its link)."""
    link, n = link_of(mesh, comm.axes, profile) if comm.axes else (profile.intra, 1)
    if n <= 1 or comm.bytes <= 0:
        return 0.0
    kind = comm.kind if comm.kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") else "send_recv"
    steps, bus = collective_terms(kind, n, comm.bytes, link.tree)
    alpha, bandwidth, measured = link.terms(kind, mesh.size)
    return (steps * alpha + bus / bandwidth) * profile.comm_slowdown(mesh.size, measured)


def collective_terms(kind: str, n: int, nbytes: float, tree: bool = True) -> tuple[int, float]:
    """(algorithm steps, bytes each device sends) of one `kind` collective of `nbytes` over `n` devices: a ring
    (an all-reduce 2(n-1) steps of 2(n-1)/n of the bytes, or a tree's 2·ceil(log2 n) steps where `tree` and
    fewer); one step for send/recv."""
    if kind == "all_reduce":
        ring = 2 * (n - 1)
        return (min(ring, 2 * math.ceil(math.log2(n))) if tree else ring), ring / n * nbytes
    if kind == "send_recv":
        return 1, nbytes
    return n - 1, (n - 1) / n * nbytes


def compute_time(
    c: Compute, profile: DeviceProfile, dtype: str, ranks: int = 1, host: float | None = None
) -> float:
    """Seconds `c` takes on one device of `ranks` sharing a host (each kind of work at its `profile.share`);
    `host`: the host's seconds per op (the profile's `host_per_op` by default)."""
    return _time(c, profile, _rates(profile, dtype, ranks, host))


def _rates(profile: DeviceProfile, dtype: str, ranks: int, host: float | None = None) -> tuple[float, ...]:
    """(FLOP/s, bytes/s, host seconds per op, bytes/s from cache) of one device of `ranks` sharing a host: read
    once per step."""
    peak = profile.flops_per_s(dtype) * profile.share(ranks, "matmul")
    bw = profile.memory_bandwidth * profile.memory_efficiency * profile.share(ranks, "memory")
    per_op = profile.host_per_op if host is None else host
    cached = profile.cache_bandwidth * profile.share(ranks, "memory")  # each core's cache serves the ranks on it
    return peak, bw, per_op / profile.share(ranks, "host"), cached  # ranks sharing the cores share host time too


def _time(c: Compute, profile: DeviceProfile, rates: tuple[float, ...]) -> float:
    peak, bw, per_op, cached = rates
    device = sum(n * max(f / (peak * profile.matmul_fraction(f)), b / bw) for f, b, n in c.matmuls if f > 0)
    device += c.bytes / bw + c.flops / (peak * profile.fused_efficiency)
    device += sum(n * f / (peak * profile.attention_fraction(q, d, back)) for f, q, d, back, n in c.attention)
    device += sum(b / (cached if w <= profile.cache else bw) for w, b in c.reused)
    host = c.op_count * per_op
    return max(device, host) if profile.host_overlaps else device + host


# -- the step --------------------------------------------------------------------------------------------
def predict(workload: Workload, profile: DeviceProfile, *, simulate_pipeline: bool = True) -> Prediction:
    """The step time of `workload` on devices of `profile` (see the module's docstring for the model).
    `simulate_pipeline=False` takes the schedule's published bubble instead of simulating it (a search's
    quick estimate)."""
    mesh, dtype = workload.mesh, workload.dtype
    ranks = mesh.size  # on a host that shares its cores among them (`DeviceProfile.share`)
    m, v = workload.microbatches, workload.chunks
    rates = _rates(profile, dtype, ranks)
    per = [_per_microbatch(s, mesh, profile, rates) for s in workload.stages]  # (t_f, t_b, comm, compute)
    t_f, t_b = max(p[0] for p in per), max(p[1] for p in per)
    busy = max((p[0] + p[1]) * m for p in per)
    if workload.schedule and workload.pp > 1:
        send = max(s.send for s in workload.stages)
        t_send = comm_time(Comm("send_recv", (workload.pp_axis,), send), mesh, profile) if send else 0.0
        weights = [_time(s.weight, profile, rates) for s in workload.stages if s.weight is not None]
        t_w = min(max(weights), t_b) if len(weights) == len(workload.stages) else None
        makespan = _pipeline(workload.schedule, workload.pp, m, v, t_f, t_b, t_send, simulate_pipeline, t_w)
        if profile.cores and ranks > 1:  # one host's cores: a rank idle in the bubble lends its core to the rest
            rates1 = _rates(profile, dtype, 1)
            alone = [_per_microbatch(s, mesh, profile, rates1) for s in workload.stages]
            w1 = [_time(s.weight, profile, rates1) for s in workload.stages if s.weight is not None]
            critical = _pipeline(workload.schedule, workload.pp, m, v, max(p[0] for p in alone),
                                 max(p[1] for p in alone), t_send, simulate_pipeline,
                                 min(max(w1), max(p[1] for p in alone)) if t_w is not None else None)  # fmt: skip
            makespan = min(makespan, max(critical, busy))
    else:
        makespan = m * (t_f + t_b)
    stage_comm = max(p[2] for p in per) * m
    compute = max(p[3] for p in per) * m
    exposed_step = max(_step_comm(s, mesh, profile, per[i], m) for i, s in enumerate(workload.stages))
    optimizer = max(compute_time(s.optimizer, profile, "float32", ranks, profile.update_host) for s in workload.stages)
    calls = max(sum(c.count for c in s.comm) * m + sum(c.count for c in s.step_comm) for s in workload.stages)
    if workload.schedule and workload.pp > 1:  # a stage waits at each receive: activations, then their gradients
        calls += 2 * m * v
    wait = profile.lockstep_wait(ranks, compute + optimizer, calls)  # at each collective, for the last rank
    step = makespan + exposed_step + wait + optimizer
    comm_bytes = max(sum(c.bytes * c.count for c in s.comm) * m + sum(c.bytes * c.count for c in s.step_comm)
                     for s in workload.stages)  # fmt: skip
    peak = profile.flops_per_s(dtype) * mesh.size
    return Prediction(
        step_time=step, compute=compute, comm=stage_comm + exposed_step + wait, bubble=max(0.0, makespan - busy),
        optimizer=optimizer, tokens_per_s=workload.tokens / step if step else 0.0,
        mfu=workload.model_flops / (step * peak) if step else 0.0, memory=max(s.memory for s in workload.stages),
        comm_bytes=comm_bytes, devices=mesh.size, profile=profile.name,
    )  # fmt: skip


def _per_microbatch(s: StageWork, mesh: Mesh, profile: DeviceProfile, rates: tuple) -> tuple:
    """(forward time, backward time, exposed communication, compute) of one microbatch on this stage.
    Collectives that run behind compute ("compute": ring hops behind their blocks, an asynchronous
    gradient collective behind its product) hide together behind their pass: what they take beyond it shows."""
    f = _time(s.forward, profile, rates)
    b = _time(s.backward, profile, rates) + _time(s.recompute, profile, rates)
    comm = {"forward": 0.0, "backward": 0.0}
    behind = {"forward": 0.0, "backward": 0.0}
    for c in s.comm:
        t = comm_time(c, mesh, profile) * c.count
        phase = "forward" if c.phase == "forward" else "backward"
        if c.overlap == "compute" and profile.host_overlaps:
            behind[phase] += t
        else:
            comm[phase] += t
    comm["forward"] += max(0.0, behind["forward"] - f)
    comm["backward"] += max(0.0, behind["backward"] - b)
    return f + comm["forward"], b + comm["backward"], comm["forward"] + comm["backward"], f + b


def _step_comm(s: StageWork, mesh: Mesh, profile: DeviceProfile, per: tuple, m: int) -> float:
    """Per-step collectives' time not hidden: gradient reductions behind the last backward, prefetched
    gathers behind the step's compute."""
    t_f, t_b = per[0], per[1]
    hidden = {"backward": t_b if profile.host_overlaps else 0.0,
              "forward": m * (t_f + t_b) if profile.host_overlaps else 0.0, "compute": 0.0, "none": 0.0}  # fmt: skip
    total: dict[str, float] = {}
    for c in s.step_comm:
        total[c.overlap] = total.get(c.overlap, 0.0) + comm_time(c, mesh, profile) * c.count
    return sum(max(0.0, t - hidden[k]) for k, t in total.items())


def _pipeline(
    name: str, p: int, m: int, v: int, t_f: float, t_b: float, t_send: float, sim: bool, t_w: float | None = None
) -> float:
    """The pipeline's makespan: per action, a rank's stage-chunk takes 1/v of its per-microbatch time. A
    zero-bubble schedule's W takes `t_w` (the weight-gradient products; half of backward when not given)."""
    if not sim:
        bubble = bubble_formula(name, p, m, v if v > 1 else None)
        return m * (t_f + t_b) / (1 - bubble) + 2 * (p - 1) * t_send
    kind = build_schedule(name, p, m, v if v > 1 else None)
    split = any(a.kind == "W" for row in kind.actions for a in row)
    t_w = (t_b / 2 if t_w is None else t_w) if split else None
    return simulate(kind, t_f=t_f / v, t_b=t_b / v, t_w=None if t_w is None else t_w / v, t_comm=t_send).makespan
