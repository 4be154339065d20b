"""`meshlib plan` and `meshlib run`: inspect a plan with no processes, or train under torchrun.

    meshlib plan --model llama-7b --mesh dp=8,tp=4
    torchrun --nproc-per-node 4 -m meshlib_torch run --model gpt-tiny --mesh dp=2,tp=2 --steps 20
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections import defaultdict

import torch

from meshlib import Mesh, Plan, Precision
from meshlib._table import Table, human_bytes, show
from meshlib.cost import zero_level

from . import models
from .testing.parity import TOLERANCE


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help=f"bundled model: {', '.join(models.CONFIGS)}")
    p.add_argument("--mesh", default="dp=2,tp=2", help="mesh axes, e.g. dp=2,tp=2")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, at most 64 for run)")
    p.add_argument("--sp", action="store_true", help="sequence parallel: norm regions sharded on the sequence over tp")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="master (full-precision) dtype")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--zero", default="0", help="0|1|2|3 or no_shard|shard_grad_op|full: what is sharded over dp")
    p.add_argument("--precision", default="", help="compute dtype: fp32|bf16|fp16, or param=..,reduce=..,output=..")
    p.add_argument("--recompute", default="none", choices=["none", "block", "selective"], help="activation recompute")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step (pipeline, or accumulation)")
    p.add_argument(
        "--schedule", default="1f1b",
        help="pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv (any case; torch's class names too)",
    )  # fmt: skip
    p.add_argument("--chunks", type=int, default=None, help="pipeline stages per rank (interleaved schedules)")
    p.add_argument("--split-points", default=None, help="layers where pipeline stages 2, 3, ... begin, e.g. 4,9,14")
    p.add_argument("--balance", default="flops", choices=["flops", "params"], help="pipeline stage cost to balance")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlib", description="Plan and run meshlib-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compile on the meta device and print the plan (no processes)")
    _common(plan)
    plan.add_argument("--all", action="store_true", help="list every collective instead of grouping them")
    plan.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    run = sub.add_parser("run", help="train under torchrun and compare with the single-process reference")
    _common(run)
    run.add_argument("--steps", type=int, default=20)
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    run.add_argument(
        "--weights", default=None, metavar="PATH",
        help="start from these weights: a .safetensors file, a directory saved by save_pretrained or --export, "
        "or a DCP checkpoint (each rank reads its own shards)",
    )  # fmt: skip
    run.add_argument(
        "--export", default=None, metavar="PATH",
        help="after training, write the model there as Hugging Face safetensors (sharded files with the index)",
    )  # fmt: skip
    return parser


def _overrides(args) -> dict:
    if args.layers is None:
        return {}
    cfg = models.config(args.model)
    return {"n_layer" if hasattr(cfg, "n_layer") else "n_layers": args.layers}


def _seq(args, cap: int | None = None) -> int:
    cfg = models.config(args.model)
    limit = getattr(cfg, "block_size", None) or cfg.max_seq_len
    seq = args.seq or (min(limit, cap) if cap else limit)
    if seq > limit:
        raise SystemExit(f"--seq {seq} is longer than {args.model}'s maximum {limit}")
    return seq


# -- plan ------------------------------------------------------------------------------------
def plan_main(args) -> Plan:
    from .compiler.compile import compile_model

    mesh = Mesh.parse(args.mesh)
    cfg = models.config(args.model, **_overrides(args))
    model = models.build(cfg, device="meta", dtype=getattr(torch, args.dtype))
    seq = _seq(args)
    example = tuple(torch.empty(args.batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    common = dict(
        mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=example, sequence_parallel=args.sp,
        zero=zero_level(args.zero), precision=Precision.parse(args.precision) if args.precision else None,
        recompute=args.recompute, estimate_memory=True,
    )  # fmt: skip
    compiled = compile_model(
        model, **common, microbatches=args.microbatches, schedule=args.schedule, chunks=args.chunks,
        split_points=_split_points(args), balance=args.balance,
    )  # fmt: skip
    plan = compiled.plan.replace(
        notes=compiled.plan.notes + (("model", args.model), ("batch x seq", f"{args.batch} x {seq}"))
    )
    tables = _plan_tables(plan, grouped=not args.all)
    tables[1] = param_table(compiled, grouped=not args.all)
    show(*tables)
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(indent=1))
    return plan


def _plan_tables(plan: Plan, *, grouped: bool) -> list:
    tables = [t for t in plan.tables() if t.title != "collectives per step" or not grouped]
    if grouped and plan.collectives:
        tables.insert(-1, grouped_collectives(plan))
    return tables


def grouped_collectives(plan: Plan) -> Table:
    """Collectives folded by (phase, kind, axes, op, source): how many, bytes per rank per step."""
    groups: dict = defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        key = (c.phase, c.kind, ",".join(c.axes), c.op, c.source, c.reason)
        groups[key][0] += c.count
        groups[key][1] += c.total_bytes
    rows = [
        (*k[:3], n, human_bytes(b), k[3], k[4], k[5])
        for k, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    ]
    total = human_bytes(plan.comm_bytes())
    return Table(
        "collectives per step (grouped by source line)",
        ("phase", "kind", "axes", "count", "bytes/rank", "op", "source", "change"),
        rows,
        f"total {total} per rank per step; `meshlib plan --all` lists each one with its graph node",
    )


def param_table(compiled, *, grouped: bool = True) -> Table:
    """Each parameter's shape, spec, per-rank shard and bytes; layers folded into `layers.*` rows."""
    rows: dict = {}
    for name, p in compiled.traced.params.items():
        local = compiled.local_param_shape(name)
        key_name = re.sub(r"\.\d+\.", ".*.", name) if grouped else name
        spec = compiled.param_specs[name]
        groups = {pl.groups for pl in compiled.param_layouts[name] if hasattr(pl, "groups")}
        shown = repr(spec) + (f" strided x{max(groups)}" if groups and max(groups) > 1 else "")
        key = (key_name, tuple(p.shape), shown, local)
        n, b = rows.get(key, (0, 0))
        rows[key] = (n + 1, b + math.prod(local) * p.element_size())
    out = [
        (k[0], n, "x".join(map(str, k[1])), k[2], "x".join(map(str, k[3])), human_bytes(b))
        for k, (n, b) in rows.items()
    ]
    total = human_bytes(sum(b for _, b in rows.values()))
    return Table(
        "parameter layouts",
        ("tensor", "count", "shape", "spec", "shard per rank", "bytes/rank"),
        out,
        f"total {total} per rank",
    )


def _split_points(args) -> list[int] | None:
    if not args.split_points:
        return None
    try:
        return [int(x) for x in args.split_points.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--split-points {args.split_points!r}: give layer indices separated by commas, e.g. 4,9,14"
        ) from None


# -- run ----------------------------------------------------------------------------------------
def run_main(args) -> None:
    from .runtime import dist as mdist
    from .testing.parity import RunConfig, compare, train_parallel, train_reference

    if "RANK" not in os.environ:
        raise SystemExit(
            "meshlib run trains on several processes: launch it with torchrun, e.g.\n"
            f"  torchrun --nproc-per-node {Mesh.parse(args.mesh).size} -m meshlib_torch run {' '.join(sys.argv[2:])}"
        )
    run = RunConfig(
        model=args.model, mesh=args.mesh, steps=args.steps, batch_size=args.batch, seq_len=_seq(args, cap=64),
        dtype=args.dtype, lr=args.lr, seed=args.seed, sequence_parallel=args.sp, overrides=_overrides(args),
        zero=zero_level(args.zero), precision=args.precision, recompute=args.recompute,
        microbatches=args.microbatches, schedule=args.schedule, chunks=args.chunks,
        split_points=tuple(_split_points(args) or ()) or None, balance=args.balance, weights=args.weights,
        export=args.export,
    )  # fmt: skip
    rank0 = int(os.environ["RANK"]) == 0
    result = train_parallel(run, progress=rank0)
    if rank0:
        show(_run_summary(run, result))
        if args.export:
            print(f"exported the trained model to {args.export}")
        if not args.no_reference:
            ref = train_reference(run)
            diffs = compare(ref, result, run.torch_dtype, check=False)
            show(_reference_table(diffs, run))
    mdist.shutdown()


def _run_summary(run, result) -> Table:
    comm = result.comm or {"by_kind": {}}
    rows = [(ph, k, a, human_bytes(b)) for (ph, k, a), b in sorted(comm["by_kind"].items())]
    return Table(
        f"{run.model} on {run.mesh}: collectives in the last step (bytes per rank)",
        ("phase", "kind", "axis", "bytes"),
        rows,
        f"losses: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}",
    )


def _reference_table(diffs: dict, run) -> Table:
    names = {
        "loss": "loss (every step)",
        "grad_norm": "gradient norm (every step)",
        "param": f"parameters after {run.steps} steps",
    }
    rows = [(names[k], f"{v:.3e}") for k, v in diffs.items() if k in names]
    rtol, _ = TOLERANCE[run.torch_dtype]
    hint = (
        ""
        if diffs["ok"] or run.dtype == "float64"
        else "; AdamW grows fp32 rounding over longer runs: try --dtype float64"
    )
    return Table(
        "parallel run vs single-process reference: max |difference|",
        ("quantity", "max |diff|"),
        rows,
        f"{'within' if diffs['ok'] else 'beyond'} rtol {rtol:g} (the parity tests' {run.dtype} tolerance, "
        f"which they check over 3 steps{hint})",
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "plan":
            plan_main(args)
        else:
            run_main(args)
    except ValueError as err:  # bad input: the message says what to change; no traceback
        print(f"meshlib {args.command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = ["main", "plan_main", "run_main", "grouped_collectives", "param_table"]
