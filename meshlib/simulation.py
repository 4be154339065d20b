"""Run a pipeline `Schedule` on a clock: check it, time it, measure its bubble and memory.

Each rank runs its actions in order. An action starts when its rank is free and
what it needs is done, and a result that crosses ranks arrives `t_comm` later. A rank
is free `t_host` after its last action ends: the runtime's own time per action (posting
sends and receives, bookkeeping), which counts as idle in the bubble.

- F of stage s needs F of stage s - 1 (same microbatch);
- B or I of stage s needs F of stage s and B or I of stage s + 1 (the last stage: its F);
- W of stage s needs I of stage s.

Example:
    >>> from meshlib.schedules import one_f_one_b
    >>> sim = simulate(one_f_one_b(4, 8))
    >>> sim.makespan, round(sim.bubble, 4), sim.peak_inflight
    (33.0, 0.2727, (4, 3, 2, 1))
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .schedules import Action, Schedule, check_counts, check_rounds, resolve_schedule

__all__ = ["Simulation", "bubble_formula", "gantt", "simulate", "validate_schedule"]

_COLOURS = {"F": "#80b1d3", "B": "#fb8072", "I": "#fdb462", "W": "#b3de69"}
_KIND_LABELS = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


@dataclass(frozen=True, slots=True)
class Simulation:
    """The timed run of a schedule.

    `timelines[r]` lists rank r's `(start, end, action)` in order. `bubble` is the idle share of
    all ranks' time, `1 - busy / (p * makespan)`. `peak_inflight[r]` is the most stage-chunk
    activations rank r holds at once: forwards whose B or I has not finished (a W needs less,
    as in the zero-bubble papers, and is not counted). With `v` chunks per rank each one is
    `1 / v` of a rank's layers.
    """

    schedule: Schedule
    timelines: tuple[tuple[tuple[float, float, Action], ...], ...]
    makespan: float
    bubble: float
    peak_inflight: tuple[int, ...]
    t_f: float
    t_b: float
    t_w: float | None
    t_comm: float
    t_host: float = 0.0

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank spends computing."""
        return tuple(sum(end - start for start, end, _ in row) for row in self.timelines)

    def __str__(self) -> str:
        s = self.schedule
        return (
            f"{s.name or 'schedule'} p={s.p} m={s.m} v={s.v}: makespan {self.makespan:g}, "
            f"bubble {self.bubble:.2%}, peak in-flight {list(self.peak_inflight)}"
        )


def simulate(
    schedule: Schedule,
    /,
    *,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
    t_comm: float = 0.0,
    t_host: float = 0.0,
) -> Simulation:
    """Time `schedule`: F takes `t_f` and a full B takes `t_b`. Where the backward is split, W
    takes `t_w` (default `t_b / 2`) and I takes `t_b - t_w`; `t_w` is ignored for full B's.
    Times are per action, i.e. per stage-chunk and microbatch: to compare an interleaved
    schedule with `v` chunks against a plain one on the same model, divide its times by `v`.
    A result reaches another rank `t_comm` after it ends; a rank starts its next action no
    sooner than `t_host` after its last one ends (host time per action, idle in the bubble).
    Raises ValueError when the schedule is malformed or deadlocks.

    Example:
        >>> from meshlib.schedules import zb_h1
        >>> sim = simulate(zb_h1(4, 8), t_f=1, t_b=2, t_w=1)
        >>> sim.makespan, sim.peak_inflight
        (27.0, (4, 3, 2, 1))
    """
    durations = _durations(schedule, t_f, t_b, t_w)
    _check_actions(schedule)
    t_comm, t_host = _nonnegative("t_comm", t_comm), _nonnegative("t_host", t_host)
    timelines = _run(schedule, durations, t_comm, t_host)
    makespan = max((row[-1][1] for row in timelines if row), default=0.0)
    busy = sum(end - start for row in timelines for start, end, _ in row)
    bubble = 1.0 - busy / (schedule.p * makespan) if makespan else 0.0
    peaks = tuple(_peak_inflight(row) for row in schedule.actions)
    return Simulation(schedule, timelines, makespan, bubble, peaks, t_f, t_b, t_w, t_comm, t_host)


def validate_schedule(schedule: Schedule, /) -> None:
    """Raise ValueError unless `schedule` is complete, well placed and runs without deadlock:
    every (stage, microbatch) has one F and either one B or one I and one W, each on the rank
    that holds the stage; and the ranks, each running its list in order, can finish them all.

    Example:
        >>> from meshlib.schedules import Action, Schedule
        >>> F = {(s, i): Action("F", s, i) for s in (0, 1) for i in (0, 1)}
        >>> B = {(s, i): Action("B", s, i) for s in (0, 1) for i in (0, 1)}
        >>> rank1 = [F[1, 0], F[1, 1], B[1, 0], B[1, 1]]
        >>> validate_schedule(Schedule("mine", 2, 2, 1, (0, 1), [[F[0, 0], F[0, 1], B[0, 0], B[0, 1]], rank1]))
        >>> validate_schedule(Schedule("mine", 2, 2, 1, (0, 1), [[F[0, 0], B[0, 0], F[0, 1], B[0, 1]], rank1]))
        Traceback (most recent call last):
        ValueError: schedule 'mine' deadlocks, no rank can move on:
          B0@s0 (next on rank 0) needs B0@s1, queued behind F1@s1 on rank 1
          F1@s1 (next on rank 1) needs F1@s0, queued behind B0@s0 on rank 0
        Reorder the lists so that each action comes after the actions it needs.
    """
    simulate(schedule)


def bubble_formula(name: str, p: int, m: int, v: int | None = None) -> float:
    """The published bubble fraction (idle share of `p * makespan`) of schedule `name`, with `v`
    resolved as `schedule` does. No communication time; equal per-action times where noted:

    - gpipe, 1f1b: `(p - 1) / (m + p - 1)`, for any t_F and t_B (Huang et al. 2019;
      Narayanan et al. 2021).
    - interleaved-1f1b: `(p - 1) / (v m + p - 1)`, i.e. Narayanan et al.'s bubble-to-compute ratio
      `(1 / v) (p - 1) / m` taken as a share of the total; each chunk does `1 / v` of a stage's work.
    - zb-h1: Qi et al. 2023 give `(p - 1)(t_F + t_I - t_W)` idle per rank against
      `m (t_F + t_I + t_W)` of work; with `t_F = t_I = t_W` that is `(p - 1) / (3m + p - 1)`, about
      a third of 1F1B's. Needs `m >= p`. (The simulator matches the general form whenever
      `t_W <= min(t_F, t_I)`.) With `v > 1` chunks (the interleaved variant) the same reasoning
      gives `(p - 1) / (3 v m + p - 1)`; that one is ours, checked against the simulator.
    - zbv: with equal per-chunk times every rank idles only the `p - 1` chunk-steps the first
      forward needs to reach the last rank, so `(p - 1) / (6m + p - 1)`: half of ZB-H1's for the
      same model, and the least any schedule can do. Qi et al. call it zero bubble ("almost": they
      leave out this start-up). Needs `m >= 2p - 1`, the microbatches that fill the V.

    Example:
        >>> bubble_formula("1f1b", 4, 8), bubble_formula("zb-h1", 4, 8), bubble_formula("zbv", 4, 8)
        (0.2727272727272727, 0.1111111111111111, 0.058823529411764705)
    """
    canonical, v = resolve_schedule(name, v)
    check_counts(canonical, p=p, m=m, v=v)
    if canonical in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if canonical == "interleaved-1f1b":
        if v > 1:
            check_rounds(canonical, p, m)
        return (p - 1) / (v * m + p - 1)
    need = p if canonical == "zb-h1" else 2 * p - 1
    if m < need:
        raise ValueError(
            f"the published {canonical} bubble assumes m >= {need} microbatches (p={p}); got m={m}. "
            f"Use meshlib.simulate(meshlib.schedule({canonical!r}, {p}, {m})).bubble instead"
        )
    if canonical == "zb-h1" and v > 1:
        check_rounds(canonical, p, m)
    work = 3 * v * m if canonical == "zb-h1" else 6 * m
    return (p - 1) / (work + p - 1)


# -- checks ------------------------------------------------------------------------------------


def _nonnegative(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"simulate: {name} must be a number >= 0, got {value!r}")
    return float(value)


def _durations(schedule: Schedule, t_f: float, t_b: float, t_w: float | None) -> dict[str, float]:
    f, b = _nonnegative("t_f", t_f), _nonnegative("t_b", t_b)
    w = b / 2 if t_w is None else _nonnegative("t_w", t_w)
    if w > b:
        raise ValueError(f"simulate: t_w={t_w!r} must lie in [0, t_b={t_b!r}]; I takes t_b - t_w")
    return {"F": f, "B": b, "I": b - w, "W": w}


def _check_actions(schedule: Schedule) -> None:
    name, seen = schedule.name or "schedule", Counter()
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.stage >= schedule.stages or a.microbatch >= schedule.m:
                raise ValueError(
                    f"{name}: {a} on rank {rank} is out of range: stages are 0..{schedule.stages - 1} "
                    f"and microbatches 0..{schedule.m - 1}"
                )
            if schedule.placement[a.stage] != rank:
                raise ValueError(
                    f"{name}: {a} is on rank {rank}, but stage {a.stage} lives on rank "
                    f"{schedule.placement[a.stage]}; move it there"
                )
            seen[a] += 1
    if twice := [a for a, n in seen.items() if n > 1]:
        raise ValueError(f"{name}: {twice[0]} appears {seen[twice[0]]} times; each action runs exactly once")
    for s in range(schedule.stages):
        for i in range(schedule.m):
            _check_complete(name, seen, s, i)


def _check_complete(name: str, seen: Counter, s: int, i: int) -> None:
    has = {k for k in "FBIW" if Action(k, s, i) in seen}
    if has in ({"F", "B"}, {"F", "I", "W"}):
        return
    if "B" in has and has & {"I", "W"}:
        raise ValueError(f"{name}: stage {s}, microbatch {i} has B{i}@s{s} and a split I/W; use one or the other")
    need = ["F"] + (["B"] if not has & {"I", "W"} else ["I", "W"])
    missing = [f"{k}{i}@s{s}" for k in need if k not in has]
    raise ValueError(
        f"{name}: missing {', '.join(missing)}: every stage and microbatch needs one F and "
        f"either one B or one I and one W"
    )


def _peak_inflight(row: tuple[Action, ...]) -> int:
    live = peak = 0
    for a in row:
        live += (a.kind == "F") - (a.kind in "BI")
        peak = max(peak, live)
    return peak


# -- the clock -----------------------------------------------------------------------------------


def _needs(a: Action, last_stage: int) -> list[Action]:
    """The actions `a` waits for (B and I are looked up under 'I': both produce the input grad)."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.microbatch)] if a.stage else []
    if a.kind == "W":
        return [Action("I", a.stage, a.microbatch)]
    own = [Action("F", a.stage, a.microbatch)]
    return own + ([Action("I", a.stage + 1, a.microbatch)] if a.stage < last_stage else [])


def _run(schedule: Schedule, durations: dict[str, float], t_comm: float, t_host: float) -> tuple:
    """Each rank runs its next action as soon as it can; ranks are swept until nobody moves."""
    p, last, placement = schedule.p, schedule.stages - 1, schedule.placement
    done: dict[Action, float] = {}
    heads, free = [0] * p, [0.0] * p
    rows: list[list] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(schedule.actions):
            while heads[r] < len(actions):
                a = actions[heads[r]]
                needs = _needs(a, last)
                ready = [done.get(n) for n in needs]
                if None in ready:
                    break
                hops = [t + (t_comm if placement[n.stage] != r else 0.0) for n, t in zip(needs, ready, strict=True)]
                start = max([free[r], *hops])
                end = start + durations[a.kind]
                free[r] = end + t_host
                done[Action("I", a.stage, a.microbatch) if a.kind == "B" else a] = end
                rows[r].append((start, end, a))
                heads[r] += 1
                moved = True
    if any(h < len(row) for h, row in zip(heads, schedule.actions, strict=True)):
        raise ValueError(_deadlock_message(schedule, heads, done))
    return tuple(map(tuple, rows))


def _deadlock_message(schedule: Schedule, heads: list[int], done: dict) -> str:
    """Name each rank's stuck action, what it needs, and where that is queued."""
    last = schedule.stages - 1
    where = {}
    for r, row in enumerate(schedule.actions):
        for a in row:
            where[Action("I", a.stage, a.microbatch) if a.kind == "B" else a] = (r, a)
    lines = []
    for r, row in enumerate(schedule.actions):
        if heads[r] == len(row):
            continue
        a = row[heads[r]]
        owner, wait = where[next(n for n in _needs(a, last) if n not in done)]
        blocker = schedule.actions[owner][heads[owner]]
        if blocker == wait:
            lines.append(f"{a} (next on rank {r}) needs {wait}, which is stuck too (next on rank {owner})")
        else:
            behind = "it" if blocker == a else blocker
            lines.append(f"{a} (next on rank {r}) needs {wait}, queued behind {behind} on rank {owner}")
    return "\n  ".join([f"schedule {schedule.name!r} deadlocks, no rank can move on:", *lines]) + (
        "\nReorder the lists so that each action comes after the actions it needs."
    )


# -- the picture ---------------------------------------------------------------------------------


def gantt(result: Simulation, /, ax=None):
    """Draw `result` as a Gantt chart on `ax` (a new figure when None) and return the axes:
    one row per rank (rank 0 on top), one box per action coloured by kind, its microbatch
    written inside; chunks after a rank's first are hatched. Needs matplotlib (`meshlib[plot]`).

    Example:
        >>> from meshlib.schedules import zbv
        >>> ax = gantt(simulate(zbv(2, 4)))  # doctest: +SKIP
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("gantt() needs matplotlib: pip install 'meshlib[plot]'") from err
    if ax is None:
        width = min(20.0, max(6.0, len(max(result.timelines, key=len)) / 3))
        _, ax = plt.subplots(figsize=(width, 0.6 * result.schedule.p + 1.2))
    s = result.schedule
    first = {r: min(st for st in range(s.stages) if s.placement[st] == r) for r in set(s.placement)}
    for r, row in enumerate(result.timelines):
        for start, end, a in row:
            hatch = "//" if a.stage != first[r] else None
            ax.barh(r, end - start, left=start, height=0.8, color=_COLOURS[a.kind], edgecolor="black", hatch=hatch)
            ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(s.p), [f"rank {r}" for r in range(s.p)])
    ax.set_ylim(s.p - 0.5, -0.5)
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{s.name or 'schedule'}: p={s.p}, m={s.m}, v={s.v}, bubble {result.bubble:.1%}")
    kinds = sorted({a.kind for row in s.actions for a in row}, key="FBIW".index)
    ax.legend(
        handles=[Patch(color=_COLOURS[k], label=f"{k}: {_KIND_LABELS[k]}") for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    return ax
