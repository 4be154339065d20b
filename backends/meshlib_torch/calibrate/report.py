"""What `meshlib calibrate` prints: the fitted profile, then each benchmark's measured figures beside the
time the profile gives for them (fitted / measured: 1.00 is exact)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from meshlib._table import Table, human_bytes

__all__ = ["tables"]


def tables(cal) -> list[Table]:
    """The profile, matrix products, memory and host, shared cores, collectives."""
    return [_profile(cal), _matmul(cal), _memory_host(cal), _attention(cal), _cores(cal), _collectives(cal)]


def _attention(cal) -> Table:
    """GFLOP/s of the fused attention kernel per pass and query length (rows) and head dim (columns), with the
    fraction of peak the profile keeps (`DeviceProfile.attention`)."""
    rows = cal.measurements["attention"]
    dims = sorted({d for _, _, d, *_ in rows})
    peak = dict(cal.profile.flops)["float32"]
    cells: dict[tuple[str, int], dict[int, str]] = {}
    for which, seq, dim, bh, flops, fastest, _ in rows:
        rate = flops / fastest
        cells.setdefault((which, seq), {})[dim] = f"{rate / 1e9:.1f} ({rate / peak:.2f}, {bh})"
    return Table(
        "fused attention on one rank, GFLOP/s (fraction of float32 peak, batch·heads)",
        ("pass, queries", *(f"head dim {d}" for d in dims)),
        [(f"{which} s={seq}", *(by.get(d, "") for d in dims)) for (which, seq), by in cells.items()],
        "torch's causal fp32 flash attention kernel on (1, batch·heads, s, head dim) q, k, v; FLOPs as the plan "
        "counts them: 2·(batch·heads)·s²·2·dim, halved for the causal mask, 2.5 times in backward",
    )


def _g(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _ratios(pairs) -> str:
    """Fitted / measured over some points: median (min - max)."""
    r = [f / t for t, f in pairs]
    return f"{statistics.median(r):.2f} ({min(r):.2f} - {max(r):.2f})"


def _profile(cal) -> Table:
    p, link = cal.profile, cal.profile.intra
    rows = [(f"flops[{d}]", f"{f / 1e9:.2f} GFLOP/s", "large products' rate / matmul_efficiency") for d, f in p.flops]
    rows += [
        ("matmul_efficiency", f"{p.matmul_efficiency:.3f}", "float32 asymptote / best float32 product"),
        ("matmul_half", f"{p.matmul_half:.3g} FLOPs", "float32 product reaching half the asymptote"),
        ("fused_efficiency", f"{p.fused_efficiency:.3f}",
         "fused FLOPs of no known shape: the median forward attention call / flops[float32]"),
        ("memory_bandwidth", f"{p.memory_bandwidth / 1e9:.2f} GB/s", "streaming copy / add into a kept tensor"),
        ("memory_efficiency", f"{p.memory_efficiency:.3f}",
         "a 192-wide Llama's other ops as its step runs them / that (without it: fresh add, mul, scale)"),
        ("cache", f"{p.cache / (1 << 20):.1f} MiB", "last-level cache the OS reports / cores sharing it"),
        ("cache_bandwidth", f"{p.cache_bandwidth / 1e9:.2f} GB/s",
         "streaming copy / add into kept tensors that fit in it three at a time"),
        ("host_per_op", f"{p.host_per_op * 1e6:.2f} us", "a compiled model's forward and backward, per op"),
        ("host_per_update_op", f"{p.update_host * 1e6:.2f} us", "its update (AdamW on DTensors), per op"),
        ("host_overlaps", str(p.host_overlaps), "CPU ranks compute on the host"),
        ("cores", f"{p.cores:g}", "products: the work N ranks did at once, in ranks alone (median over N)"),
        ("comm_oversubscription", f"{p.comm_oversubscription:.2f}",
         "one curve for every N: x (N/cores)^this; with by_ranks, x (N/largest N measured)^this past it"),
        *((f"sharing[{w}, {n}]", f"{v:.3f}", "each of N ranks' speed at once, over alone") for w, n, v in p.sharing),
        *((f"drift[{n}]", f"{v * 1e3:.3f} ms", "a collective waits sqrt(this x compute since the last)")
          for n, v in p.drift),
        *((f"link {link.name}: by_ranks[{n}, {k}]", f"{a * 1e6:.1f} us, {b / 1e9:.3f} GB/s",
           "alpha per step, bus bandwidth: measured with N ranks on the host (what the planner reads)")
          for n, k, a, b in link.by_ranks),
        (f"link {link.name}: alpha", f"{link.alpha * 1e6:.1f} us", "one curve for every N: per step (all-reduce's)"),
        (f"link {link.name}: bandwidth", f"{link.bandwidth / 1e9:.3f} GB/s", "the fastest kind's bus bandwidth"),
    ]
    rows += [(f"  alphas[{k}]", f"{v * 1e6:.1f} us", "its latency per step") for k, v in link.alphas]
    rows += [(f"  efficiency[{k}]", f"{v:.3f}", "its bus bandwidth / that") for k, v in link.efficiency]
    return Table("device profile (DeviceProfile)", ("field", "value", "how"), rows, p.source)


_MATMUL_COLUMNS = ("dtype", "shape, layout", "sizes", "smallest FLOPs: GFLOP/s", "largest FLOPs: GFLOP/s",
                   "fitted/measured median (range)")  # fmt: skip


def _matmul(cal) -> Table:
    rows = []
    for dtype, fit in cal.fits["matmul"].items():
        groups = defaultdict(list)
        for family, layout, f, t, fitted in fit["points"]:
            groups[(family, layout)].append((f, t, fitted))
        for (family, layout), pts in groups.items():
            pts.sort()
            (f0, t0, _), (f1, t1, _) = pts[0], pts[-1]
            rows.append((dtype, f"{family} {layout}", len(pts), f"{f0:.1e}: {_g(f0 / t0)}", f"{f1:.1e}: {_g(f1 / t1)}",
                         _ratios([(t, fitted) for _, t, fitted in pts])))  # fmt: skip
    fits = "; ".join(f"{d} {f['rate'] / 1e9:.1f} GFLOP/s, half {f['half']:.2g}" for d, f in cal.fits["matmul"].items())
    return Table(
        "matrix products on one rank (one thread): GFLOP/s at the smallest and largest size",
        _MATMUL_COLUMNS,
        rows,
        f"fitted (f + half) / rate: {fits}. nn: a @ b; nt: x @ W.T (F.linear); tn: dY.T @ x (weight gradient)",
    )


def _memory_host(cal) -> Table:
    m = cal.measurements
    sizes = sorted({numel for _, numel, *_ in m["memory"]})
    rate = {(op, numel): nbytes / t for op, numel, t, _, nbytes in m["memory"]}
    ops = dict.fromkeys(op for op, *_ in m["memory"])
    rows = [(f"elementwise {op}, GB/s", *(f"{rate[(op, n)] / 1e9:.2f}" for n in sizes)) for op in ops]
    what = {"op": "tiny x + y, no autograd", "matmul": "tiny torch.mm, no autograd",
            "op_grad": "tiny x * y under autograd", "backward_op": "backward, per op of a chain"}  # fmt: skip
    pad = ("",) * (len(sizes) - 1)
    rows += [(f"host: {what.get(k, k)}, us", f"{v[0] * 1e6:.2f}", *pad) for k, v in m["host"].items()]
    runtime = {"graph_op": "compiled model, forward + backward, per op", "update_op": "its update, per op"}
    rows += [(f"host: {runtime[k]}, us", f"{v[0] * 1e6:.2f}", *pad) for k, v in m.get("runtime", {}).items()
             if k in runtime]  # fmt: skip
    return Table(
        "memory traffic and host time on one rank",
        ("benchmark", *(f"{human_bytes(4 * n)} tensors" for n in sizes)),
        rows,
        "copy, add_out: kept tensors; add, mul, scale: a new tensor each call, as a model makes them",
    )


def _cores(cal) -> Table:
    busy, p = cal.measurements["busy"], cal.profile
    alone = busy["1"]
    rows = []
    for n, b in sorted(busy.items(), key=lambda kv: int(kv[0])):
        k = int(n)
        speed = {what: alone[what][0] / b[what][0] for what in ("matmul", "memory", "host")}
        lock = cal.measurements.get("lockstep", {}).get(n, {})
        lock = "; ".join(f"{1e3 * t['busy'][0]:.1f} + {1e3 * t['collective'][0]:.2f} -> {1e3 * t['both'][0]:.1f} "
                         f"({1e3 * p.lockstep_wait(k, t['busy'][0], 1):.1f})" for t in lock.values()) or "-"
        rows.append((k, *(f"{v:.3f} ({p.share(k, what):.3f})" for what, v in speed.items()),
                     f"{k * speed['matmul']:.2f}", lock))  # fmt: skip
    return Table(
        "N ranks computing at once: each one's speed against one rank alone (the slowest rank; the profile's "
        f"`share` in brackets: the rows measured, min(1, {p.cores:g}/N) without them)",
        ("N", "products", "fresh a + b", "tiny ops (host)", "products: N x speed",
         "lockstep ms: segment + all-reduce -> alternating"),  # fmt: skip
        rows,
        "products: fp32 x @ W.T of 512x512 by 2048x512; fresh a + b of 64 MiB; tiny x * y under autograd; "
        "lockstep: 2, 10 and 40 products of 256x256 then a 1 KiB all-reduce, per round (the wait "
        "`lockstep_wait` predicts for one such round in brackets, ms)",
    )


_COMM_COLUMNS = ("kind", "ranks", "smallest", "largest", "payload GB/s (largest)", "fitted/measured median (range)",
                 "median/fastest batch (max)")  # fmt: skip


def _collectives(cal) -> Table:
    link = cal.fits["link"]
    groups = defaultdict(list)
    fastest = {tuple(p[:3]): p[3] for p in cal.measurements["collectives"]}
    for kind, n, nbytes, t, fitted in link["points"]:  # t: the median batch, which the link is fitted to
        groups[(kind, n)].append((nbytes, t, fitted, t / fastest[(kind, n, nbytes)]))
    rows = []
    for (kind, n), pts in sorted(groups.items()):
        pts.sort()
        (b0, t0, *_), (b1, t1, *_) = pts[0], pts[-1]
        rows.append((kind, n, f"{human_bytes(b0)}: {t0 * 1e3:.3f} ms", f"{human_bytes(b1)}: {t1 * 1e3:.1f} ms",
                     f"{b1 / t1 / 1e9:.3f}", _ratios([(t, f) for _, t, f, _ in pts]),
                     f"{max(p[3] for p in pts):.2f}"))  # fmt: skip
    return Table(
        "collectives (gloo, this host): time per call, the slowest rank, the median batch",
        _COMM_COLUMNS,
        rows,
        "fitted: steps x alpha + bus bytes / bandwidth, per kind and N ranks on the host (by_ranks); "
        "payload as a plan counts it (all-gather: the gathered result)",
    )
