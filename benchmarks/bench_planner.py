"""The planner against measurement on this machine, against exhaustive search, and at the field's scale.

    python benchmarks/bench_planner.py cpu          # (a) predicted vs measured step time and peak, gloo ranks
    python benchmarks/bench_planner.py hf           # (a') the same for transformers' Llama, Qwen2 and GPT-2
    python benchmarks/bench_planner.py cpu --installed-profile   # (a) on the installed profile, not a fresh one
    python benchmarks/bench_planner.py exhaustive   # (b) the search's best vs the exhaustive best
    python benchmarks/bench_planner.py scale        # (c) Llama-3-405B on 16,384 H100s, DeepSeek-V3 on 2,048
    python benchmarks/bench_planner.py all

(a) For each configuration of a bundled model on 4 and 8 gloo ranks: the plan compiled on the meta device
    (its dry run counts every op each rank runs) predicts the step on the calibrated CPU profile
    (`meshlib.predict_plan(plan, "cpu")`), and its dry run predicts the peak per rank; the same configuration
    then trains on real ranks (`planner_worker.measure`: warm-up steps, then timed steps, the slowest rank's
    each; the peak by `PeakTracker`). The measured step is the fastest timed one, as the calibration reads
    the fastest batch of each one-rank micro-benchmark (other processes only ever add time; a step, like the
    collectives' median batch, already sums tens of calls); the median is beside it. Reported: each error,
    the mean and largest, and the Spearman correlation of the two rankings.
    The profile is calibrated first, in the same run (`meshlib calibrate --ranks 2,4,8` into a temporary
    `$MESHLIB_PROFILE_DIR`, about 2.5 minutes): this machine's speed drifts by 5-10% over hours, and a
    profile measured at another time carries that drift into every row. `--installed-profile` skips it.
(a') As (a), for transformers' Llama, Qwen2 and GPT-2 built from small configs with random weights (no
    download; `planner_worker.hf_model`, the tests' builders and rules): models meshlib did not write.
(b) For small spaces (dense and MoE, short and long sequences), `meshlib.planner(...)[0]` against the best of
    `search(..., exhaustive=True)` under the same cost model.
(c) The search and the winner's full per-rank plan (compiled on an abstract mesh, meta device) for the
    Llama-3-405B shape on 16,384 H100s and the DeepSeek-V3 shape on 2,048 H100s: wall time and the plan.

Prints markdown tables; the results live in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import planner_worker
import torch
from machine import describe

from meshlib import Mesh, device_profile, predict_plan
from meshlib.planner import search
from meshlib.transformer import ModelShape
from meshlib_torch import compile_model, data, models, torch_runtime
from meshlib_torch.testing.pool import get_pool

MiB, GiB = 2**20, 2**30

LLAMA = ("llama-small", {})
GPT = ("gpt-small", {})
MOE = ("moe-tiny", {"dim": 128, "n_layers": 4, "hidden_dim": 256, "moe_hidden_dim": 128, "max_seq_len": 256})

# (model, mesh, options): 4 and 8 ranks, every parallelism the planner chooses between
CONFIGS = [
    (LLAMA, "dp=4", {}),
    (LLAMA, "dp=4", {"zero": 1}),
    (LLAMA, "dp=4", {"zero": 3}),
    (LLAMA, "tp=4", {"sequence_parallel": True}),
    (LLAMA, "dp=2,tp=2", {}),
    (LLAMA, "pp=4", {"microbatches": 4, "schedule": "1f1b"}),
    (LLAMA, "pp=2,dp=2", {"microbatches": 4, "schedule": "gpipe"}),
    (LLAMA, "pp=2,tp=2", {"microbatches": 4, "schedule": "zb-h1"}),
    (LLAMA, "cp=4", {}),
    (MOE, "ep=4", {}),
    (GPT, "dp=4", {"zero": 2, "recompute": "block"}),
    (LLAMA, "dp=8", {}),
    (LLAMA, "dp=2,tp=2,pp=2", {"microbatches": 4, "sequence_parallel": True}),
    (LLAMA, "pp=2,cp=2,tp=2", {"microbatches": 2}),
    (MOE, "dp=2,ep=4", {"zero": 1}),
    (LLAMA, "dp=4,cp=2", {"zero": 3, "cp_method": "all-gather"}),
]
BATCH, SEQ = 8, 128
# transformers' models (planner_worker.HF_SIZES: 256 wide, 4 layers, GQA 8/4 heads; GPT-2 as wide)
HF_CONFIGS = [
    ("Llama", "dp=4", {}),
    ("Llama", "dp=4", {"zero": 3}),
    ("Llama", "tp=4", {"sequence_parallel": True}),
    ("Llama", "dp=2,tp=2", {}),
    ("Llama", "pp=2,dp=2", {"microbatches": 4, "schedule": "1f1b"}),
    ("Qwen2", "dp=4", {"zero": 1}),
    ("gpt2", "dp=4", {}),
    ("gpt2", "dp=2,tp=2", {}),
]


def markdown(header: tuple, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in body])


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


# -- (a) --------------------------------------------------------------------------------------------------
def planned(model: tuple, mesh: str, options: dict, profile, **extra):
    name, overrides = model
    options = {**options, **extra}
    cfg = models.config(name, **overrides)
    m = Mesh.parse(mesh)
    example = data.batch(0, batch_size=BATCH, seq_len=SEQ)
    compiled = compile_model(models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=example,
                             estimate_memory=True, **options)  # fmt: skip
    plan = compiled.plan
    return plan, predict_plan(plan, profile)


def bench_cpu(quick: bool) -> None:
    print("## (a) predicted vs measured on gloo ranks\n")
    runs = []
    for model, mesh, options in CONFIGS[::3] if quick else CONFIGS:
        job = (planner_worker.measure, model[0], model[1], mesh, BATCH, SEQ, options, 2, 3 if quick else 7)
        runs.append((model[0], mesh, options, lambda p, model=model, mesh=mesh, options=options, **kw: planned(
            model, mesh, options, p, **kw), job))
    _against_ranks(runs)


def bench_hf(quick: bool) -> None:
    """transformers' Llama, Qwen2 and GPT-2 (models meshlib did not write), as (a)."""
    print("## (a') transformers' models, predicted vs measured on gloo ranks\n")
    runs = []
    for family, mesh, options in HF_CONFIGS[::3] if quick else HF_CONFIGS:
        job = (planner_worker.measure_hf, family, mesh, BATCH, SEQ, options, 2, 3 if quick else 7)
        runs.append((family, mesh, options, lambda p, family=family, mesh=mesh, options=options, **kw: planned_hf(
            family, mesh, options, p, **kw), job))
    _against_ranks(runs)


def planned_hf(family: str, mesh: str, options: dict, profile, **extra):
    options = {**options, **extra}
    m = Mesh.parse(mesh)
    plan = compile_model(planner_worker.hf_model(family), mesh=m, rules=planner_worker.hf_rules(family, m),
                         example_kwargs=planner_worker.hf_batch(0, BATCH, SEQ), estimate_memory=True,
                         **options).plan  # fmt: skip
    return plan, predict_plan(plan, profile)


def _against_ranks(runs: list) -> None:
    """Each run `(model, mesh, options, plan of the profile, rank job)`: the plan's prediction, then the job on
    real ranks; the table, each error, and the Spearman correlation of the two rankings."""
    profile = device_profile("cpu")
    print(f"profile: {profile.name} ({profile.source})\n")
    rows, preds, meas, mem_errs, loads = [], [], [], [], []
    for name, mesh, options, plan_of, job in runs:
        plan, pred = plan_of(profile)
        n = Mesh.parse(mesh).size
        got = get_pool(n).run(*job)
        measured, median = min(got[0]["times"]), got[0]["median"]
        peaks = [g["peak"] for g in got]
        coords = [Mesh.parse(mesh).coords(r) for r in range(n)]
        planned_peaks = [plan.rank_memory(c.get(plan.pp_axis) if plan.stages else None).peak for c in coords]
        mem_err = max(abs(p / q - 1) for p, q in zip(peaks, planned_peaks))
        load = measured_load(mesh, [g["routing"] for g in got])
        if load is not None:  # the plan at the routing the ranks measured: its busiest rank against theirs
            loaded, _ = plan_of(profile, expert_load=load)
            busiest = max(loaded.rank_memory(c.get(loaded.pp_axis) if loaded.stages else None).peak for c in coords)
            loads.append((name, mesh, f"{load:.2f}", f"{max(planned_peaks) / MiB:.1f}", f"{busiest / MiB:.1f}",
                          f"{max(peaks) / MiB:.1f}", f"{max(peaks) / max(planned_peaks) - 1:+.1%}",
                          f"{max(peaks) / busiest - 1:+.1%}"))  # fmt: skip
        err = pred.step_time / measured - 1
        preds.append(pred.step_time)
        meas.append(measured)
        mem_errs.append(mem_err)
        what = ", ".join(f"{k}={v}" for k, v in options.items())
        parts = " / ".join(f"{1e3 * t:.0f}" for t in (pred.compute, pred.comm, pred.bubble, pred.optimizer))
        rows.append((name, mesh, what or "-", f"{pred.step_time:.3f}", parts, f"{measured:.3f}", f"{median:.3f}",
                     f"{err:+.0%}",
                     f"{max(planned_peaks) / MiB:.1f}", f"{max(peaks) / MiB:.1f}", f"{mem_err:.1%}"))  # fmt: skip
        print(rows[-1], flush=True)
    errs = [abs(p / m - 1) for p, m in zip(preds, meas)]
    print()
    print(markdown(("model", "mesh", "options", "predicted s", "compute / comm / bubble / update ms", "measured s",
                    "median s", "error", "plan peak MiB",
                    "measured peak MiB", "peak error (worst rank)"), rows))  # fmt: skip
    print(f"\nSpearman {spearman(preds, meas):.3f}; step error mean {statistics.mean(errs):.1%}, max {max(errs):.1%}; "
          f"peak error mean {statistics.mean(mem_errs):.1%}, max {max(mem_errs):.1%}")
    if loads:
        print("\nMoE rows planned at the routing the ranks measured (`expert_load`), busiest rank:\n")
        print(markdown(("model", "mesh", "measured load", "even plan MiB", "plan at the load MiB", "measured MiB",
                        "error, even plan", "error, plan at the load"), loads))  # fmt: skip


def measured_load(mesh: str, routing: list[dict]) -> float | None:
    """The `expert_load` of the busiest ep rank from each rank's tokens per expert (per router, in the tracked
    step): the ranks that exchange tokens (one coordinate of every axis but ep) send each ep rank the pairs
    for its experts; a rank's load in a layer is what it receives over the mean, and its memory follows its
    load averaged over the layers (every layer keeps its rows for backward). None without routers."""
    m = Mesh.parse(mesh)
    if "ep" not in m.axis_names or not routing or not routing[0]:
        return None
    ep = m.axis_size("ep")
    groups: dict = {}
    for r, counts in enumerate(routing):
        key = tuple((a, i) for a, i in m.coords(r).items() if a != "ep")
        groups.setdefault(key, []).append(counts)
    busiest = 0.0
    for ranks in groups.values():
        per_rank = [0.0] * ep
        for name in ranks[0]:
            total = [sum(c[name][e] for c in ranks) for e in range(len(ranks[0][name]))]
            share = len(total) // ep
            got = [sum(total[j * share : (j + 1) * share]) for j in range(ep)]
            mean = sum(got) / ep
            for j in range(ep):
                per_rank[j] += got[j] / mean / len(ranks[0])
        busiest = max(busiest, *per_rank)
    return max(1.0, busiest)


# -- (b) --------------------------------------------------------------------------------------------------
LLAMA_1B = ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, gated=True, norm="rmsnorm")
LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, gated=True, norm="rmsnorm")
GPT_350M = ModelShape(layers=24, hidden=1024, heads=16, ffn=4096, vocab=50304, bias=True, tied=True, positions=2048)
MIXTRAL = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, gated=True, norm="rmsnorm",
                     experts=8, top_k=2)  # fmt: skip
MOE_SMALL = ModelShape(layers=12, hidden=1024, heads=16, ffn=4096, vocab=32000, gated=True, norm="rmsnorm", experts=16,
                       top_k=2, moe_ffn=1024)  # fmt: skip
CASES = [
    ("gpt-350m, 8 A100, seq 2k", GPT_350M, 8, 64, 2048, "a100"),
    ("llama-1b, 8 A100, seq 4k", LLAMA_1B, 8, 32, 4096, "a100"),
    ("llama-1b, 16 H100, seq 32k", LLAMA_1B, 16, 16, 32768, "h100"),
    ("llama-8b, 16 A100, seq 4k", LLAMA_8B, 16, 64, 4096, "a100"),
    ("llama-8b, 32 H100, seq 8k", LLAMA_8B, 32, 64, 8192, "h100"),
    ("llama-8b, 16 H100, seq 64k", LLAMA_8B, 16, 16, 65536, "h100"),
    ("moe-small, 8 A100, seq 2k", MOE_SMALL, 8, 64, 2048, "a100"),
    ("moe-small, 16 H100, seq 16k", MOE_SMALL, 16, 32, 16384, "h100"),
    ("mixtral, 32 H100, seq 4k", MIXTRAL, 32, 64, 4096, "h100"),
    ("mixtral, 64 A100, seq 8k", MIXTRAL, 64, 64, 8192, "a100"),
]


def bench_exhaustive() -> None:
    print("## (b) the search's best against the exhaustive best, one cost model\n")
    rows, gaps = [], []
    for label, shape, devices, batch, seq, prof in CASES:
        t0 = time.perf_counter()
        fast = search(shape, devices=devices, batch=batch, seq=seq, profile=prof, top=1)[0]
        t1 = time.perf_counter()
        full = search(shape, devices=devices, batch=batch, seq=seq, profile=prof, top=1, exhaustive=True)[0]
        t2 = time.perf_counter()
        gap = fast.prediction.step_time / full.prediction.step_time - 1
        gaps.append(gap)
        rows.append((label, _describe(fast), f"{fast.prediction.step_time:.4g}", _describe(full),
                     f"{full.prediction.step_time:.4g}", f"{gap:.1%}", f"{t1 - t0:.1f} / {t2 - t1:.1f}"))  # fmt: skip
        print(rows[-1], flush=True)
    print()
    print(markdown(("case", "search's best", "step s", "exhaustive best", "step s", "gap", "time s (search / all)"),
                   rows))  # fmt: skip
    print(f"\nlargest gap {max(gaps):.2%}")


def _describe(c) -> str:
    cfg = c.config
    extra = [f"zero{cfg.zero}", cfg.recompute, f"mb{cfg.microbatch}"]
    if cfg.pp > 1:
        extra.append(cfg.schedule + (f" v{cfg.chunks}" if cfg.chunks > 1 else ""))
    if cfg.cp > 1:
        extra.append(cfg.cp_method)
    return f"{c.mesh} ({', '.join(extra)})"


# -- (c) --------------------------------------------------------------------------------------------------
def bench_scale() -> None:
    from meshlib_torch.planner import compile_candidate, model_shape

    print("## (c) at the field's scale\n")
    rows = []
    for name, devices, batch, seq in (("llama-405b", 16384, 2048, 8192), ("deepseek-v3", 2048, 4096, 4096)):
        model = models.build(name)
        t0 = time.perf_counter()
        found = search(model_shape(model), devices=devices, batch=batch, seq=seq, profile="h100", top=5,
                       runtime=torch_runtime())
        t1 = time.perf_counter()
        best = found[0]
        cfg = models.config(name)
        plan = compile_candidate(model, best, rules=lambda mesh, cfg=cfg: models.default_rules(cfg, mesh), batch=batch,
                                 seq=seq, profile="h100")  # fmt: skip
        t2 = time.perf_counter()
        p = plan.prediction
        rows.append((f"{name} on {devices:,} H100", _describe(best), f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
                     f"{best.prediction.step_time:.3f} / {p.step_time:.3f}", f"{best.prediction.mfu:.1%} / {p.mfu:.1%}",
                     f"{best.prediction.memory / GiB:.1f} / {p.memory / GiB:.1f}"))  # fmt: skip
        print(rows[-1], flush=True)
        print("\n".join("  - " + w for w in best.why))
    print()
    print(markdown(("setup", "search's best", "search s", "full plan s", "step s (closed form / plan)",
                    "MFU (closed form / plan)", "GiB per rank (closed form / dry run)"), rows))  # fmt: skip


def calibrate_beside() -> None:
    """Calibrate the CPU profile now, into a temporary `$MESHLIB_PROFILE_DIR` that `device_profile("cpu")`
    then reads: the predictions and the measured steps side by side, in one run."""
    os.environ["MESHLIB_PROFILE_DIR"] = folder = tempfile.mkdtemp(prefix="meshlib-profile-")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from meshlib.cli import main; main(sys.argv[1:])",
                    "calibrate", "--ranks", "2,4,8", "--out", os.path.join(folder, "cpu.json")],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    print(f"calibrated the CPU profile in this run ({time.perf_counter() - started:.0f} s): {folder}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("cpu", "hf", "exhaustive", "scale", "all"))
    ap.add_argument("--quick", action="store_true", help="(a): a third of the configurations, fewer steps")
    ap.add_argument("--installed-profile", action="store_true",
                    help="(a), (a'): predict on the installed CPU profile instead of calibrating one first")
    args = ap.parse_args()
    print(describe(), "\n")
    torch.set_num_threads(1)
    if args.part in ("cpu", "hf", "all") and not args.installed_profile:
        calibrate_beside()
    if args.part in ("cpu", "all"):
        bench_cpu(args.quick)
    if args.part in ("hf", "all"):
        bench_hf(args.quick)
    if args.part in ("exhaustive", "all"):
        bench_exhaustive()
    if args.part in ("scale", "all"):
        bench_scale()


if __name__ == "__main__":
    main()
