"""Tensor parallelism against Megatron's minimum and against torch's own `parallelize_module`.

    python benchmarks/bench_tp.py                 # tp=2 and tp=4, with and without SP
    python benchmarks/bench_tp.py --quick         # fewer rounds, for a smoke test

For each setting it launches `torchrun --nproc-per-node TP benchmarks/tp_worker.py`
and prints two markdown tables:

(a) bytes per rank per step: meshlib's counter and a dispatch-mode count of
    DTensor's collectives, each divided by the Megatron minimum. The minimum is
    Megatron's per layer (2 all-reduces of b*s*h forward, 2 backward; with
    sequence parallelism an all-gather plus a reduce-scatter for each, the same
    bus bytes) times the layers, plus the model's ends: the vocab-parallel
    embedding's forward all-reduce, the head input's backward all-reduce and
    the loss-parallel reductions (3 values per token). "layers" divides what
    remains after those ends by the per-layer minimum.
(b) step time, the two alternated within one run, median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BUS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def run(model: str, tp: int, batch: int, seq: int, rounds: int, steps: int, sp: bool) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), os.path.join(HERE, "tp_worker.py")
    ]
    cmd += [model, str(tp), str(batch), str(seq), str(rounds), str(steps), "sp" if sp else "nosp", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def bus(by_kind: dict, n: int) -> float:
    return sum(BUS[k.split("/")[1]] * b * (n - 1) / n for k, b in by_kind.items())


def megatron(r: dict) -> tuple[float, float]:
    """(per-layer minimum, whole-model minimum) in bus bytes per rank per step."""
    n, bsh = r["tp"], r["batch"] * r["seq"] * r["dim"] * 4
    per_layer = 4 * 2 * bsh * (n - 1) / n
    ends = 2 * 2 * bsh * (n - 1) / n + 2 * 3 * r["batch"] * r["seq"] * 4 * (n - 1) / n
    return per_layer, r["layers"] * per_layer + ends


def rows(results: list[dict]) -> tuple[list, list]:
    comm, time_rows = [], []
    for r in results:
        n = r["tp"]
        per_layer, whole = megatron(r)
        ends = whole - r["layers"] * per_layer
        setting = f"tp={n}{' +SP' if r['sp'] else ''}"
        for who in ("ours", "native"):
            b = bus(r[f"bytes_{who}"], n)
            name = "meshlib" if who == "ours" else "torch parallelize_module"
            layers = (b - ends) / (r["layers"] * per_layer)
            comm.append((setting, name, f"{b / 2**20:.2f}", f"{b / whole:.2f}", f"{layers:.2f}"))
        ours, native = statistics.median(r["step_ours"]), statistics.median(r["step_native"])
        time_rows.append(
            (setting, f"{ours * 1e3:.1f}", f"{native * 1e3:.1f}", f"{ours / native:.2f}", len(r["step_ours"]))
        )
    return comm, time_rows


def markdown(header: tuple, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in body])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 1
    results = []
    for tp in (2, 4):
        for sp in (False, True):
            results.append(run(args.model, tp, args.batch, args.seq, args.rounds, args.steps, sp))
            r = results[-1]
            if abs(r["loss_ours"] - r["loss_native"]) > 1e-4:
                raise RuntimeError(f"first-step losses differ: {r['loss_ours']} vs {r['loss_native']}")
    comm, times = rows(results)
    r0 = results[0]
    print(
        f"{args.model}: {r0['layers']} layers, h={r0['dim']}, batch {args.batch} x seq {args.seq}, fp32, gloo on CPU\n"
    )
    print("(a) comm bytes per rank per step (bus bytes) / Megatron minimum\n")
    print(markdown(("setting", "implementation", "MiB", "/ whole-model minimum", "layers / per-layer minimum"), comm))
    print("\n(b) step time, alternated in one run (median over rounds)\n")
    print(markdown(("setting", "meshlib ms", "torch native ms", "ratio", "rounds"), times))


if __name__ == "__main__":
    main()
