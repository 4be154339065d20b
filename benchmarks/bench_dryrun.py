"""A dry run at scale: the plan of a Llama-3-405B-shaped model on 1,024 to 16,384 ranks, on one CPU.

    python benchmarks/bench_dryrun.py             # 1,024 .. 16,384 ranks, 3 runs each, alternated

Each run is a fresh process doing what `meshlib plan --model llama-405b --mesh
dp=N,pp=16,tp=8 --batch 16N --seq 8192 --microbatches 16 --precision bf16 --zero 1`
does: build the model on the meta device and compile the whole plan, with the
dry run's per-rank peak (`estimate_memory`). It reports the wall time of the
whole process's work and its peak resident memory (`ru_maxrss`), and the plan's
per-rank figures of the most loaded rank. The mesh grows along dp alone: one
sequence per microbatch on every dp rank, so the per-rank graph is the same size
at every scale, which is what a dry run should show (time independent of ranks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from machine import describe

_CHILD = """
import json, resource, sys, time
t = time.perf_counter()
import torch
from meshlib import Mesh
from meshlib_torch import compile_model
from meshlib_torch.models import build, default_rules
dp = int(sys.argv[1])
mesh = Mesh(dp=dp, pp=16, tp=8)
model = build("llama-405b")
x = torch.empty(16 * dp, 8192, dtype=torch.long, device="meta")
c = compile_model(model, mesh=mesh, rules=default_rules("llama-405b", mesh), example_inputs=(x, x.clone()),
                  microbatches=16, precision="bf16", zero=1, estimate_memory=True)
m = c.plan.memory
print(json.dumps({
    "seconds": time.perf_counter() - t, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "ranks": mesh.size, "params": m.params, "optimizer": m.optimizer, "peak": m.peak,
    "comm": c.plan.comm_bytes(),
}))
"""

GIB = 1024**3


def once(dp: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(dp)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    dps = (8, 16, 32, 64, 128)
    samples: dict[int, list] = {dp: [] for dp in dps}
    for _ in range(args.runs):
        for dp in dps:
            samples[dp].append(once(dp))
    print(describe())
    print()
    print("| ranks | mesh | time s (median) | peak RSS GiB (max) | params/rank GiB | optimizer/rank GiB "
          "| peak/rank GiB (dry run) | collectives/rank/step GiB |")
    print("|---|---|---|---|---|---|---|---|")
    base = statistics.median(s["seconds"] for s in samples[dps[0]])
    for dp in dps:
        s = samples[dp]
        med = statistics.median(x["seconds"] for x in s)
        r = s[0]
        print(
            f"| {r['ranks']:,} | dp={dp},pp=16,tp=8 | {med:.1f} ({med / base:.2f}x) | "
            f"{max(x['rss'] for x in s) / GIB:.2f} | {r['params'] / GIB:.2f} | {r['optimizer'] / GIB:.2f} | "
            f"{r['peak'] / GIB:.1f} | {r['comm'] / GIB:.1f} |"
        )
    print(f"\n({args.runs} runs each, alternated; time and memory of the whole process, imports included)")


if __name__ == "__main__":
    main()
