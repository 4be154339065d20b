"""From raw measurements (`measure.measure`) to a `DeviceProfile`: one set of constants for this host's ranks.

Each figure is read off its own micro-benchmark, never off a training configuration, and from the fastest
batch of each measurement (`compute.timed`: the one other processes disturbed least), but the collectives'
(below):

- **matrix products**: per dtype, the time of a product of f FLOPs less the host's dispatch of one
  (`host["matmul"]`) is fitted as `(f + half) / rate` (weighted least squares on relative error: the
  saturating curve `f / (f + half)` of `DeviceProfile.matmul_fraction`); `matmul_efficiency` is float32's
  `rate` over the best float32 throughput any product reached, `matmul_half` float32's `half`, and each
  dtype's `flops` its `rate / matmul_efficiency`, so that a large product of every dtype runs at its own rate;
- **fused attention**: `attention` holds what torch's causal flash attention kernel reaches, forward and
  backward, on a grid of query lengths and head dims (FLOPs as the closed form counts them, over float32's
  `flops`), which `DeviceProfile.attention_fraction` interpolates; `fused_efficiency`, for fused FLOPs of
  no known shape, is the median forward call's;
- **memory**: `memory_bandwidth` is the best streaming rate (copy or add into kept tensors) on 16 MiB
  tensors (`fit_memory`), and `memory_efficiency` what the ops that are not matrix products reach as a
  model runs them, over it (`fit_model_memory`: a 192-wide Llama's forward and backward on one rank, less
  its products and attention at the fitted rates and its host time, over the bytes its dry run counts for
  the rest); without that measurement, fresh add, mul and scale on 16 MiB tensors (their median). `memory`
  is the host's RAM, which its ranks share; `cache` is the last-level cache the OS reports over the cores
  that share it, and `cache_bandwidth` the best streaming rate on the largest tensors that fit in it three at
  a time (`fit_cache`), which an unfused optimizer's re-reads of one parameter and its state reach;
- **host**: `host_per_op` and `host_per_update_op` are a compiled model's forward-and-backward and update
  time per counted op where the arithmetic is nil (`runtime.runtime_times`: 8-wide tensors); measurements
  without it fall back to the mean of a tiny op's forward under autograd and its share of backward;
- **cores**: `sharing` holds, per kind of work (products, fresh adds, tiny ops' host time) and N ranks
  computing at once, each one's speed against one rank alone (`fit_cores`); `cores` is the median over
  N > 1 of the products' work together (N x speed), in units of one rank alone, not rounded (two SMT
  threads of one core do less than two ranks' work); `drift` per N, from rounds of a segment of products then
  a 1 KiB all-reduce at several segment lengths s: what a round takes beyond the segment alone plus the
  all-reduce alone is the wait `sqrt(drift * s)`, fitted by least squares (`fit_drift`);
- **the link**: `steps * alpha + bus / bandwidth`, `meshlib.predict.comm_time`'s formula, per kind and per
  number N of ranks sharing the host (`Link.by_ranks`, `fit_by_ranks`): each measured at N ranks, fitted by
  least squares on relative error to that N's points, each point its median batch (the slowest rank's mean
  over 0.1 s of calls). Ranks sharing cores wait on the scheduler inside every call, so a call swings 1.5-3x
  from one to the next, and the fastest of five batches reads 4-70% under the median (4 ranks, 1 KiB to
  1 MiB). A step sums tens of calls and pays their typical time: on three side-by-side runs of the
  planner table (2026-11-29), fits to the fastest batch predicted the collectives' rows 10-25% fast, fits to
  the median brought the mean error from 11.3%, 7.5% and 7.9% to 8.9%, 6.7% and 3.4% (benchmarks/README.md,
  Planner section). One curve for every N, its time multiplied by
  `max(1, N / cores) ** comm_oversubscription`, misses them by up to 2x (gloo's 1 KiB all-reduce takes
  0.3 ms on 2 ranks of 2 cores, 5 ms on 4, 9 ms on 8; the power law says 0.4, 2.5, 11.6): that fit
  (`fit_link`, the exponent on a grid from 0 to 2 by 0.05 for the smallest squared log error) gives the
  link's `alpha`, `alphas`, `bandwidth` and `efficiency`, which the report shows, and the exponent, which
  prices ranks beyond the most measured.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from meshlib.devices import DeviceProfile, Link
from meshlib.predict import collective_terms, compute_time
from meshlib.workload import Compute

__all__ = ["comm_terms", "fit_attention", "fit_by_ranks", "fit_cache", "fit_cores", "fit_drift", "fit_link",
           "fit_matmul", "fit_memory", "fit_model_memory", "fit_profile", "saturating"]  # fmt: skip

_GAMMAS = tuple(round(0.05 * i, 2) for i in range(41))


def _lstsq(rows, target) -> np.ndarray:
    """Least squares on relative error: each row and its target divided by the target."""
    a, t = np.asarray(rows, dtype=float), np.asarray(target, dtype=float)
    return np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)[0]


def saturating(points) -> tuple[float, float]:
    """(rate, half) of `seconds = (flops + half) / rate` fitted to `(flops, seconds)` points (half >= 0)."""
    inv_rate, lag = _lstsq([(f, 1.0) for f, _ in points], [t for _, t in points])
    if lag < 0:  # no fixed cost to be seen: a straight rate
        inv_rate, lag = _lstsq([(f,) for f, _ in points], [t for _, t in points])[0], 0.0
    return float(1.0 / inv_rate), float(lag / inv_rate)


def fit_matmul(rows, host: float) -> dict[str, dict]:
    """Per dtype: `rate` and `half` of `saturating`, `best` (the highest FLOP/s a product reached), and
    per row the fitted time over the measured, `(family, layout, flops, measured s, fitted s)`."""
    out = {}
    for dtype in dict.fromkeys(r[0] for r in rows):
        mine = [(2.0 * m * k * n, t, family, layout) for d, family, layout, m, k, n, t, _ in rows if d == dtype]
        device = [(f, max(t - host, t * 0.05)) for f, t, _, _ in mine]
        rate, half = saturating(device)
        fitted = [(fam, lay, f, t, host + (f + half) / rate) for f, t, fam, lay in mine]
        out[dtype] = {"rate": rate, "half": half, "best": max(f / t for f, t in device), "points": fitted}
    return out


def fit_cores(busy: dict, cores_max: int) -> tuple[float, dict[str, dict[int, float]]]:
    """(cores, per kind of work ("matmul", "memory", "host") {N: one rank's speed alone over the slowest rank's
    with N at once}, at most 1). cores: the median over N > 1 of what N ranks did together in products (N x
    speed; at least 1, at most `cores_max`; `cores_max` where only one rank was measured)."""
    speeds = {}
    for what in ("matmul", "memory", "host"):
        alone = busy["1"][what][0]
        speeds[what] = {int(n): min(1.0, alone / b[what][0]) for n, b in busy.items()}
    together = [n * s for n, s in speeds["matmul"].items() if n > 1]
    best = statistics.median(together) if together else cores_max
    return round(max(1.0, min(max(cores_max, 1), best)), 2), speeds


def comm_terms(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """(algorithm steps, bus bytes) of one gloo collective, as `meshlib.predict.comm_time` counts them on a
    link without trees (gloo's all-reduce is a ring)."""
    return collective_terms(kind, n, nbytes, tree=False)


def fit_link(points, cores: float) -> dict:
    """Per kind `alpha` and `bandwidth`, and `gamma` (the oversubscription exponent), fitted to
    `(kind, n, bytes, seconds)` points (see the module docstring); each point with its fitted time."""
    kinds = tuple(dict.fromkeys(p[0] for p in points))
    oversubscribed = any(n > cores for _, n, _, _ in points)
    fits = [_link_at(points, kinds, cores, g) for g in (_GAMMAS if oversubscribed else (0.0,))]
    return min(fits, key=lambda fit: fit["error"])


def _link_at(points, kinds, cores: float, gamma: float) -> dict:
    """The least-squares fit at one oversubscription exponent: per kind, alpha >= 0 and bandwidth."""
    alpha, bandwidth, fitted = {}, {}, {}
    for kind in kinds:
        mine = [p for p in points if p[0] == kind]
        rows = [[max(1.0, n / cores) ** gamma * v for v in comm_terms(kind, n, b)] for _, n, b, _ in mine]
        target = [t for *_, t in mine]
        x = [float(v) for v in _lstsq(rows, target)]
        if x[0] < 0 or x[1] <= 0:  # latency below what the data resolve, or times that do not grow with the
            x = [0.0, float(_lstsq([r[1:] for r in rows], target)[0])]  # bytes (a loaded machine): bytes alone
        alpha[kind], bandwidth[kind] = x[0], 1.0 / x[1]
        fitted |= {tuple(p): float(r[0] * x[0] + r[1] * x[1]) for p, r in zip(mine, rows)}
    out = [(*p, fitted[tuple(p)]) for p in points]
    error = sum(math.log(f / t) ** 2 for *_, t, f in out)
    return {"alpha": alpha, "bandwidth": bandwidth, "gamma": gamma, "error": error, "points": out}


def fit_by_ranks(points) -> dict:
    """`Link.by_ranks` rows `(N, kind, alpha, bandwidth)` fitted per kind and N to `(kind, N, bytes, seconds)`
    points measured with N ranks on the host (least squares on relative error, as `_link_at` at exponent 0),
    and each point with its fitted time."""
    at = {n: [p for p in points if p[1] == n] for n in sorted({p[1] for p in points})}
    fit = {n: _link_at(mine, tuple(dict.fromkeys(p[0] for p in mine)), 1.0, 0.0) for n, mine in at.items()}
    rows = tuple((n, kind, f["alpha"][kind], f["bandwidth"][kind]) for n, f in fit.items() for kind in f["alpha"])
    fitted = {tuple(p[:4]): p[4] for f in fit.values() for p in f["points"]}
    return {"rows": rows, "points": [(*p, fitted[tuple(p)]) for p in points]}


def fit_memory(rows, numel: int = 1 << 22) -> tuple[float, float]:
    """(memory_bandwidth, memory_efficiency) from `(op, numel, fastest, median seconds, bytes)` rows, on
    tensors of `numel` elements (16 MiB; the largest measured when smaller): the best streaming rate (copy or
    add into kept tensors), and the median rate of the ops that make fresh tensors (add, mul, scale) over it.
    16 MiB is a mid-size run's activation: past the caches (three such tensors), below glibc's threshold
    for mapping each new tensor afresh (32 MiB; above it every fresh tensor pays page faults)."""
    size = max(n for _, n, *_ in rows if n <= numel)
    rate = _rates(rows, size)
    peak = _streaming(rate)
    return peak, min(1.0, statistics.median(rate[op] for op in ("add", "mul", "scale")) / peak)


def _rates(rows, size: int) -> dict[str, float]:
    """Bytes per second of each elementwise op on tensors of `size` elements (fastest batch)."""
    return {op: nbytes / t for op, n, t, _, nbytes in rows if n == size}


def _streaming(rate: dict[str, float]) -> float:
    """The best streaming rate: copy or add into kept tensors."""
    return max(rate["copy"], rate["add_out"])


def fit_cache(rows, cache: int) -> tuple[int, float]:
    """(cache, cache_bandwidth) from `(op, numel, fastest, median seconds, bytes)` rows and the bytes of
    cache one core has (`measure.cache_per_core`): the best streaming rate (copy or add into kept tensors) on
    the largest tensors whose three (add's two inputs and its output) fit in it; (0, 0.0) where none do or
    the OS reports no cache."""
    sizes = [n for _, n, *_ in rows if 3 * 4 * n <= cache]  # fp32 elements
    if not sizes or cache <= 0:
        return 0, 0.0
    return cache, _streaming(_rates(rows, max(sizes)))


def fit_model_memory(model: dict, profile: DeviceProfile) -> float | None:
    """memory_efficiency from a model's forward and backward (`runtime.runtime_times`'s `model`): its fastest
    time less its products, fused attention and host time on `profile`, is the time of the bytes the dry
    run counts for its other ops. None where nothing is left (the products alone take the time)."""
    work = Compute(tuple(map(tuple, model["matmuls"])), model["flops"], 0.0, model["ops"],
                   attention=tuple(map(tuple, model["attention"])))  # fmt: skip
    rest = model["seconds"][0] - compute_time(work, profile, "float32")
    if rest <= 0 or model["bytes"] <= 0:
        return None
    return min(1.0, model["bytes"] / rest / profile.memory_bandwidth)


def fit_drift(lockstep: dict) -> tuple[tuple[int, float], ...]:
    """`(N, drift seconds)` rows from `compute.lockstep`'s `{N: {products: {what: (fastest, median)}}}`: per
    segment length s (`busy`), the wait w = max(0, both - busy - collective), fastest rounds; `sqrt(drift)` is
    the least-squares slope of w on sqrt(s)."""
    rows = []
    for n, by_len in lockstep.items():
        pts = [(t["busy"][0], max(0.0, t["both"][0] - t["busy"][0] - t["collective"][0])) for t in by_len.values()]
        rows.append((int(n), (sum(w * math.sqrt(s) for s, w in pts) / sum(s for s, _ in pts)) ** 2))
    return tuple(rows)


def fit_attention(rows, peak: float) -> tuple[float, tuple[tuple[str, int, int, float], ...]]:
    """(fused_efficiency, `DeviceProfile.attention` rows) from `compute.attention_times`'s `(pass, sequence,
    head dim, batch·heads, FLOPs, fastest, median)` rows: each measured shape's FLOPs / fastest over `peak`
    (float32's `flops`); fused_efficiency, for fused FLOPs of no known shape, the median forward one."""
    table = tuple((p, s, d, min(1.0, f / t / peak)) for p, s, d, _, f, t, _ in rows)
    return statistics.median(f for p, _, _, f in table if p == "forward"), table


def fit_profile(m: dict, name: str = "cpu") -> tuple[DeviceProfile, dict]:
    """The profile of measurements `m`, and every fit (for the report and the sidecar)."""
    host = {k: fastest for k, (fastest, _) in m["host"].items()}
    mm = fit_matmul(m["matmul"], host["matmul"])
    efficiency = min(1.0, mm["float32"]["rate"] / mm["float32"]["best"])
    flops = {d: f["rate"] / efficiency for d, f in mm.items()}
    cores, speed = fit_cores(m["busy"], m["machine"]["cores"])
    points = [(kind, n, nbytes, median) for kind, n, nbytes, _, median in m["collectives"]]  # see the docstring
    comm, by_ranks = fit_link(points, cores), fit_by_ranks(points)
    top = max(comm["bandwidth"].values())
    link = Link("loopback", alpha=comm["alpha"].get("all_reduce", min(comm["alpha"].values())), bandwidth=top,
                efficiency=tuple((k, b / top) for k, b in comm["bandwidth"].items()),
                alphas=tuple(comm["alpha"].items()), tree=False, by_ranks=by_ranks["rows"])  # fmt: skip
    comm = {**comm, "one curve": comm["points"], "points": by_ranks["points"]}
    fused, attention = fit_attention(m["attention"], flops["float32"])
    bandwidth, mem_eff = fit_memory(m["memory"])
    cache, cache_bandwidth = fit_cache(m["memory"], m["machine"].get("cache", 0))
    extra = {f"matmul_{what}.{d}": f[what] for what in ("rate", "half", "best") for d, f in mm.items()}
    extra |= {f"host.{k}": v for k, v in host.items()}
    extra |= {"other_cpu": m["machine"].get("other_cpu", -1.0)}
    profile = DeviceProfile(
        name=name, flops=tuple(flops.items()), matmul_efficiency=efficiency, matmul_half=mm["float32"]["half"],
        memory=_memory_bytes(), memory_bandwidth=bandwidth, memory_efficiency=mem_eff,
        cache=cache, cache_bandwidth=cache_bandwidth,
        fused_efficiency=fused, attention=attention, devices_per_node=max(m["ranks"]),
        links=(link,), **_host(m, host), host_overlaps=False, cores=cores,
        sharing=tuple((w, n, v) for w, by_n in speed.items() for n, v in by_n.items() if n > 1),
        drift=fit_drift(m.get("lockstep", {})),
        comm_oversubscription=comm["gamma"], source=_source(m), extra=tuple(extra.items()),
    )  # fmt: skip
    model = fit_model_memory(m["runtime"]["model"], profile) if "model" in m.get("runtime", {}) else None
    if model is not None:
        profile = profile.replace(memory_efficiency=model)
    return profile, {"matmul": mm, "cores": cores, "speed": speed, "link": comm,
                     "memory_efficiency": {"fresh ops": mem_eff, "model": model}}  # fmt: skip


def _host(m: dict, host: dict) -> dict:
    """`host_per_op` and `host_per_update_op`: a compiled model's ops as its runtime runs them (`runtime`),
    or, from measurements without them, a tiny op's forward under autograd and its share of backward."""
    if "runtime" in m:
        rt = m["runtime"]
        return {"host_per_op": rt["graph_op"][0], "host_per_update_op": rt["update_op"][0]}
    return {"host_per_op": (host["op_grad"] + host["backward_op"]) / 2}


def _memory_bytes() -> int:
    """Physical memory of the host (/proc/meminfo; 1 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 1 << 30


def _source(m: dict) -> str:
    host = m["machine"]
    return (
        f"meshlib calibrate{' --quick' if m['quick'] else ''} --ranks {','.join(map(str, m['ranks']))} on "
        f"{host['cpu']} ({host['cores']} cores), torch {host['torch']}; other processes took "
        f"{max(0.0, host.get('other_cpu', 0.0)):.0%} of the busy CPU"
    )
