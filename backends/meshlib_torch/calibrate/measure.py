"""Run every micro-benchmark on real gloo ranks and collect the raw measurements, as plain JSON data.

The order, written once (`measure`): on the smallest pool, rank 0 alone (the others idle) measures the
matrix products, the elementwise ops, fused attention, the host's time per op and the reference job of
`busy_compute`; a pool of one rank, the host's time per op of a compiled model (`runtime`); then, for each
world size asked for, every rank runs the reference job at once, the collectives, and products alternating
with all-reduces (`compute.lockstep`, segments of `LOCKSTEP_PRODUCTS` products).
The pools are `meshlib_torch.testing.pool`'s: workers forked from a forkserver that has imported torch,
one torch thread each, one gloo group per pool.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ..testing.pool import get_pool
from . import collectives, compute, runtime

__all__ = ["measure", "on_rank0"]

_TIMEOUT = 3600.0  # seconds one job may take (the full matrix-product sweep takes about a minute)


def on_rank0(fn, /, *args, **kwargs):
    """`fn(*args, **kwargs)` on rank 0 only: the other ranks of the pool return None at once and idle."""
    return fn(*args, **kwargs) if torch.distributed.get_rank() == 0 else None


def measure(ranks: tuple[int, ...], *, quick: bool = False, progress=None) -> dict:
    """Every benchmark's raw results (see the module docstring), with the machine and its load."""
    say = progress or (lambda text: None)
    target, batches = (0.01, 3) if quick else (0.02, 5)
    before, started = _cpu_mark(), time.perf_counter()
    first = get_pool(min(ranks))
    say(f"matrix products on one rank ({'quick' if quick else 'full'} sweep)")
    shapes = compute.matmul_shapes(quick)
    out: dict = {"ranks": list(ranks), "quick": quick, "machine": machine()}
    out["matmul"] = _rank0(first, compute.matmul_times, shapes, target=target, batches=batches,
                           max_call=0.15 if quick else 0.3)  # fmt: skip
    say("elementwise ops, fused attention and host time per op on one rank")
    sizes = compute.MEMORY_SIZES[:-1] if quick else compute.MEMORY_SIZES
    out["memory"] = _rank0(first, compute.memory_times, sizes, batches=batches)
    out["host"] = _rank0(first, compute.host_times, target=target, batches=batches)
    seqs, dims = ((128, 512), (32, 128)) if quick else (compute.ATTENTION_SEQS, compute.ATTENTION_DIMS)
    out["attention"] = _rank0(first, compute.attention_times, seqs, dims, target=target, batches=batches)
    say("host time per op of a compiled model's step (meshlib's runtime) on one rank")
    out["runtime"] = get_pool(1).run(runtime.runtime_times, target=target, batches=batches, timeout=_TIMEOUT)[0]
    reps = 4 if quick else 10
    out["busy"] = {"1": _busy(first, True, reps)}
    out["collectives"], out["lockstep"] = [], {}
    sizes = collectives.message_sizes(quick)
    for n in sorted(ranks):
        pool = get_pool(n)
        say(f"{n} ranks computing at once; collectives over {n} ranks")
        out["busy"][str(n)] = _busy(pool, False, reps)
        rows = pool.run(collectives.collective_times, sizes, target=target if quick else COLLECTIVE_BATCH,
                        batches=5, timeout=_TIMEOUT)  # fmt: skip
        out["collectives"] += _slowest(rows, n)
        out["lockstep"][str(n)] = {str(k): _rounds(pool.run(compute.lockstep, products=k, timeout=_TIMEOUT))
                                   for k in (LOCKSTEP_PRODUCTS[::2] if quick else LOCKSTEP_PRODUCTS)}  # fmt: skip
    out["seconds"] = time.perf_counter() - started
    out["machine"]["other_cpu"] = _others_share(before)
    return out


# seconds of back-to-back calls per batch of a collective: a step runs tens of them, and on ranks that share
# cores one call takes 0.3-15 ms and swings 1.5-3x from call to call, so a batch averages a run of them (at
# 20 ms, a batch held one or two 8-rank calls, and the fastest of five said 10-40% less than a step pays)
COLLECTIVE_BATCH = 0.1
LOCKSTEP_PRODUCTS = (2, 10, 40)  # segments from about one to about forty milliseconds between collectives


def _rank0(pool, fn, *args, **kwargs):
    return pool.run(on_rank0, fn, *args, timeout=_TIMEOUT, **kwargs)[0]


def _busy(pool, alone: bool, reps: int) -> dict:
    """The reference job (`compute.busy_compute`), read by `_rounds`; its `{what_work: ...}` keys hold the
    FLOPs, bytes or ops each round is."""
    return _rounds([r for r in pool.run(compute.busy_compute, alone, reps=reps, timeout=_TIMEOUT) if r is not None])


def _rounds(per_rank: list) -> dict:
    """Per round (a list of `{what: seconds}` per rank) the slowest rank, then `{what: (fastest round, median
    round)}`; a `..._work` key is not a time, and keeps the first round's value."""
    rounds = [{k: max(rank[i][k] for rank in per_rank) for k in per_rank[0][i]} for i in range(len(per_rank[0]))]
    times = {k: [r[k] for r in rounds] for k in rounds[0]}
    return {k: t[0] if k.endswith("_work") else (min(t), statistics.median(t)) for k, t in times.items()}


def _slowest(rows_per_rank: list, n: int) -> list:
    """`[kind, n, bytes, fastest, median]`: per batch the slowest rank's mean, then over the batches."""
    out = []
    for i, (kind, nbytes, _) in enumerate(rows_per_rank[0]):
        batches = [max(b) for b in zip(*(rows[i][2] for rows in rows_per_rank))]
        out.append([kind, n, nbytes, min(batches), statistics.median(batches)])
    return out


def machine() -> dict:
    """The CPU, its cores, torch and Python: what a profile was measured on."""
    names = []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor(), "cores": os.cpu_count() or 1,
            "torch": torch.__version__, "python": platform.python_version(),
            "system": f"{platform.system()} {platform.release()}", "load": list(os.getloadavg()),
            "cache": cache_per_core()}  # fmt: skip


def cache_per_core(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the last-level cache the OS reports for the first core, over the cores that share it (sysfs:
    32 MiB of L3 shared by 2 cores here gives 16 MiB); 0 where it reports none."""
    best = (0, 0)
    for index in sorted(Path(root).glob("index*")):
        try:
            level, kind = int((index / "level").read_text()), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            sharing = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        nbytes = int(size[:-1] if unit > 1 else size) * unit
        best = max(best, (level, nbytes // max(1, _count_cpus(sharing))))
    return best[1]


def _count_cpus(cpu_list: str) -> int:
    """How many CPUs a sysfs list such as "0-1,4" names."""
    count = 0
    for part in filter(None, cpu_list.split(",")):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine so far, in clock ticks (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4]


def _our_ticks() -> dict[int, int]:
    """User + system ticks of this process and every process below it (the forkserver, the ranks)."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
            ticks[int(entry)] = int(fields[11]) + int(fields[12])  # ppid, utime, stime: fields 4, 14, 15
    ours, grew = {os.getpid()}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= below
        grew = bool(below)
    return {pid: ticks[pid] for pid in ours if pid in ticks}


def _cpu_mark() -> tuple[int, dict[int, int]] | None:
    try:
        return _busy_ticks(), _our_ticks()
    except OSError:  # no /proc: not Linux
        return None


def _others_share(before) -> float:
    """The fraction of the machine's busy CPU time, while calibrating, that was not this process's or its
    children's (other users' jobs make every figure slower); -1 where /proc cannot say."""
    after = _cpu_mark()
    if before is None or after is None or after[0] <= before[0]:
        return -1.0
    ours = sum(t - before[1].get(pid, 0) for pid, t in after[1].items())
    return round(max(0.0, 1.0 - ours / (after[0] - before[0])), 3)
