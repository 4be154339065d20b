"""ZeRO-0/1/2/3: bytes, model state and peak memory against the closed forms, and step time against FSDP2.

    python benchmarks/bench_zero.py                 # everything, about 2 min on 2 cores
    python benchmarks/bench_zero.py --quick         # fewer rounds, no dp=2 race: a smoke test

Prints seven markdown tables:

(a) data-parallel bytes per rank per step for zero 0/1/2/3 on `Mesh(dp=4)`
    (`llama-small`, fp32), counted at meshlib's collective layer (`COUNTER`) on
    real gloo ranks, in ring bus bytes (an all-reduce 2(n-1)/n of its payload,
    the others (n-1)/n), without the loss's own forward all-reduces; beside
    the closed form `dp_comm_bytes` and the plan's own records.
(b) model state per rank for `llama-1b` on an abstract `Mesh(dp=8)` in bf16
    (no processes): the plan's params/grads/optimizer against the closed
    forms (`zero_memory`) and FSDP2's storage (`fsdp2_memory`), then the
    dry run's peak per level, with and without block recompute.
(c) the dry run's peak estimate against the peak measured on the ranks over
    one forward + backward (max over ranks) for `llama-tiny` on
    `Mesh(dp=2, tp=2)`, counted by `PeakTracker` as the tests use it (it keys
    live bytes by storage and also sees FSDP2 free and re-allocate its gathered
    parameters with `storage.resize_`, which no dispatch mode sees).
(d) step time of meshlib's `parallelize(..., zero=3)` against the same model
    with `fully_shard` per block and on the root, alternated, median of rounds.
(e) the same for ZeRO-0 against torch's DistributedDataParallel (default
    buckets), with meshlib summing each gradient alone beside them.
(f) the same for ZeRO-1 (its reduce-scatters and all-gathers in buckets)
    against DDP, with meshlib moving each parameter alone beside them.
(g) ZeRO-1 clipped to a global norm: the norm from the reduce-scattered
    pieces (one scalar all-reduce) and from the gradients each all-reduced,
    against no clipping, one model stepped the three ways, alternated.

The rank-side jobs are in `benchmarks/zero_worker.py` (a RankPool pickles
them by qualified name, so they cannot live in this script).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import defaultdict

import torch
import zero_worker
from machine import busy_ticks, describe, ticks_of

from meshlib import Mesh, Precision, dp_comm_bytes, fsdp2_memory, zero_memory
from meshlib_torch import compile_model, data, models
from meshlib_torch.testing.pool import get_pool

BUS = {"all_reduce": 2.0}  # ring bus factor; every other kind moves 1x its payload's (n-1)/n
MiB, GiB = 2**20, 2**30
TOLERANCE = 1e-5  # first-step losses, meshlib against fully_shard


def markdown(header: tuple, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in body])


def bus(kind: str, nbytes: float, n: int) -> float:
    return BUS.get(kind, 1.0) * nbytes * (n - 1) / n


# -- (a) bytes ------------------------------------------------------------------------------------
def sync_traffic(result: dict, n: int) -> tuple[dict, dict, int]:
    """(counted, planned) dp gradient-sync payload by (phase, kind), and the loss's counted bytes left out."""
    counted, planned, loss = defaultdict(int), defaultdict(int), 0
    for phase, kind, axis, where, nbytes in result["counted"]:
        if axis != "dp":
            continue
        if where.startswith(zero_worker.LOSS):
            loss += nbytes
        else:
            counted[(phase, kind)] += nbytes
    for phase, kind, axes, op, nbytes, _group in result["planned"]:
        if op in ("grad sync", "param gather") and axes == ["dp"]:  # ZeRO-2/3 gather parameters
            planned[(phase, kind)] += nbytes
    return dict(counted), dict(planned), loss


SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def _phase_order(key):
    return ("forward", "backward", "optimizer").index(key[0]), key[1]


def table_bytes(model: str, batch: int, seq: int, n: int = 4) -> str:
    pool = get_pool(n)
    rows, base, base_closed, loss_bytes = [], None, None, set()
    for zero in (0, 1, 2, 3):
        result = pool.run(zero_worker.comm_bytes, model, f"dp={n}", zero, batch, seq, timeout=600)[0]
        counted, planned, loss = sync_traffic(result, n)
        loss_bytes.add(loss)
        measured = sum(bus(kind, b, n) for (_, kind), b in counted.items())
        predicted = sum(bus(kind, b, n) for (_, kind), b in planned.items())
        closed = dp_comm_bytes(result["psi"] * 4, n, zero=zero)
        base, base_closed = base or measured, base_closed or closed
        moved = " + ".join(f"{SHORT[ph]} {k.replace('_', '-')}" for (ph, k) in sorted(counted, key=_phase_order))
        rows.append((
            zero, f"{measured / MiB:.2f}", f"{measured / base:.2f}", f"{closed / base_closed:.2f}",
            f"{measured / closed:.3f}", f"{predicted / MiB:.2f}", "yes" if counted == planned else "**no**", moved,
        ))  # fmt: skip
    header = ("zero", "measured MiB", "/ zero 0", "closed form / zero 0", "measured / closed form", "plan MiB",
              "plan = measured (per phase and kind)", "what moves")  # fmt: skip
    left_out = f"the loss's own forward all-reduces, left out: {sorted(loss_bytes)} bytes"
    note = f"Ψ = {result['psi']:,} parameters (fp32); {left_out}"
    return markdown(header, rows) + "\n\n" + note


# -- (b) model state and peak for 1B, no processes --------------------------------------------------
def compile_abstract(
    model: str, mesh: Mesh, batch: int, seq: int, *, zero: int, recompute: str = "none", precision="bf16"
):
    cfg = models.config(model)
    example = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    return compile_model(
        models.build(cfg), mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=example, zero=zero,
        recompute=recompute, precision=Precision.parse(precision), estimate_memory=True,
    )  # fmt: skip


def _gib(*values) -> list[str]:
    return [f"{v / GiB:.2f}" for v in values]


def table_memory(model: str, n: int, batch: int, seq: int) -> tuple[str, str]:
    mesh = Mesh(dp=n)
    state_rows, peak_rows = [], []
    for zero in (0, 1, 2, 3):
        plain = compile_abstract(model, mesh, batch, seq, zero=zero)
        block = compile_abstract(model, mesh, batch, seq, zero=zero, recompute="block")
        psi = sum(math.prod(plain.local_param_shape(p)) for p in plain.traced.params)
        m = plain.plan.memory
        ours = (m.params, m.grads, m.optimizer, m.params + m.grads + m.optimizer)
        design = zero_memory(psi, n, zero=zero)
        refs = [("closed form (DeepSpeed)", design)] + ([("FSDP2 storage", fsdp2_memory(psi, n))] if zero >= 2 else [])
        state_rows.append((zero, "**meshlib plan**", *_gib(*ours), f"{ours[3] / psi:.2f}"))
        for name, ref in refs:
            same = "= plan" if (ref.params, ref.grads, ref.optimizer) == ours[:3] else "differs"
            parts = _gib(ref.params, ref.grads, ref.optimizer, ref.total)
            state_rows.append((zero, f"{name}, {same}", *parts, f"{ref.total / psi:.2f}"))
        rest = m.peak - m.activations
        b = block.plan.memory
        peak_rows.append((zero, *_gib(rest, m.activations, m.peak, b.activations, b.peak), f"{b.peak / m.peak:.2f}"))
    header = ("zero", "source", "params GiB", "grads GiB", "optimizer GiB", "total GiB", "bytes / param")
    peak_header = ("zero", "at rest (state, buffers) GiB", "step extra GiB", "peak GiB", "step extra, block GiB",
                   "peak, recompute=block GiB", "block / none")  # fmt: skip
    note = f"Ψ = {psi:,} parameters; 16Ψ/N = {16 * psi / n / GiB:.2f} GiB"
    return markdown(header, state_rows) + "\n\n" + note, markdown(peak_header, peak_rows)


# -- (c) peak estimate against measured --------------------------------------------------------------
PEAK_CASES = [(z, r, False) for z in (0, 1, 2, 3) for r in ("none", "block")] + [(1, "none", True), (3, "block", True)]


def table_peak(model: str, mesh: str, batch: int, seq: int) -> tuple[str, list]:
    """The dry-run estimate against the peak `PeakTracker` counts on the ranks (max over ranks)."""
    m = Mesh.parse(mesh)
    pool = get_pool(m.size)
    rows, misses = [], []
    for zero, recompute, sp in PEAK_CASES:
        per_rank = pool.run(zero_worker.peak, model, mesh, batch, seq, zero, recompute, sp, timeout=600)
        high, low = max(per_rank), min(per_rank)
        cfg, example = models.config(model), data.batch(0, batch_size=batch, seq_len=seq)
        compiled = compile_model(
            models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=example, zero=zero,
            recompute=recompute, sequence_parallel=sp, estimate_memory=True,
        )  # fmt: skip
        estimate = compiled.plan.memory.peak
        if abs(estimate / high - 1) > 0.05:
            misses.append((f"zero={zero}", recompute, f"sp={sp}", round(estimate / high, 3)))
        spread = f"{high / 1024:.1f}" if low == high else f"{low / 1024:.1f} - {high / 1024:.1f}"
        rows.append(
            (zero, recompute, "on" if sp else "off", f"{estimate / 1024:.1f}", spread, f"{estimate / high:.3f}")
        )
    header = ("zero", "recompute", "SP", "estimate KiB", "measured KiB (ranks: min - max)", "estimate / measured max")
    return markdown(header, rows), misses


# -- (d) step time against fully_shard, (e) against DDP -------------------------------------------------
def table_race(model: str, dps: tuple[int, ...], batch: int, seq: int, rounds: int, steps: int, zero: int = 3) -> str:
    rows = []
    native_name = "fully_shard" if zero == 3 else "DDP"  # (ZeRO-1 keeps DDP's step and traffic)
    for dp in dps:
        pool = get_pool(dp)
        before = busy_ticks(), ticks_of(pool.pids)
        r = pool.run(zero_worker.race, model, dp, batch, seq, rounds, steps, zero=zero, timeout=1200)[0]
        busy, mine = busy_ticks() - before[0], ticks_of(pool.pids) - before[1]
        native = r["losses"]["native"]
        diff = max(abs(a - b) for k, v in r["losses"].items() for a, b in zip(v, native, strict=True))
        if diff > TOLERANCE:
            raise RuntimeError(f"dp={dp}: meshlib and {native_name} take different first steps: {r['losses']}")
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        best = {k: min(v) for k, v in r["times"].items()}
        others = max(0, busy - mine) / max(busy, 1)
        alone = [f"{med['alone'] * 1e3:.1f}"] if zero < 2 else []
        rows.append((
            f"dp={dp}", f"{med['ours'] * 1e3:.1f}", *alone, f"{med['native'] * 1e3:.1f}",
            f"**{med['ours'] / med['native']:.2f}**", f"{best['ours'] / best['native']:.2f}", rounds, f"{diff:.1e}",
            f"{others:.0%}",
        ))  # fmt: skip
    alone = [f"meshlib, each {'gradient' if zero == 0 else 'parameter'} alone ms"] if zero < 2 else []
    header = ("mesh", f"meshlib zero={zero} ms", *alone, f"{native_name} ms", "meshlib / native (medians)",
              "(best rounds)", "rounds", "max loss diff, 2 steps", "CPU taken by other processes")  # fmt: skip
    return markdown(header, rows)


def table_clipping(model: str, dps: tuple[int, ...], batch: int, seq: int, rounds: int, steps: int) -> str:
    rows = []
    for dp in dps:
        pool = get_pool(dp)
        before = busy_ticks(), ticks_of(pool.pids)
        r = pool.run(zero_worker.clipping, model, dp, batch, seq, rounds, steps, timeout=1200)[0]
        busy, mine = busy_ticks() - before[0], ticks_of(pool.pids) - before[1]
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        others = max(0, busy - mine) / max(busy, 1)
        rows.append((
            f"dp={dp}", *(f"{med[k] * 1e3:.1f}" for k in ("none", "pieces", "each")),
            f"**{med['pieces'] / med['none']:.2f}**", f"{med['each'] / med['none']:.2f}", rounds, f"{others:.0%}",
        ))  # fmt: skip
    header = ("mesh", "no clipping ms", "clipped, norm from the pieces ms", "clipped, each gradient all-reduced ms",
              "pieces / none (medians)", "each / none", "rounds", "CPU taken by other processes")  # fmt: skip
    return markdown(header, rows)


# -- the run ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25, help="(d): rounds, each timing both sides, alternated")
    ap.add_argument("--steps", type=int, default=1, help="(d): steps of each side per round")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 1
    start = time.perf_counter()
    print(describe() + "\n")

    state, peaks = table_memory("llama-1b", 8, 8, 2048)
    print("(b) llama-1b on an abstract Mesh(dp=8), bf16 compute (fp32 masters), batch 8 x 2048: model state per rank\n")
    print(state + "\n")
    print("(b) dry-run peak per rank (model state at rest + the step's extra)\n")
    print(peaks + "\n")

    print("(a) data-parallel bytes per rank per step, llama-small fp32, Mesh(dp=4), batch 8 x 128 (bus bytes)\n")
    print(table_bytes("llama-small", 8, 128) + "\n")

    table, misses = table_peak("llama-tiny", "dp=2,tp=2", 8, 64)
    print("(c) peak estimate / measured, llama-tiny fp32, Mesh(dp=2, tp=2), batch 8 x 64\n")
    print(table + "\n")
    if misses:
        print(f"outside ±5%: {misses}\n")

    dps = (4,) if args.quick else (4, 2)
    per_round = f"{args.steps} step(s) of each per round"
    print(f"(d) step time, llama-small fp32, batch 8 x 128, AdamW(foreach=False); {per_round}\n")
    print(table_race("llama-small", dps, 8, 128, args.rounds, args.steps) + "\n")
    print(f"(e) step time, ZeRO-0 against DDP, llama-small fp32, batch 8 x 128; {per_round}\n")
    print(table_race("llama-small", dps, 8, 128, args.rounds, args.steps, zero=0) + "\n")
    print(f"(f) step time, ZeRO-1 against DDP, llama-small fp32, batch 8 x 128; {per_round}\n")
    print(table_race("llama-small", dps, 8, 128, args.rounds, args.steps, zero=1) + "\n")
    print(f"(g) step time of ZeRO-1 clipped to a global norm, llama-small fp32, batch 8 x 128; {per_round}\n")
    print(table_clipping("llama-small", dps, 8, 128, args.rounds, args.steps) + "\n")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"total {time.perf_counter() - start:.0f} s; load average at the end (1, 5, 15 min): {load}")


if __name__ == "__main__":
    main()
