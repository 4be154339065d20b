"""Expert parallelism: all-to-all bytes against the closed form and transformers, step time against
replicated experts, and memory per rank at DeepSeek-V3's scale.

    python benchmarks/bench_experts.py            # all three parts, about 1.5 minutes on 2 cores
    python benchmarks/bench_experts.py --quick    # 3 timing rounds instead of 15: a smoke test

(1) All-to-all bytes per rank per MoE layer per step (the `lax.all_to_all_v` dispatch and combine,
    forward and backward), against DESIGN.md's closed form T*k*h*bytes*(ep-1)/ep per exchange:
    (a) `tests/moe_models.build_balanced` (moe-tiny-ds, fp64, every router's choices fixed and even)
        on real gloo ranks for ep=2, ep=4 and dp=2 x ep=2: the plan's records, the closed form, and
        what `COUNTER` counts on every rank in one step (`testing.measure.measure_step`);
    (b) the Mixtral-8x7B and DeepSeek-V3 shapes, whole depth, planned on the meta device in bf16;
    (c) all of them against transformers 5.24's expert parallelism, in closed form
        (`transformers/distributed/expert_parallel.py`: `AllToAllEP`, what `ep_implementation="auto"`
        runs in training, and `AllReduceEP`, the replicated-token variant).
(2) Step time of moe-tiny widened so the experts hold 94% of the parameters, experts over ep=4 against
    the same experts replicated on dp=4 (the experts then run as a local region, every expert on each
    rank), both on the same 4 gloo ranks from the same initial values, alternated; the median of the
    per-round ratios.
(3) Memory per rank for the DeepSeek-V3 shape on an abstract mesh of 2,048 ranks (dp=2, pp=16, ep=64,
    as DeepSeek trained it), 16 microbatches of one 4,096-token sequence per data rank, bf16 compute
    with fp32 masters: per pp rank, the plan's model state against the closed forms under ZeRO-0 (16
    bytes per parameter, experts E/ep per rank) and ZeRO-1 (masters and moments of the experts over dp,
    of the rest over dp x ep), and ZeRO-1's dry-run peak without and with block recompute.

The rank-side jobs are in `benchmarks/experts_worker.py` (a RankPool pickles them by qualified name).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import experts_worker
import torch
from machine import busy_ticks, describe, ticks_of

from meshlib import Mesh, Precision
from meshlib_torch import compile_model, models
from meshlib_torch.testing.pool import get_pool

ROOT = Path(__file__).resolve().parent.parent
KiB, MiB, GiB = 2**10, 2**20, 2**30
A2AV = "all_to_all_v"  # the plan names it lax.all_to_all_v, the counter all_to_all_v
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
TOLERANCE = 1e-5  # first two losses, ep against dp (fp32)


@dataclass
class Table:
    title: str
    header: tuple[str, ...]
    rows: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in self.rows]
        return "\n".join(lines + ([""] + self.notes if self.notes else []))

    def show(self) -> None:
        from rich.console import Console
        from rich.table import Table as RichTable

        table = RichTable(title=self.title, title_justify="left")
        for i, col in enumerate(self.header):
            table.add_column(col, justify="left" if i < 2 else "right", overflow="fold")
        for row in self.rows:
            table.add_row(*(str(x).replace("**", "") for x in row))
        Console(width=200).print(table, *self.notes, sep="\n")


# -- closed forms -------------------------------------------------------------------------------------
def exchange(tokens: int, k: int, h: int, nbytes: int, ep: int) -> int:
    """DESIGN.md: bytes leaving a rank in one all-to-all of its T*k (token, slot) rows, routing even."""
    return tokens * k * h * nbytes * (ep - 1) // ep


def hf_all_reduce(tokens: int, k: int, h: int, nbytes: int, ep: int) -> float:
    """transformers' `AllReduceEP`, per rank per layer, fwd + bwd in ring bus bytes: the ep group shares
    T*ep tokens; forward all-reduces the experts' partial output (T*ep, h), backward the gradients of
    the hidden states (T*ep, h) and of the routing weights (T*ep, k; fp32, as its routers compute)."""
    ring = 2 * (ep - 1) / ep
    return ring * tokens * ep * h * nbytes + ring * tokens * ep * (h * nbytes + k * 4)


# -- (1a) the balanced model on gloo ranks --------------------------------------------------------------
SMALL = ("ep=2", "ep=4", "dp=2,ep=2")


def _moe_layers(cfg) -> int:
    return cfg.n_layers - cfg.n_dense_layers


def _planned(records, phase: str, op: str, bus: bool = False) -> float:
    return sum(b if bus else t for ph, o, t, b in records if ph == phase and o == op)


def measure_small(mesh: str) -> dict:
    """Plan, closed form and counted bytes per MoE layer for the balanced moe-tiny-ds on `mesh`."""
    if str(ROOT / "tests") not in sys.path:  # the balanced router lives with the tests
        sys.path.insert(0, str(ROOT / "tests"))
    import moe_models as mm

    from meshlib_torch.testing.reference import Trial

    trial = Trial(mm.build_balanced, mm.batch, mesh=mesh, rules=mm.rules_ds, lr=1e-3)
    m = Mesh.parse(mesh)
    ranks = get_pool(m.size).run(experts_worker.counted, trial, timeout=600)
    cfg, layers = models.config("moe-tiny-ds"), _moe_layers(models.config("moe-tiny-ds"))
    tokens = mm.BATCH * mm.SEQ // m.size  # ep borrows data ranks: the tokens split over dp x ep
    per = lambda total: total / layers  # noqa: E731
    plans = [r["planned"] for r in ranks]
    got = {ph: [per(r["counted"].get((ph, A2AV), 0)) for r in ranks] for ph in ("forward", "backward")}
    extra = {op: [per(r["counted"].get(("forward", op), 0)) for r in ranks] for op in ("all_to_all", "host_read")}
    return {
        "mesh": mesh, "ep": m.axis_size("ep"), "tokens": tokens, "k": cfg.top_k, "h": cfg.dim, "E": cfg.n_experts,
        "closed": exchange(tokens, cfg.top_k, cfg.dim, 8, m.axis_size("ep")),
        "plan": {ph: per(_planned(plans[0], ph, A2AV)) for ph in ("forward", "backward")},
        "plan_bus": per(_planned(plans[0], "forward", A2AV, bus=True)),
        "plan_same": all(p == plans[0] for p in plans), "got": got,
        "extra_plan": {op: per(_planned(plans[0], "forward", op)) for op in ("all_to_all", "host_read")},
        "extra_got": extra,
    }  # fmt: skip


def _spread(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,.0f}" if lo == hi else f"{lo:,.0f} - {hi:,.0f}"


def table_small(results: list[dict]) -> Table:
    header = ("mesh", "T tokens/rank", "closed form, one exchange B", "plan fwd B", "plan bwd B",
              "measured fwd B (all ranks)", "measured bwd B (all ranks)", "plan = measured = 2 x closed form",
              "counts exchange B (plan / measured)", "host read B (plan / measured)",
              "plan `bus_bytes` fwd B")  # fmt: skip
    table = Table("(1a) moe-tiny-ds, balanced routing, fp64, on gloo ranks: bytes per rank per MoE layer", header)
    for r in results:
        want = 2 * r["closed"]
        same = r["plan_same"] and all(v == want for ph in r["got"] for v in r["got"][ph] + [r["plan"][ph]])
        extra = [f"{r['extra_plan'][op]:,.0f} / {_spread(r['extra_got'][op])}" for op in ("all_to_all", "host_read")]
        table.rows.append((
            r["mesh"], r["tokens"], f"{r['closed']:,}", f"{r['plan']['forward']:,.0f}", f"{r['plan']['backward']:,.0f}",
            _spread(r["got"]["forward"]), _spread(r["got"]["backward"]), "yes" if same else "**no**", *extra,
            f"{r['plan_bus']:,.0f} ({r['plan_bus'] / want:.2f}x)",
        ))  # fmt: skip
    r = results[0]
    table.notes.append(
        f"k = {r['k']}, h = {r['h']}, E = {r['E']}, 2 MoE layers, global batch 4 x 8; fwd and bwd are each two "
        "all_to_all_v (dispatch, combine). The counts exchange is a `lax.all_to_all` of E int64, counted whole; "
        "the host read is the send and receive counts, 2E int64, once per layer forward."
    )
    return table


# -- (1b) the real shapes, planned on meta ---------------------------------------------------------------
BIG = (("mixtral-8x7b", "ep=8"), ("deepseek-v3", "ep=64"))
SEQ, SEQS_PER_RANK = 4096, 2


def plan_big(name: str, mesh: str) -> dict:
    cfg, m = models.config(name), Mesh.parse(mesh)
    x = torch.empty(SEQS_PER_RANK * m.size, SEQ, dtype=torch.long, device="meta")
    start = time.perf_counter()
    c = compile_model(models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=(x, x),
                      precision=Precision.parse("bf16"))  # fmt: skip
    seconds, layers = time.perf_counter() - start, _moe_layers(cfg)
    records = [(k.phase, k.op.removeprefix("lax."), k.total_bytes, k.bus_bytes) for k in c.plan.collectives]
    tokens = SEQS_PER_RANK * SEQ
    return {
        "name": name, "mesh": mesh, "ep": m.axis_size("ep"), "tokens": tokens, "k": cfg.top_k, "h": cfg.dim,
        "layers": layers, "seconds": seconds, "closed": exchange(tokens, cfg.top_k, cfg.dim, 2, m.axis_size("ep")),
        "plan": {ph: _planned(records, ph, A2AV) / layers for ph in ("forward", "backward")},
        "exchanges": sum(1 for _, op, _, _ in records if op == A2AV),
    }  # fmt: skip


def table_big(results: list[dict]) -> Table:
    header = ("model", "mesh", "T tokens/rank", "k", "h", "MoE layers", "all_to_all_v in plan",
              "closed form, one exchange MiB", "plan fwd MiB", "plan bwd MiB", "plan = 2 x closed form",
              "per step, all layers GiB", "compile s")  # fmt: skip
    table = Table(f"(1b) bf16, {SEQS_PER_RANK} sequences of {SEQ} per rank, planned on meta: bytes per rank per MoE "
                  "layer", header)  # fmt: skip
    for r in results:
        fwd, bwd, want = r["plan"]["forward"], r["plan"]["backward"], 2 * r["closed"]
        table.rows.append((
            r["name"], r["mesh"], f"{r['tokens']:,}", r["k"], r["h"], r["layers"], r["exchanges"],
            f"{r['closed'] / MiB:,.1f}", f"{fwd / MiB:,.1f}", f"{bwd / MiB:,.1f}",
            "yes" if fwd == bwd == want else "**no**", f"{(fwd + bwd) * r['layers'] / GiB:,.1f}", f"{r['seconds']:.1f}",
        ))  # fmt: skip
    table.notes.append("Whole depth (no layer override): both compile in seconds on the meta device.")
    return table


# -- (1c) against transformers --------------------------------------------------------------------------
def table_transformers(small: list[dict], big: list[dict]) -> Table:
    header = ("model", "mesh", "T tokens/rank", "meshlib (plan) fwd+bwd", "transformers AllToAllEP fwd+bwd",
              "transformers AllReduceEP fwd+bwd", "AllReduceEP / meshlib")  # fmt: skip
    table = Table("(1c) against transformers 5.24's expert parallelism (closed form): bytes per rank per MoE "
                  "layer per step", header)  # fmt: skip
    rows = [("moe-tiny-ds (fp64)", r, 8, KiB, "KiB") for r in small] + [(r["name"], r, 2, MiB, "MiB") for r in big]
    for name, r, nbytes, unit, label in rows:
        ours = r["plan"]["forward"] + r["plan"]["backward"]
        theirs_a2a = 4 * exchange(r["tokens"], r["k"], r["h"], nbytes, r["ep"])
        theirs_ar = hf_all_reduce(r["tokens"], r["k"], r["h"], nbytes, r["ep"])
        table.rows.append((
            name, r["mesh"], f"{r['tokens']:,}", f"{ours / unit:,.1f} {label}", f"{theirs_a2a / unit:,.1f} {label}",
            f"{theirs_ar / unit:,.1f} {label}", f"{theirs_ar / ours:.2f}",
        ))  # fmt: skip
    table.notes += [
        "AllToAllEP: the routed rows out and back by all_to_all_single (2 fwd, 2 bwd), as meshlib, after a counts "
        "exchange and one .tolist() per layer; `AutoEP` runs it whenever gradients flow. AllReduceEP "
        '(`ep_implementation="all_reduce"`, or AutoEP at inference; it needs ep_size == tp_size): every rank of the '
        "ep group holds the group's T*ep tokens, runs its own experts on all of them, and all-reduces the output "
        "(fwd) and the gradients of the hidden states and routing weights (bwd), in ring bus bytes 2(ep-1)/ep. "
        "The ratio is about ep/k.",
    ]
    return table


# -- (2) step time: experts over ep against experts replicated on dp ------------------------------------
RACE_MODEL = "moe-tiny"
RACE_CONFIG = {"dim": 128, "n_experts": 16, "moe_hidden_dim": 256}  # experts: 94% of the parameters
RACE_MESHES = ("ep=4", "dp=4")
RACE_BATCH, RACE_SEQ = 16, 64


def _plan_traffic(mesh: str) -> dict:
    """The plan's bytes per rank per step for the race's model on `mesh`: the gradient all-reduces
    (payload) and the experts' all_to_all_v (bytes leaving the rank), and its expert parameters per rank."""
    cfg, m = models.config(RACE_MODEL, **RACE_CONFIG), Mesh.parse(mesh)
    x = torch.empty(RACE_BATCH, RACE_SEQ, dtype=torch.long, device="meta")
    c = compile_model(models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=(x, x))
    shapes = [c.local_param_shape(n) for n in c.traced.params if n.endswith(EXPERT_PARAMS)]
    return {
        "grad": sum(k.total_bytes for k in c.plan.collectives if k.op == "grad sync"),
        "a2a": sum(k.total_bytes for k in c.plan.collectives if k.op == f"lax.{A2AV}"),
        "experts": sum(math.prod(s) for s in shapes), "local": shapes[0][0],
    }  # fmt: skip


def race(rounds: int, steps: int) -> Table:
    pool = get_pool(4)
    before = busy_ticks(), ticks_of(pool.pids)
    r = pool.run(experts_worker.race, RACE_MODEL, RACE_CONFIG, RACE_MESHES, RACE_BATCH, RACE_SEQ, rounds, steps,
                 timeout=1200)[0]  # fmt: skip
    busy, mine = busy_ticks() - before[0], ticks_of(pool.pids) - before[1]
    losses = r["losses"]
    diff = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    if diff > TOLERANCE:
        raise RuntimeError(f"ep=4 and dp=4 take different first steps: {losses}")
    ep, dp = (r["times"][m] for m in RACE_MESHES)
    ratios = [a / b for a, b in zip(ep, dp, strict=True)]
    header = ("mesh", "experts per rank", "expert params per rank", "plan: grad all-reduce MiB",
              "plan: all_to_all_v MiB", "step ms (median)", "ep=4 / dp=4 (median of rounds)", "(quartiles)",
              "rounds x steps", "max loss diff, 2 steps", "CPU taken by other processes")  # fmt: skip
    title = (f"(2) step time, {RACE_MODEL} with {RACE_CONFIG} ({r['params']:,} parameters, {r['experts']:,} in "
             f"experts), fp32, batch {RACE_BATCH} x {RACE_SEQ}, 4 gloo ranks, alternated")  # fmt: skip
    table = Table(title, header)
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    for mesh, times in zip(RACE_MESHES, (ep, dp), strict=True):
        t = _plan_traffic(mesh)
        ours = mesh == RACE_MESHES[0]
        table.rows.append((
            mesh, t["local"], f"{t['experts']:,}", f"{t['grad'] / MiB:.2f}", f"{t['a2a'] / MiB:.2f}",
            f"{statistics.median(times) * 1e3:.1f}", f"**{statistics.median(ratios):.2f}**" if ours else "",
            f"{quart[0]:.2f} - {quart[2]:.2f}" if ours else "", f"{rounds} x {steps}", f"{diff:.1e}",
            f"{max(0, busy - mine) / max(busy, 1):.0%}",
        ))  # fmt: skip
    return table


# -- (3) memory per rank: DeepSeek-V3 on 2,048 ranks -------------------------------------------------------
DS_MESH, DS_MICRO = "dp=2,pp=16,ep=64", 16


def _ds_compile(zero: int, recompute: str = "none"):
    cfg, m = models.config("deepseek-v3"), Mesh.parse(DS_MESH)
    x = torch.empty(m.size // m.axis_size("pp") * DS_MICRO, SEQ, dtype=torch.long, device="meta")
    return compile_model(
        models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=(x, x), zero=zero,
        recompute=recompute, microbatches=DS_MICRO, precision=Precision.parse("bf16"), estimate_memory=True,
    )  # fmt: skip


def _ds_params(plan, cfg, ep: int) -> list[tuple[int, int, int, int]]:
    """Per pp rank: (dense layers, MoE layers, expert parameters per rank, other parameters), from the
    model's own parameters and the plan's stages: experts E/ep per rank, everything else whole (ZeRO-0)."""
    owner = {mod: s.rank for s in plan.stages for mod in s.modules}
    first, last = plan.stages[0].rank, plan.stages[-1].rank
    out = [[0, 0, 0, 0] for _ in range(max(owner.values()) + 1)]
    for name, p in models.build(cfg).named_parameters():
        layer = ".".join(name.split(".")[:2])
        rank = owner.get(layer, first if name.startswith("tok_embeddings") else last)
        if name.endswith(EXPERT_PARAMS):
            out[rank][2] += p.numel() // ep
        else:
            out[rank][3] += p.numel()
    for layer, rank in owner.items():
        out[rank][0 if int(layer.split(".")[1]) < cfg.n_dense_layers else 1] += 1
    return [tuple(r) for r in out]


def memory_at_scale() -> Table:
    start = time.perf_counter()
    zero0, zero1, block = _ds_compile(zero=0), _ds_compile(zero=1), _ds_compile(zero=1, recompute="block")
    seconds = time.perf_counter() - start
    cfg = models.config("deepseek-v3")
    header = ("pp rank", "dense + MoE layers", "experts GiB (closed form)", "the rest GiB (closed form)",
              "ZeRO-0 model state GiB (plan)", "= closed form", "ZeRO-1 model state GiB (plan)",
              "ZeRO-1 closed form GiB", "= closed form", "activations GiB (dry run)", "ZeRO-1 peak GiB (dry run)",
              "ZeRO-1 peak, recompute=block GiB")  # fmt: skip
    table = Table(f"(3) deepseek-v3 on an abstract Mesh({DS_MESH}) (2,048 ranks), bf16 + fp32 masters, "
                  f"{DS_MICRO} microbatches of 1 x {SEQ} per data rank, 1F1B: memory per rank", header)  # fmt: skip
    mesh = Mesh.parse(DS_MESH)
    params = _ds_params(zero0.plan, cfg, mesh.axis_size("ep"))
    dp, data = mesh.axis_size("dp"), mesh.axis_size("dp") * mesh.axis_size("ep")
    rows = zip(zero0.plan.stage_memory, zero1.plan.stage_memory, block.plan.stage_memory, params, strict=True)
    for r, (m0, m1, mb, (dense, moe, experts, rest)) in enumerate(rows):
        state0, state1 = (m.params + m.grads + m.optimizer for m in (m0, m1))
        closed1 = 4 * (experts + rest) + 12 * experts // dp + 12 * rest // data
        table.rows.append((
            r, f"{dense} + {moe}", f"{16 * experts / GiB:.2f}", f"{16 * rest / GiB:.2f}", f"{state0 / GiB:.2f}",
            "yes" if state0 == 16 * (experts + rest) else "**no**", f"{state1 / GiB:.2f}", f"{closed1 / GiB:.2f}",
            "yes" if state1 == closed1 else "**no**", f"{m1.activations / GiB:.1f}", f"{m1.peak / GiB:.1f}",
            f"{mb.peak / GiB:.1f}",
        ))  # fmt: skip
    per_layer = cfg.n_experts // 64 * 3 * cfg.moe_hidden_dim * cfg.dim
    table.notes.append(
        f"Closed forms: ZeRO-0 keeps 16 bytes per parameter (bf16 parameter and gradient, fp32 master and two "
        f"moments); experts E/ep = {cfg.n_experts // 64} per rank and MoE layer, {per_layer:,} parameters "
        f"({16 * per_layer / GiB:.2f} GiB). ZeRO-1 (DeepSeek's own setting) keeps the 4 bytes of the bf16 parameter "
        f"and gradient whole and shards the 12 of the fp32 master and moments over the ranks that hold the same "
        f"parameter: the experts over dp = {dp} (the ep ranks hold other experts), the rest over dp x ep = {data}. "
        f"The three plans with their dry runs took {seconds:.0f} s."
    )
    return table


# -- the run ----------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="(2): rounds, each timing both meshes, alternated")
    ap.add_argument("--steps", type=int, default=2, help="(2): steps of each mesh per round")
    ap.add_argument("--quick", action="store_true", help="3 rounds of (2)")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    print(describe() + "\n")
    small = [measure_small(mesh) for mesh in SMALL]
    big = [plan_big(name, mesh) for name, mesh in BIG]
    tables = [table_small(small), table_big(big), table_transformers(small, big), race(rounds, args.steps)]
    for table in tables:
        table.show()
    memory = memory_at_scale()
    memory.show()
    tables.append(memory)
    print("\nMarkdown:\n")
    print("\n\n".join(t.markdown() for t in tables))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
