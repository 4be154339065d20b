"""What each pp rank of the Llama-3-405B shape keeps for backward, against Korthikanti et al. 2022.

    python benchmarks/bench_activations.py                        # the table, from this checkout
    python benchmarks/bench_activations.py --stored > now.json    # each pp rank's stored bytes only
    python benchmarks/bench_activations.py --before before.json   # the table with another checkout's column

The plan is `meshlib plan --model llama-405b --mesh dp=128,pp=16,tp=8 --batch 2048 --seq 8192
--microbatches 16 --precision bf16 --zero 1 --sp --recompute block`, with the dry run. Per pp rank:
the microbatches 1F1B keeps in flight there (p - r), its layers, and the activations it stores for
them (the dry run of one microbatch through each of its stages, times those in flight); beside that,
Korthikanti's closed form for block recompute with sequence parallelism (each layer keeps its input,
2sbh/t bytes in bf16, per microbatch in flight), the model state, and the dry run's peak. `--before`
adds the stored bytes another checkout computed (run this script there with `--stored`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from machine import describe

from meshlib import Mesh
from meshlib_torch import compile_model, models
from meshlib_torch.compiler.estimates import dryrun

P, T, M, BATCH, SEQ = 16, 8, 16, 2048, 8192
GIB = 1024**3


def plan():
    cfg = models.config("llama-405b")
    mesh = Mesh(dp=128, pp=P, tp=T)
    x = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return cfg, compile_model(
        models.build(cfg, device="meta"), mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=(x, x),
        microbatches=M, precision="bf16", zero=1, sequence_parallel=True, recompute="block", estimate_memory=True,
    )  # fmt: skip


def stored(compiled) -> list[int]:
    """Per pp rank: bytes its stages keep for the microbatches 1F1B has in flight there."""
    out = [0] * P
    for s, rank in enumerate(compiled.schedule.placement):
        out[rank] += min(P - rank, M) * dryrun._stage_run(compiled, s).kept
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stored", action="store_true", help="print each pp rank's stored bytes as JSON, and stop")
    ap.add_argument("--before", help="a JSON file of another checkout's stored bytes, for a column beside")
    args = ap.parse_args()
    start = time.perf_counter()
    cfg, compiled = plan()
    now = stored(compiled)
    if args.stored:
        print(json.dumps(now))
        return
    from meshlib.cost import activation_bytes  # here: `--stored` runs on checkouts from before it existed

    before = json.load(open(args.before)) if args.before else None
    layer = activation_bytes(SEQ, BATCH // 128 // M, cfg.dim, cfg.n_heads, t=T, sp=True, recompute="block")
    print(describe())
    print(f"- plan and dry run: {time.perf_counter() - start:.0f} s\n")
    heads = ["pp rank", "layers", "in flight", "stored GiB"] + (["stored before GiB"] if before else [])
    heads += ["closed form GiB", "model state GiB", "peak GiB (dry run)", "peak - state - closed form GiB"]
    print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads))
    for r, mem in enumerate(compiled.plan.stage_memory):
        layers = sum(len(s.modules) for s in compiled.plan.stages if s.rank == r)
        closed = min(P - r, M) * layers * layer
        state = mem.params + mem.grads + mem.optimizer
        row = [r, layers, min(P - r, M), f"{now[r] / GIB:.2f}"] + ([f"{before[r] / GIB:.2f}"] if before else [])
        row += [f"{closed / GIB:.2f}", f"{state / GIB:.2f}", f"{mem.peak / GIB:.2f}",
                f"{(mem.peak - state - closed) / GIB:.2f}"]  # fmt: skip
        print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
