"""`meshlib plan`, `meshlib run` and `meshlib calibrate`, carried out: the options are `meshlib.cli`'s parser.

    meshlib plan --model llama-7b --mesh dp=8,tp=4
    meshlib plan --model mypkg.model:build --rules mypkg.model:rules --mesh dp=2,tp=2
    meshlib run --nproc-per-node 4 --model gpt-tiny --mesh dp=2,tp=2 --steps 20
    torchrun --nproc-per-node 4 -m meshlib_torch run --model gpt-tiny --mesh dp=2,tp=2 --steps 20

Bad input (a ValueError) is one message and exit status 2, said once however many ranks
run (`meshlib.cli.fail`); `meshlib run --nproc-per-node` checks the options by compiling
the plan on the meta device before any worker starts.
"""

from __future__ import annotations

import math
import os
import re
import sys
import traceback
from collections import defaultdict

import torch

from meshlib import Mesh, Plan, device_profile, predict_plan
from meshlib._table import Table, human_bytes, show
from meshlib.cli import check_launch, fail, parser
from meshlib.cost import zero_level

from . import models
from .testing.parity import TOLERANCE
from .usermodel import own_subject

_USER_SEQ = 64  # --seq for the user's own model when not given


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.command is None:
        parser().print_help()
        return
    try:
        if args.command == "plan":
            plan_main(args)
        elif args.command == "calibrate":
            from .calibrate import calibrate_main

            calibrate_main(args)
        else:
            run_main(args, argv)
    except BrokenPipeError:  # `meshlib plan ... | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except (ValueError, OSError) as err:  # bad input (or a missing file): the message says what to change
        fail(f"meshlib {args.command}: error: {err}")
    except Exception:  # a bug, or a dead peer: the traceback, also said once
        fail(traceback.format_exc().rstrip(), status=1)


# -- the model, its rules and inputs --------------------------------------------------------------
def _own(args) -> bool:
    return ":" in args.model


def _overrides(args) -> dict:
    if args.layers is None:
        return {}
    if _own(args):
        raise ValueError("--layers overrides a bundled model's layer count; give your factory its own options")
    cfg = models.config(args.model)
    return {"n_layer" if hasattr(cfg, "n_layer") else "n_layers": args.layers}


def _seq(args, cap: int | None = None) -> int:
    if _own(args):
        return args.seq or _USER_SEQ
    cfg = models.config(args.model)
    limit = models.max_seq_len(cfg)
    seq = args.seq or (min(limit, cap) if cap else limit)
    if seq > limit:
        raise ValueError(f"--seq {seq} is longer than {args.model}'s maximum {limit}")
    return seq


def _subject(args, mesh: Mesh, seq: int) -> tuple:
    """(model on meta, rules, example inputs, example keyword inputs, notes) for `args.model`."""
    dtype = getattr(torch, args.dtype)
    if _own(args):
        _overrides(args)  # --layers is a bundled model's option: refused here
        return own_subject(args, mesh, seq, dtype)
    cfg = models.config(args.model, **_overrides(args))
    model = models.build(cfg, device="meta", dtype=dtype)
    example = tuple(torch.empty(args.batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    return model, models.default_rules(cfg, mesh), example, {}, ()


def _idle(args) -> tuple[str, ...]:
    return tuple(a.strip() for a in args.idle_axes.split(",") if a.strip())


def _compile(args, *, seq: int):
    """The compiled model for `args` on the meta device (no processes), and the plan's extra notes."""
    from .compiler.compile import compile_model

    mesh = Mesh.parse(args.mesh)
    model, rules, inputs, kwargs, notes = _subject(args, mesh, seq)
    compiled = compile_model(
        model, mesh=mesh, rules=rules, example_inputs=inputs, example_kwargs=kwargs or None,
        sequence_parallel=args.sp, zero=zero_level(args.zero), precision=args.precision or None,
        recompute=args.recompute, estimate_memory=True, microbatches=args.microbatches, schedule=args.schedule,
        chunks=args.chunks, split_points=args.split_points, balance=args.balance, idle_axes=_idle(args),
        uneven=args.uneven, capacity_factor=args.capacity_factor, cp_method=args.cp_method,
        cp_layout=args.cp_layout, expert_load=args.expert_load,
    )  # fmt: skip
    return compiled, (("model", args.model), *notes, ("batch x seq", f"{args.batch} x {seq}"))


# -- plan ------------------------------------------------------------------------------------
def plan_main(args) -> Plan:
    if args.auto:
        return auto_main(args)
    profile = device_profile(args.profile) if args.profile else None  # a bad name fails before compiling
    compiled, notes = _compile(args, seq=_seq(args))
    plan = compiled.plan.replace(notes=compiled.plan.notes + notes)
    if profile is not None:
        plan = plan.replace(prediction=predict_plan(plan, profile))
    tables = _plan_tables(plan, grouped=not args.all)
    tables[1] = param_table(compiled, grouped=not args.all)
    show(*tables)
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(indent=1))
    return plan


def auto_main(args) -> Plan:
    """`meshlib plan --auto`: the search's best plans, why, the best one's full plan and how to run it."""
    from meshlib.planner import search

    from .planner import compile_candidate, model_shape, no_fit, parallelize_call, refine, run_command, torch_runtime

    if not args.profile:
        raise ValueError("--auto predicts step times on some devices: give --profile a100|h100|cpu|FILE.json")
    profile = device_profile(args.profile)
    devices = args.devices or Mesh.parse(args.mesh).size
    seq = _seq(args)
    model = _subject(args, Mesh(dp=1), seq)[0]
    found = search(model_shape(model), devices=devices, batch=args.batch, seq=seq, profile=profile,
                   device_memory=args.device_memory, top=args.top, dtype=_auto_dtype(args, profile),
                   runtime=torch_runtime(), explain=args.top)  # fmt: skip
    show(_candidates_table(found, devices, profile))
    limit = args.device_memory or profile.memory

    def compiled(cand):
        model, rules, inputs, kwargs, _ = _subject(args, cand.config.mesh, seq)
        return compile_candidate(model, cand, rules=rules, batch=args.batch, seq=seq, profile=profile,
                                 example=inputs, example_kwargs=kwargs)  # fmt: skip

    fits, over = refine(found, compiled, limit=limit, count=args.refine)
    for cand, plan in over:  # the dry run has the last word on memory
        print(f"plan {found.index(cand) + 1} ({cand.mesh}) needs {human_bytes(plan.prediction.memory)} per rank by its "
              f"dry run, more than {human_bytes(limit)}")  # fmt: skip
    if not fits:
        raise ValueError(no_fit(len(found), limit))
    cand, plan = fits[0]
    if len(fits) > 1 or cand is not found[0]:
        show(_refined_table(found, fits))
    show(Table("why this plan", ("", "reason"), [(i + 1, w) for i, w in enumerate(cand.why)]))
    plan = plan.replace(notes=plan.notes + (("model", args.model), ("batch x seq", f"{args.batch} x {seq}")))
    show(*[t for t in _plan_tables(plan, grouped=True) if t.title in ("plan", "memory per rank", "predicted step")])
    ring = cand.config.cp > 1 and cand.config.cp_method == "ring"
    if (said := disagreement(cand.prediction, plan.prediction, ring)) is not None:
        print("\n" + said)
    if not _own(args):
        print("\nrun it:\n  " + run_command(cand, model=args.model, batch=args.batch, seq=seq,
                                             devices_per_node=profile.devices_per_node))  # fmt: skip
    else:
        print("\ntrain it (every rank, under torchrun; meshlib run trains the bundled models):\n  "
              + parallelize_call(cand, batch=args.batch))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(indent=1))
    return plan


DISAGREE = 0.25  # the full plan's step against the search's beyond which --auto says so


def disagreement(closed, planned, ring: bool = False) -> str | None:
    """What to tell a user when the full plan's predicted step (what its dry run counts the ranks running)
    differs from the search's closed form by more than `DISAGREE`: both, part by part; None within it.
    `ring`: the plan runs ring attention (whose masked blocks run as tiles of eager ops)."""
    if abs(planned.step_time / closed.step_time - 1) <= DISAGREE:
        return None
    parts = ("compute", "comm", "bubble", "optimizer")
    both = ", ".join(f"{k} {getattr(closed, k):.4g} / {getattr(planned, k):.4g} s" for k in parts)
    how = ("meshlib's ring attention computes the blocks a mask cuts in tiles of eager ops, where the closed form "
           "prices a fused kernel" if ring else "the dry run counts each op the ranks run, each with its host "
           "time, and each collective as the runtime issues it, where the closed form prices fused kernels and "
           "fewer, larger collectives")  # fmt: skip
    return (
        f"note: the full plan predicts {planned.step_time:.4g} s per step where the search's closed form said "
        f"{closed.step_time:.4g} s ({both}, closed form / plan): the runtime runs this plan otherwise than the "
        f"closed form assumes ({how}), so the search's ranking of it is that much less sure"
    )


def _auto_dtype(args, profile) -> str:
    """--precision's compute dtype, else the faster of bf16 and fp32 on the profile's devices (a CPU's bf16
    products can be slower than its fp32 ones)."""
    if args.precision is not None:
        return args.precision.param
    return max(("bfloat16", "float32"), key=profile.flops_per_s)


def _refined_table(found: list, fits: list) -> Table:
    """The best plans that fit, re-timed by their full plans (`planner.refine`), fastest first."""
    rows = [(found.index(c) + 1, c.mesh, c.config.zero, c.config.microbatch, _pipeline_cell(c.config),
             f"{c.prediction.step_time:.4g} s", f"{p.prediction.step_time:.4g} s", human_bytes(p.prediction.memory),
             "runs" if i == 0 else "") for i, (c, p) in enumerate(fits)]  # fmt: skip
    return Table("the best plans that fit, by their full plans", ("#", "mesh", "zero", "mb", "pipeline", "closed form",
                 "full plan", "peak per rank (dry run)", ""), rows,
                 caption="each compiled on the meta device: its dry run counts every op and collective its ranks run; "
                 "the fastest by it runs (--refine: how many to compile)")  # fmt: skip


def _pipeline_cell(c) -> str:
    return f"{c.schedule}" + (f" v={c.chunks}" if c.chunks > 1 else "") if c.pp > 1 else "-"


def _candidates_table(found: list, devices: int, profile) -> Table:
    rows = []
    for i, cand in enumerate(found):
        c, p = cand.config, cand.prediction
        pipe = _pipeline_cell(c)
        rows.append((
            i + 1, cand.mesh, c.zero, c.recompute, "on" if c.sp else "off", c.microbatch, pipe,
            c.cp_method if c.cp > 1 else "-", f"{p.step_time:.4g} s", f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}",
            human_bytes(p.memory), f"{p.shares['bubble']:.0%}", human_bytes(p.comm_bytes),
        ))  # fmt: skip
    heads = ("#", "mesh", "zero", "recompute", "sp", "mb", "pipeline", "cp", "step", "tokens/s", "MFU", "memory",
             "bubble", "bytes/rank")  # fmt: skip
    return Table(f"the best plans for {devices} {profile.name} devices", heads, rows,
                 "predicted from the closed-form workload (meshlib.transformer); the first --refine that fit are "
                 "compiled below")


def _plan_tables(plan: Plan, *, grouped: bool) -> list:
    tables = [t for t in plan.tables() if t.title != "collectives per step" or not grouped]
    if grouped and plan.collectives:
        tables.insert(-1, grouped_collectives(plan))
    return tables


def grouped_collectives(plan: Plan) -> Table:
    """Collectives folded by (phase, kind, axes, op, source): how many, bytes per rank per step (with
    a pipeline, per pp rank: each rank runs its own stages' collectives)."""
    staged = bool(plan.stages)
    groups: dict = defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        key = (c.phase, c.kind, ",".join(c.axes), c.op, c.source, c.reason)
        key += (("all" if c.pp_rank < 0 else c.pp_rank),) if staged else ()
        groups[key][0] += c.count
        groups[key][1] += c.total_bytes
    rows = [
        (*k[:3], n, human_bytes(b), *k[3:]) for k, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    ]
    return Table(
        "collectives per step (grouped by source line)",
        ("phase", "kind", "axes", "count", "bytes/rank", "op", "source", "change") + (("pp rank",) if staged else ()),
        rows,
        f"{plan.comm_caption()}; `meshlib plan --all` lists each one with its graph node",
    )


def param_table(compiled, *, grouped: bool = True) -> Table:
    """Each parameter's shape, spec and tensor-parallel shard, with its bytes in the model's dtype; layers
    folded into `layers.*` rows (with a pipeline, per pp rank holding them)."""
    holders: dict = defaultdict(set)
    if compiled.pipelined:
        for s, names in enumerate(compiled.stages.params):
            for name in names:
                holders[name].add(compiled.schedule.placement[s])
    rows: dict = {}
    for name, p in compiled.traced.params.items():
        local = compiled.local_param_shape(name)
        key_name = re.sub(r"\.\d+\.", ".*.", name) if grouped else name
        spec = compiled.param_specs[name]
        groups = {pl.groups for pl in compiled.param_layouts[name] if hasattr(pl, "groups")}
        parts = {":".join(map(str, pl.parts)) for pl in compiled.param_layouts[name] if getattr(pl, "parts", ())}
        shown = repr(spec) + (f" strided x{max(groups)}" if groups and max(groups) > 1 else "")
        shown += "".join(f" in parts {w}" for w in sorted(parts))
        key = (key_name, tuple(p.shape), shown, local)
        n, b, ranks = rows.get(key, (0, 0, set()))
        rows[key] = (n + 1, b + math.prod(local) * p.element_size(), ranks | holders[name])
    out = [
        (k[0], n, "x".join(map(str, k[1])), k[2], "x".join(map(str, k[3])), human_bytes(b))
        + ((_ranges(sorted(ranks)),) if holders else ())
        for k, (n, b, ranks) in rows.items()
    ]
    total = human_bytes(sum(b for _, b, _ in rows.values()))
    held = compiled.plan.memory.params if compiled.plan.memory is not None else 0
    return Table(
        "parameter layouts",
        ("tensor", "count", "shape", "spec", "tp shard", "bytes of the shards") + (("pp rank",) if holders else ()),
        out,
        f"{total} of tensor-parallel shards in all (the model's dtype); one rank holds "
        f"{human_bytes(held)} of parameters (the memory table: its pipeline stages only, in the compute dtype, "
        "and under ZeRO-3 a 1/dp shard of each)",
    )


def _ranges(ranks: list[int]) -> str:
    """`0-3`, `0,3`, `1`: pp ranks, consecutive runs folded."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


# -- run ----------------------------------------------------------------------------------------
def run_main(args, argv: list[str] | None = None) -> None:
    """Train on this rank (under torchrun or the launcher), or start the workers (--nproc-per-node)."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if "RANK" not in os.environ:
        raise SystemExit(_launch(args, argv))
    from .runtime import dist as mdist
    from .testing.parity import RunConfig, compare, train_parallel, train_reference

    run = RunConfig(
        model=args.model, mesh=args.mesh, steps=args.steps, batch_size=args.batch, seq_len=_seq(args, cap=64),
        dtype=args.dtype, lr=args.lr, max_norm=args.max_norm, seed=args.seed, sequence_parallel=args.sp,
        overrides=_overrides(args),
        zero=zero_level(args.zero), precision=args.precision or "", recompute=args.recompute,
        microbatches=args.microbatches, schedule=args.schedule, chunks=args.chunks,
        split_points=tuple(args.split_points or ()) or None, balance=args.balance, weights=args.weights,
        export=args.export, idle_axes=_idle(args), uneven=args.uneven, capacity_factor=args.capacity_factor,
        cp_method=args.cp_method, cp_layout=args.cp_layout,
    )  # fmt: skip
    rank0 = int(os.environ["RANK"]) == 0
    try:
        result = train_parallel(run, progress=rank0)
        if rank0:
            show(_run_summary(run, result))
            if result.routing or result.dropped is not None:
                show(_routing_table(result.routing, result.dropped, run.capacity_factor))
            if args.export:
                print(f"exported the trained model to {args.export}")
            if not args.no_reference:
                ref = train_reference(run)
                diffs = compare(ref, result, run.tolerance, check=False)
                show(_reference_table(diffs, run))
    finally:
        mdist.leave()  # not `shutdown` alone: a peer may still be finishing the last collective


def _launch(args, argv: list[str]) -> int:
    """Check the options against the mesh (the plan compiled on meta), then start the workers."""
    check_launch(args, argv)
    if args.weights and not os.path.exists(args.weights):
        raise ValueError(f"--weights {args.weights}: no such file or directory")
    _compile(args, seq=_seq(args, cap=64))
    from .launch import launch

    return launch(
        argv, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
        rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        master_addr=args.master_addr, master_port=args.master_port, max_restarts=args.max_restarts,
    )  # fmt: skip


def _run_summary(run, result) -> Table:
    comm = result.comm or {"by_kind": {}}
    rows = [(ph, k, a, human_bytes(b)) for (ph, k, a), b in sorted(comm["by_kind"].items())]
    return Table(
        f"{run.model} on {run.mesh}: collectives in the last step (bytes per rank)",
        ("phase", "kind", "axis", "bytes"),
        rows,
        f"losses: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}",
    )


def _routing_table(routing: list, dropped: int | None, capacity_factor: float | None) -> Table:
    rows = [
        (name.removesuffix(".tokens_per_expert"), " ".join(f"{c:.0f}" for c in counts), f"{imbalance:.2f}")
        for name, counts, imbalance in routing
    ]  # fmt: skip
    if dropped is None:
        note = "dropless dispatch: no token is dropped"
    else:
        routed = sum(sum(counts) for _, counts, _ in routing)
        share = f" ({dropped / routed:.1%} of the {routed:.0f} routed)" if routed else ""
        note = (
            f"capacity mode (capacity_factor={capacity_factor}): {dropped} (token, expert) pairs dropped in the "
            f"last step{share}; each expert took the first ceil({capacity_factor}·T·k/E) pairs of each rank's call"
        )
    return Table(
        "router statistics, last step (summed over every rank that routes)",
        ("router", "tokens per expert", "imbalance (max / mean)"),
        rows,
        note,
    )


def _reference_table(diffs: dict, run) -> Table:
    names = {
        "loss": "loss (every step)",
        "grad_norm": "gradient norm (every step)",
        "param": f"parameters after {run.steps} steps",
    }
    rows = [(names[k], f"{v:.3e}") for k, v in diffs.items() if k in names]
    rtol, atol = TOLERANCE[run.tolerance]
    low = run.tolerance in (torch.bfloat16, torch.float16)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(run.tolerance, run.dtype)
    reference = f"single-process {short} reference" if low else "single-process reference"
    basis = f"{short} compute with {run.dtype} masters on both sides" if low else f"{run.dtype}"
    if diffs["ok"] or run.dtype == "float64":
        hint = ""
    elif low:
        hint = f"; {short} rounding compounds step by step: --steps 3 is the tests' case"
    else:
        hint = "; AdamW grows fp32 rounding over longer runs: try --dtype float64"
    return Table(
        f"parallel run vs {reference}: max |difference|",
        ("quantity", "max |diff|"),
        rows,
        f"{'within' if diffs['ok'] else 'beyond'} rtol {rtol:g}, atol {atol:g}: the parity tests' tolerance for "
        f"{basis}, which they check over 3 steps{hint}",
    )


__all__ = ["main", "plan_main", "run_main", "grouped_collectives", "param_table"]
