"""Compile time on the meta device for the Llama-style 70B shape, and how it grows with depth.

    python benchmarks/bench_compile.py            # 80 and 160 layers, 5 runs each, alternated

Each run is a fresh process (no warm caches): build the model on the meta
device, then time `compile_model` on an abstract Mesh(dp=8, tp=8) with a
batch of 8 x 4096 tokens. Prints the medians, their ratio, and a markdown row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import json, sys, time, torch
from meshlib import Mesh
from meshlib_torch import compile_model
from meshlib_torch.models import build, default_rules
layers = int(sys.argv[1])
mesh = Mesh(dp=8, tp=8)
model = build("llama-70b", n_layers=layers)
x = torch.empty(8, 4096, dtype=torch.long, device="meta")
t = time.perf_counter()
c = compile_model(model, mesh=mesh, rules=default_rules("llama-70b", mesh), example_inputs=(x, x.clone()))
print(json.dumps({
    "seconds": time.perf_counter() - t, "nodes": len(c.graph.nodes), "collectives": len(c.plan.collectives),
}))
"""


def once(layers: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(layers)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    samples: dict[int, list] = {80: [], 160: []}
    for _ in range(args.runs):
        for layers in (80, 160):
            samples[layers].append(once(layers))
    med = {k: statistics.median(s["seconds"] for s in v) for k, v in samples.items()}
    print("| layers | graph nodes | collectives in plan | compile s (median) |")
    print("|---|---|---|---|")
    for k, v in samples.items():
        print(f"| {k} | {v[0]['nodes']} | {v[0]['collectives']} | {med[k]:.2f} |")
    print(f"\n160 / 80 layers: {med[160] / med[80]:.2f}  ({args.runs} runs each, alternated)")


if __name__ == "__main__":
    main()
