"""Pipeline schedules on gloo ranks against the simulator: makespan and bubble.

    python benchmarks/bench_pipeline.py             # about 4 minutes on 2 cores
    python benchmarks/bench_pipeline.py --quick     # p=4 only, 2 steps, no sweep: a smoke test

Every stage is a `pipeline_worker.WaitStage`, whose forward, input-grad and
weight-grad passes sleep for calibrated times (`T` each per rank and
microbatch; a rank with `v` chunks gives each chunk `T / v`), so the ranks
never compete for the 2 cores and the timeline holds only the schedule, the
communication and torch's own bookkeeping. Each rank runs the torch schedule
meshlib builds (`make_schedule`) and records every compute action's (start,
end) with `time.perf_counter` (CLOCK_MONOTONIC on Linux: one clock for every
process on the machine); the script checks that each rank ran the core
schedule's actions in the core's order.

Measured bubble: `1 - busy / (p * makespan)`, the simulator's definition, with
busy the sum of the action spans and the makespan from the first action's start
to the last one's end over all ranks; the median over the timed steps after a
warm-up step. Simulated: `meshlib.simulate` of the same core schedule with the
mean span of each action kind measured in that run and the one-way send/recv
latency measured by ping-pong as `t_comm`. "Simulated + overhead" also charges
what the timeline shows torch spends around each action: the hop a cross-rank
dependency really took as `t_comm`, and the host gap between two actions on a
rank as `t_host` (idle in the bubble, as in the measurement). Closed form: `meshlib.bubble_formula`.

Before any rank starts, one process checks that torch's zero-bubble split puts
the input-grad sleep in I and the weight-grad sleep in W, and the script
refuses to report otherwise. The calibration also prints the sleep overshoot
and what torch's schedule costs per action on one rank with zero-time stages.
The rank-side jobs are in `benchmarks/pipeline_worker.py` (a RankPool pickles
them by qualified name).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pipeline_worker
import torch
from machine import busy_ticks, describe, ticks_of
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

import meshlib
from meshlib import Action
from meshlib_torch.testing.pool import get_pool

SCHEDULES = (("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2), ("zb-h1", None), ("zbv", None))
GOAL = 0.10  # |measured - simulated| bubble, relative to the simulated bubble
MS = 1e3


def markdown(header: tuple, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in body])


# -- calibration ----------------------------------------------------------------------------------
def check_split(t: float) -> dict[str, float]:
    """Time F, I, W and a full B of one non-first `WaitStage` (ms, the second of two tries); raise
    unless I holds the input-grad sleep and W the weight-grad sleep, as torch's zero-bubble split runs them."""
    stage = pipeline_worker.WaitStage(t, 2 * t, 3 * t)  # distinct times, so that a swap shows
    for _ in range(2):  # the first pays torch's one-time set-up
        got, weight_grad_after = _split_times(stage)
    want = {"F": t, "I": 2 * t, "W": 3 * t, "B": 5 * t}
    wrong = {k: f"{got[k]:.1f} ms, wanted {want[k] * MS:.1f}" for k in want if abs(got[k] / MS - want[k]) > t / 4}
    if wrong or weight_grad_after != {"I": False, "W": True}:
        raise SystemExit(f"the stage's I/W split is wrong, not reporting: {wrong}; weight grad: {weight_grad_after}")
    return got


def _split_times(stage) -> tuple[dict[str, float], dict[str, bool]]:
    got: dict[str, float] = {}
    stage.zero_grad(set_to_none=True)
    x, grad = torch.zeros(1, pipeline_worker.WIDTH, requires_grad=True), torch.ones(1, pipeline_worker.WIDTH)
    out = _timed(got, "F", stage, x)
    _, groups = _timed(got, "I", stage_backward_input, [out], [grad], [x], stage.parameters())
    after = {"I": stage.weight.grad is not None}
    _timed(got, "W", stage_backward_weight, stage.parameters(), groups)
    after["W"] = stage.weight.grad is not None
    _timed(got, "B", stage_backward, [stage(x)], [grad], [x])
    return got, after


def _timed(into: dict, key: str, fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    into[key] = (time.perf_counter() - start) * MS
    return result


def sleep_overshoot(t: float, n: int = 20) -> float:
    """Median ms by which `time.sleep(t)` overshoots."""
    spans: dict[str, float] = {}
    over = []
    for _ in range(n):
        _timed(spans, "sleep", time.sleep, t)
        over.append(spans["sleep"] - t * MS)
    return statistics.median(over)


def calibration(t: float) -> float:
    """Print the split check, the sleep overshoot and the p2p latency; return t_comm (ms)."""
    split = check_split(t)
    parts = ", ".join(f"{k} {v:.2f} ms" for k, v in split.items())
    print(
        f"- I/W split, one process, a stage with F {t * MS:g} / I {2 * t * MS:g} / W {3 * t * MS:g} ms: {parts}; "
        "weight grad only after W: ok"
    )
    over = {x: sleep_overshoot(x) for x in (t / 2, t)}
    print("- sleep overshoot (median of 20): " + ", ".join(f"{x * MS:g} ms +{o:.3f} ms" for x, o in over.items()))
    inside, between = runtime_cost(8)
    print(
        f"- torch's schedule on one rank with zero-time stages (1f1b, m=8, mean over 5 steps): {inside:.3f} ms inside "
        f"each action, {between:.3f} ms between actions"
    )
    samples = [s * MS for s in get_pool(2).run(pipeline_worker.latency, 300, timeout=120)[0][20:]]
    t_comm, p90 = statistics.median(samples), statistics.quantiles(samples, n=10)[-1]
    print(
        f"- send/recv one way, ranks 0 and 1 (half a round trip of a 1 x {pipeline_worker.WIDTH} fp32 activation, "
        f"gloo, median of {len(samples)}): {t_comm:.3f} ms (p90 {p90:.3f} ms)\n"
    )
    return t_comm


def runtime_cost(m: int) -> tuple[float, float]:
    """Mean ms torch's 1F1B spends inside each action and between actions, on one rank whose stage
    takes no time: its per-action bookkeeping, with no communication."""
    steps = get_pool(1).run(pipeline_worker.run_schedule, "1f1b", m, None, (0.0, 0.0, 0.0), 5, timeout=120)[0]
    rows = [_timeline([step])[0] for step in steps["steps"]]
    inside = statistics.fmean(b - a for row in rows for a, b, _ in row)
    between = statistics.fmean(nxt[0] - prev[1] for row in rows for prev, nxt in zip(row, row[1:], strict=False))
    return inside, between


# -- one schedule on the ranks -----------------------------------------------------------------------
def run(name: str, p: int, m: int, v: int | None, t: float, steps: int) -> dict:
    """Schedule `name` on `p` ranks: the core schedule, each timed step (ms) and the CPU others took."""
    core, pool = meshlib.schedule(name, p, m, v), get_pool(p)
    before = _others_ticks(pool.pids), time.perf_counter()
    per_rank = pool.run(pipeline_worker.run_schedule, name, m, v, (t, t, t), steps, timeout=600)
    others = (_others_ticks(pool.pids) - before[0]) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - before[1])
    for r in per_rank:
        ran = [Action(kind, s, mb) for _, _, kind, s, mb in r["warmup"]]
        if ran != list(core.actions[r["rank"]]):
            raise SystemExit(f"{name} p={p}: rank {r['rank']} ran {' '.join(map(str, ran))}, not the core order")
    timed = [_timeline([r["steps"][i] for r in per_rank]) for i in range(steps)]
    return {"core": core, "steps": timed, "others": others}


def _timeline(rows: list[list[tuple]]) -> tuple:
    """Every rank's (start, end, Action) in ms from the step's first start."""
    t0 = min(rec[0] for row in rows for rec in row)
    return tuple(tuple(((a - t0) * MS, (b - t0) * MS, Action(k, s, mb)) for a, b, k, s, mb in row) for row in rows)


def _others_ticks(pids) -> int:
    """Busy CPU ticks of the whole machine minus those of `pids` and this process."""
    return busy_ticks() - ticks_of((*pids, os.getpid()))


# -- reading a timeline ------------------------------------------------------------------------------
def makespan_bubble(p: int, timeline) -> tuple[float, float]:
    end = max(row[-1][1] for row in timeline if row)
    busy = sum(b - a for row in timeline for a, b, _ in row)
    return end, 1 - busy / (p * end)


def kind_times(steps: list) -> dict[str, float]:
    """Mean span (ms) of each action kind. I and W over the stages after the first: torch runs stage
    0's whole backward in its W (its input needs no gradient), so stage 0's are kept apart as I0, W0."""
    spans: dict[str, list[float]] = {}
    for timeline in steps:
        for row in timeline:
            for a, b, act in row:
                key = act.kind + ("0" if act.stage == 0 and act.kind in "IW" else "")
                spans.setdefault(key, []).append(b - a)
    return {k: statistics.fmean(v) for k, v in spans.items()}


def gaps(core, steps: list) -> tuple[float, float]:
    """Two means (ms) over the timed steps. Hop: from a cross-rank producer's end to its consumer's
    start, where the consumer's rank sat waiting for it. Host: from an action's end to the next one's
    start on the same rank, where the next one had nothing left to wait for."""
    hops, host = [], []
    for timeline in steps:
        done = {_result(act): b for row in timeline for _, b, act in row}
        for r, row in enumerate(timeline):
            for (_, free, _), (a, _, act) in zip(row, row[1:], strict=False):
                waited = [done[n] for n in _cross_rank_needs(core, act, r) if done[n] > free]
                (hops if waited else host).append(a - max(waited, default=free))
    return statistics.fmean(hops) if hops else 0.0, statistics.fmean(host)


def _result(act: Action) -> Action:
    """What a consumer waits for: a B is looked up as the I it contains."""
    return Action("I", act.stage, act.microbatch) if act.kind == "B" else act


def _cross_rank_needs(core, act: Action, rank: int) -> list[Action]:
    if act.kind == "F" and act.stage:
        needs = [Action("F", act.stage - 1, act.microbatch)]
    elif act.kind in "BI" and act.stage < core.stages - 1:
        needs = [Action("I", act.stage + 1, act.microbatch)]
    else:
        needs = []
    return [n for n in needs if core.placement[n.stage] != rank]


# -- the simulator on the measured numbers ---------------------------------------------------------------
def simulate(core, k: dict[str, float], t_comm: float, t_host: float = 0.0) -> meshlib.Simulation:
    """`meshlib.simulate` with the measured per-kind times (ms)."""
    if core.split_backward:
        return meshlib.simulate(core, t_f=k["F"], t_b=k["I"] + k["W"], t_w=k["W"], t_comm=t_comm, t_host=t_host)
    return meshlib.simulate(core, t_f=k["F"], t_b=k["B"], t_comm=t_comm, t_host=t_host)


def summarize(name: str, p: int, m: int, v: int | None, t: float, steps: int, t_comm: float) -> dict:
    """Run one schedule and set it beside the simulator and the closed form (times in ms)."""
    res = run(name, p, m, v, t, steps)
    core, timed = res["core"], res["steps"]
    measured = [makespan_bubble(p, tl) for tl in timed]
    k = kind_times(timed)
    hop, host = gaps(core, timed)
    sim, over = simulate(core, k, t_comm), simulate(core, k, hop, host)
    middle = sorted(range(steps), key=lambda i: measured[i][0])[steps // 2]
    return {
        "name": name, "p": p, "m": m, "v": core.v, "t": t * MS, "core": core, "times": k, "hop": hop, "host": host,
        "makespan": statistics.median(x[0] for x in measured), "bubble": statistics.median(x[1] for x in measured),
        "range": (min(x[0] for x in measured), max(x[0] for x in measured)), "others": res["others"],
        "sim": sim, "sim_bubble": sim.bubble, "over": over, "over_bubble": over.bubble,
        "closed": meshlib.bubble_formula(name, p, m, v), "timeline": timed[middle],
    }  # fmt: skip


# -- tables ------------------------------------------------------------------------------------------
RESULT_HEADER = (
    "schedule", "p", "m", "v", "measured makespan ms", "simulated makespan ms", "measured / simulated",
    "measured bubble", "simulated bubble", "closed form", "diff (points)", "diff / simulated", "within 10%",
    "simulated + overhead: makespan ms", "bubble",
)  # fmt: skip
INPUT_HEADER = (
    "schedule", "p", "v", "F ms", "B ms", "I ms", "W ms", "stage 0: I / W ms", "hop seen ms", "host gap ms",
    "makespan range ms", "other processes' CPU (cores)",
)  # fmt: skip
SWEEP_HEADER = ("schedule", "T ms", "measured bubble", "simulated", "diff (points)", "diff / simulated",
                "within 10%", "simulated + overhead", "hop / host gap ms", "other processes' CPU (cores)")  # fmt: skip


def _diff(s: dict) -> tuple[str, str, str]:
    d = s["bubble"] - s["sim_bubble"]
    return f"{d * 100:+.2f}", f"{d / s['sim_bubble']:+.1%}", "yes" if abs(d) <= GOAL * s["sim_bubble"] else "**no**"


def result_row(s: dict) -> tuple:
    return (
        s["name"], s["p"], s["m"], s["v"], f"{s['makespan']:.1f}", f"{s['sim'].makespan:.1f}",
        f"{s['makespan'] / s['sim'].makespan:.3f}", f"{s['bubble']:.2%}", f"{s['sim_bubble']:.2%}",
        f"{s['closed']:.2%}", *_diff(s), f"{s['over'].makespan:.1f}", f"{s['over_bubble']:.2%}",
    )  # fmt: skip


def input_row(s: dict) -> tuple:
    k = {key: f"{val:.2f}" for key, val in s["times"].items()}
    return (
        s["name"], s["p"], s["v"], k["F"], k.get("B", "-"), k.get("I", "-"), k.get("W", "-"),
        f"{k['I0']} / {k['W0']}" if "I0" in k else "-", f"{s['hop']:.2f}", f"{s['host']:.2f}",
        f"{s['range'][0]:.1f} - {s['range'][1]:.1f}", f"{s['others']:.2f}",
    )  # fmt: skip


def sweep_row(s: dict) -> tuple:
    d = _diff(s)
    return (s["name"], f"{s['t']:g}", f"{s['bubble']:.2%}", f"{s['sim_bubble']:.2%}", *d,
            f"{s['over_bubble']:.2%}", f"{s['hop']:.2f} / {s['host']:.2f}", f"{s['others']:.2f}")  # fmt: skip


def verdicts(summaries: list[dict]) -> list[str]:
    """The goals in words: zero-bubble below 1F1B, measured bubble within 10% of the simulated."""
    by = {s["name"]: s for s in summaries}
    if "1f1b" not in by:
        return []
    p, t, base = summaries[0]["p"], summaries[0]["t"], by["1f1b"]["bubble"]
    out = [
        f"p={p}, T={t:g} ms: {n} measured bubble {by[n]['bubble']:.2%} {'<' if by[n]['bubble'] < base else '>='} "
        f"1f1b's {base:.2%}"
        for n in ("zb-h1", "zbv")
        if n in by
    ]
    ok = [s["name"] for s in summaries if _diff(s)[2] == "yes"]
    misses = [s["name"] for s in summaries if s["name"] not in ok]
    worst = max(summaries, key=lambda s: abs(s["bubble"] - s["over_bubble"]) / s["over_bubble"])
    off = (worst["bubble"] - worst["over_bubble"]) / worst["over_bubble"]
    return out + [
        f"p={p}, T={t:g} ms: measured bubble within 10% of the simulated: {', '.join(ok) or 'none'}; "
        f"outside: {', '.join(misses) or 'none'}",
        f"p={p}, T={t:g} ms: measured bubble against the simulated + overhead: {off:+.1%} at worst ({worst['name']})",
    ]


def gantt_png(summaries: list[dict], path: str) -> None:
    """Measured (median step, left) and simulated (right) timelines of every schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summaries), 2, figsize=(22, 2.3 * len(summaries)), squeeze=False)
    for row, s in zip(axes, summaries, strict=True):
        end, bubble = makespan_bubble(s["p"], s["timeline"])
        measured = meshlib.Simulation(s["core"], s["timeline"], end, bubble, (), 0, 0, None, 0)
        meshlib.gantt(measured, ax=row[0])
        row[0].set_title(f"{s['name']}: measured, median step, bubble {bubble:.1%}")
        meshlib.gantt(s["sim"], ax=row[1])
        row[1].set_title(f"{s['name']}: simulated, measured times, t_comm {s['sim'].t_comm:.2f} ms, "
                         f"bubble {s['sim'].bubble:.1%}")  # fmt: skip
        for ax in row:
            ax.set_xlim(0, max(end, s["sim"].makespan))
            ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


# -- the run ---------------------------------------------------------------------------------------------
def parse_sweep(spec: str) -> list[tuple[float, list[str]]]:
    """'20,80,160:zbv' -> [(20, every schedule), (80, every schedule), (160, ['zbv'])]."""
    out = []
    for item in filter(None, spec.split(",")):
        t, _, names = item.partition(":")
        out.append((float(t), names.split("+") if names else [name for name, _ in SCHEDULES]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=float, default=40.0, help="ms per rank and microbatch for each of F, I and W")
    ap.add_argument(
        "--sweep", default="20,80,160:zb-h1+zbv,320:zbv", help="more T (ms) at p=4, 'T:name+name' for some schedules"
    )
    ap.add_argument("--m", type=int, default=8, help="microbatches")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per schedule, after one warm-up step")
    ap.add_argument("--png", default="benchmarks/pipeline_timeline.png", help="Gantt of p=4 ('' for none)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    ps, steps = ((4,), 2) if args.quick else ((4, 2), args.steps)
    start, t = time.perf_counter(), args.t / MS
    print(describe())
    t_comm = calibration(t)
    notes, swept = [], []
    for p in ps:
        summaries = [summarize(name, p, args.m, v, t, steps, t_comm) for name, v in SCHEDULES]
        print(f"p={p}, m={args.m}, T = {args.t:g} ms for each of F, I and W per rank and microbatch; median of "
              f"{steps} steps after a warm-up; simulated with t_comm = {t_comm:.3f} ms\n")  # fmt: skip
        print(markdown(RESULT_HEADER, [result_row(s) for s in summaries]) + "\n")
        print(markdown(INPUT_HEADER, [input_row(s) for s in summaries]) + "\n")
        notes += verdicts(summaries)
        if p == 4:
            swept += summaries
            if args.png:
                gantt_png(summaries, args.png)
                notes.append(f"Gantt of p=4 written to {args.png}")
    for x, names in [] if args.quick else parse_sweep(args.sweep):
        more = [summarize(name, 4, args.m, v, x / MS, steps, t_comm) for name, v in SCHEDULES if name in names]
        swept += more
        notes += verdicts(more)
    if len(swept) > len(SCHEDULES):
        order = [name for name, _ in SCHEDULES]
        rows = [sweep_row(s) for s in sorted(swept, key=lambda s: (order.index(s["name"]), s["t"]))]
        print(f"p=4, m={args.m}: the bubble against T (median of {steps} steps each)\n")
        print(markdown(SWEEP_HEADER, rows) + "\n")
    print("\n".join(f"- {n}" for n in notes))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at the end (1, 5, 15 min): {load}")


if __name__ == "__main__":
    main()
