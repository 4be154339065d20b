"""Pipeline schedules as pure data: which rank runs which action, in what order.

A schedule splits the model into `p * v` stages over `p` pipeline ranks (`v` chunks per
rank) and the batch into `m` microbatches. Each rank runs its tuple of `Action`s in order.
`meshlib.simulate` times a schedule and `meshlib.validate` checks that it can run at all.

| name               | generator          | v       | m                        | source                    |
| ------------------ | ------------------ | ------- | ------------------------ | ------------------------- |
| `gpipe`            | `gpipe`            | 1       | any                      | Huang et al. 2019         |
| `1f1b`             | `one_f_one_b`      | 1       | any                      | Narayanan et al. 2021     |
| `interleaved-1f1b` | `interleaved_1f1b` | 2, any  | multiple of p            | Narayanan et al. 2021     |
| `zb-h1`            | `zb_h1`            | 1, any  | any; v > 1: multiple of p | Qi et al. 2023, ZB-H1     |
| `zbv`              | `zbv`              | 2       | any                      | Qi et al. 2023, ZB-V      |

(1F1B is PipeDream-flush; interleaved-1f1b is Megatron's; a default v comes first.)

`schedule(name, p, m, v)` builds one by name and also takes torch.distributed.pipelining's
class names (`ScheduleGPipe`, ..., `ScheduleZBVZeroBubble`); the per-rank orders are the ones
those classes run in torch 2.13 (`ScheduleInterleavedZeroBubble` is `zb_h1` with v=2 by default).

Example:
    >>> s = one_f_one_b(2, 3)
    >>> print(s)
    1f1b: p=2, m=3, v=1
    rank 0: F0@s0 F1@s0 B0@s0 F2@s0 B1@s0 B2@s0
    rank 1: F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1
    >>> s.actions[0][2]
    Action('B', stage=0, microbatch=0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ACTION_KINDS",
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule",
    "zb_h1",
    "zbv",
]

ACTION_KINDS = {
    "F": "forward",
    "B": "full backward (input grad and weight grad together)",
    "I": "backward for the input grad only (called B in the zero-bubble papers)",
    "W": "weight grad, after the I of the same stage and microbatch",
}


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work: `kind` ('F', 'B', 'I' or 'W') of `microbatch` at `stage`.

    Example:
        >>> a = Action("I", stage=1, microbatch=3)
        >>> a, str(a)
        (Action('I', stage=1, microbatch=3), 'I3@s1')
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {tuple(ACTION_KINDS)}")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Action {name} must be an int >= 0, got {value!r}")

    def __repr__(self) -> str:
        return f"Action({self.kind!r}, stage={self.stage}, microbatch={self.microbatch})"

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank action lists for `p` ranks, `m` microbatches and `v` chunks (stages) per rank.

    `placement[s]` is the rank that holds stage `s`; there are `p * v` stages.
    `actions[r]` is what rank `r` runs, in order. Build one with a generator
    (`gpipe`, `one_f_one_b`, ...) or by hand; `meshlib.validate` checks it.
    """

    name: str
    p: int
    m: int
    v: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"Schedule name must be a str, got {self.name!r}")
        check_counts(self.name or "Schedule", p=self.p, m=self.m, v=self.v)
        _set = object.__setattr__
        _set(self, "placement", tuple(self.placement))
        if isinstance(self.actions, Mapping):
            if bad := sorted(set(self.actions) - set(range(self.p)), key=repr):
                raise ValueError(f"Schedule actions name ranks {bad} outside 0..{self.p - 1}")
            _set(self, "actions", tuple(self.actions.get(r, ()) for r in range(self.p)))
        _set(self, "actions", tuple(tuple(row) for row in self.actions))
        for r, row in enumerate(self.actions):
            if bad := [a for a in row if not isinstance(a, Action)]:
                raise TypeError(f"Schedule rank {r} lists {bad[0]!r}, which is not an Action")
        if len(self.placement) != self.p * self.v:
            raise ValueError(
                f"Schedule placement has {len(self.placement)} stages; p * v = {self.p} * {self.v} "
                f"= {self.p * self.v} were needed"
            )
        if bad := [r for r in self.placement if not 0 <= r < self.p]:
            raise ValueError(f"Schedule placement names ranks {bad} outside 0..{self.p - 1}")
        if len(self.actions) != self.p:
            raise ValueError(f"Schedule has action lists for {len(self.actions)} ranks, p={self.p} were needed")

    @property
    def stages(self) -> int:
        return self.p * self.v

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W actions (the zero-bubble schedules)."""
        return any(a.kind in "IW" for row in self.actions for a in row)

    def __str__(self) -> str:
        head = f"{self.name or 'schedule'}: p={self.p}, m={self.m}, v={self.v}"
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions)])


# -- the generators ---------------------------------------------------------------------------


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward. Holds all `m` activations.

    Example:
        >>> print(gpipe(2, 2))
        gpipe: p=2, m=2, v=1
        rank 0: F0@s0 F1@s0 B0@s0 B1@s0
        rank 1: F0@s1 F1@s1 B0@s1 B1@s1
    """
    check_counts("gpipe", p=p, m=m)
    rows = [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]
    return Schedule("gpipe", p, m, 1, tuple(range(p)), tuple(map(tuple, rows)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, PipeDream-flush (Narayanan et al. 2021): `p - 1 - r` warm-up forwards on rank `r`, then
    alternate one forward and one backward. Rank `r` holds at most `min(p - r, m)` activations.

    Example:
        >>> print(*one_f_one_b(4, 6).actions[1])
        F0@s1 F1@s1 F2@s1 B0@s1 F3@s1 B1@s1 F4@s1 B2@s1 F5@s1 B3@s1 B4@s1 B5@s1
    """
    check_counts("1f1b", p=p, m=m)
    rows = [_one_f_one_b_row([(r, i) for i in range(m)], [(r, i) for i in range(m)], p - 1 - r) for r in range(p)]
    return Schedule("1f1b", p, m, 1, tuple(range(p)), tuple(rows))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2): `v` chunks per rank,
    stage `s` on rank `s % p`. Microbatches go through a rank's chunks in groups of `p`
    (depth first), so `m` must be a multiple of `p`, as Megatron requires. Rank `r` warms up
    with `2 (p - 1 - r) + (v - 1) p` chunk forwards. `v=1` is plain 1F1B.

    Example:
        >>> s = interleaved_1f1b(2, 2, 2)
        >>> s.placement
        (0, 1, 0, 1)
        >>> print(*s.actions[1])
        F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 B0@s1 B1@s1
    """
    check_counts("interleaved-1f1b", p=p, m=m, v=v)
    if v == 1:
        return Schedule("interleaved-1f1b", p, m, 1, tuple(range(p)), one_f_one_b(p, m).actions)
    check_rounds("interleaved-1f1b", p, m)
    rows = []
    for r in range(p):
        fwd, bwd = _depth_first_order(p, m, v, r)
        rows.append(_one_f_one_b_row(fwd, bwd, 2 * (p - 1 - r) + (v - 1) * p))
    return Schedule("interleaved-1f1b", p, m, v, _round_robin(p, v), tuple(rows))


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into I (input grad)
    and W (weight grad), and rank `r` running its W `r` places late so that the I's reach
    the first rank sooner and the late W's fill the cool-down. Same warm-up, hence the same
    peak activations as 1F1B (`p - r` on rank `r`); with `t_F = t_I = t_W` the bubble is a
    third of 1F1B's.

    With `v > 1` this is the interleaved zero-bubble variant that torch's
    `ScheduleInterleavedZeroBubble` ("ZB1P" over several chunks) runs: the Megatron order over
    `v` round-robin chunks with `(v - 1) p + (p - 1 - r)` warm-up forwards, split and delayed
    the same way; it needs `m % p == 0`.

    Example:
        >>> print(zb_h1(2, 2))
        zb-h1: p=2, m=2, v=1
        rank 0: F0@s0 F1@s0 I0@s0 W0@s0 I1@s0 W1@s0
        rank 1: F0@s1 I0@s1 F1@s1 I1@s1 W0@s1 W1@s1
    """
    check_counts("zb-h1", p=p, m=m, v=v)
    if v > 1:
        check_rounds("zb-h1", p, m)
    rows = []
    for r in range(p):
        if v == 1:
            fwd = bwd = [(r, i) for i in range(m)]
        else:
            fwd, bwd = _depth_first_order(p, m, v, r)
        rows.append(_split_backward(_one_f_one_b_row(fwd, bwd, (v - 1) * p + p - 1 - r), delay=r))
    return Schedule("zb-h1", p, m, v, _round_robin(p, v), tuple(rows))


def zbv(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2023, arXiv 2401.10241): two chunks per rank in a V, stage `s` on rank `s` for
    `s < p` and on rank `2p - 1 - s` after, so rank 0 holds the first and the last stage.
    Backwards are split into I and W. Every rank holds at most `2p` chunk activations, that is
    `p` stages' worth: 1F1B's peak on rank 0, on every rank. See `_zbv_row` for the order.

    Example:
        >>> s = zbv(2, 3)
        >>> s.placement
        (0, 1, 1, 0)
        >>> print(*s.actions[1])
        F0@s1 F0@s2 F1@s1 F1@s2 I0@s2 W0@s2 F2@s1 I0@s1 W0@s1 F2@s2 I1@s2 W1@s2 I1@s1 I2@s2 I2@s1 W1@s1 W2@s2 W2@s1
    """
    check_counts("zbv", p=p, m=m)
    placement = tuple(min(s, 2 * p - 1 - s) for s in range(2 * p))
    rows = [_zbv_row(p, m, r) for r in range(p)]
    return Schedule("zbv", p, m, 2, placement, tuple(rows))


# -- by name ------------------------------------------------------------------------------------

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")

# lower-cased alias -> (name, default v). torch's ScheduleInterleavedZeroBubble runs ZB-H1 ("ZB1P")
# over several round-robin chunks per rank, so it maps to zb-h1 with v=2 unless v is given.
_ALIASES = {
    **{name: (name, None) for name in SCHEDULE_NAMES},
    "schedulegpipe": ("gpipe", None),
    "schedule1f1b": ("1f1b", None),
    "scheduleinterleaved1f1b": ("interleaved-1f1b", None),
    "scheduleinterleavedzerobubble": ("zb-h1", 2),
    "schedulezbvzerobubble": ("zbv", None),
}
_TORCH_NAMES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
)
_FIXED_V = {"gpipe": 1, "1f1b": 1, "zbv": 2}  # schedules whose chunk count is not a choice
_DEFAULT_V = {"interleaved-1f1b": 2, "zb-h1": 1}
_SPLIT_BACKWARD = frozenset({"zb-h1", "zbv"})  # the zero-bubble schedules: backward as I then W


def splits_backward(name: str) -> bool:
    """True when the schedule called `name` (any accepted spelling) splits backward into I and W actions,
    as every schedule it builds then says (`Schedule.split_backward`)."""
    return resolve_schedule(name, None)[0] in _SPLIT_BACKWARD


def even_layers(layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage, in stage order, spread evenly (Megatron's split): where they do not divide,
    the first and the last stages (which also hold the embedding and the head) give up one layer each in
    turn, as Llama 3 405B's 126 layers fill 128 virtual stages (Dubey et al. 2024, sec. 3.3.2)."""
    per = -(-layers // stages)
    counts = [per] * stages
    deficit, k = per * stages - layers, 0
    while deficit:
        index = k // 2 if k % 2 == 0 else stages - 1 - k // 2
        if counts[index]:
            counts[index] -= 1
            deficit -= 1
        k += 1
    return counts


def resolve_schedule(name: str, v: int | None) -> tuple[str, int]:
    """The canonical name and chunk count for `name` (any accepted spelling) and `v`."""
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key not in _ALIASES:
        accepted = ", ".join(SCHEDULE_NAMES + _TORCH_NAMES)
        raise ValueError(f"unknown pipeline schedule {name!r}; accepted (any case): {accepted}")
    canonical, alias_v = _ALIASES[key]
    if canonical in _FIXED_V:
        if v not in (None, _FIXED_V[canonical]):
            raise ValueError(f"{canonical} runs {_FIXED_V[canonical]} chunk(s) per rank; got v={v!r}. Leave v unset")
        return canonical, _FIXED_V[canonical]
    if v is None:
        v = alias_v if alias_v is not None else _DEFAULT_V[canonical]
    return canonical, v


def schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Build the schedule called `name` (see `SCHEDULE_NAMES`; torch.distributed.pipelining's class
    names work too, in any case) for `p` ranks, `m` microbatches and `v` chunks per rank.
    `v` defaults to 2 for interleaved-1f1b and ScheduleInterleavedZeroBubble, and to 1 for zb-h1.

    Example:
        >>> schedule("ScheduleZBVZeroBubble", 4, 8).name
        'zbv'
        >>> schedule("ScheduleInterleavedZeroBubble", 4, 8).v
        2
    """
    canonical, v = resolve_schedule(name, v)
    if canonical == "interleaved-1f1b":
        return interleaved_1f1b(p, m, v)
    if canonical == "zb-h1":
        return zb_h1(p, m, v)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zbv": zbv}[canonical](p, m)


# -- the orders behind them -------------------------------------------------------------------


def _one_f_one_b_row(fwd: Sequence[tuple[int, int]], bwd: Sequence[tuple[int, int]], warmup: int) -> tuple:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = max(0, min(warmup, len(fwd)))
    row = [Action("F", *f) for f in fwd[:warmup]]
    for f, b in zip(fwd[warmup:], bwd, strict=False):  # bwd is longer by `warmup`
        row += [Action("F", *f), Action("B", *b)]
    row += [Action("B", *b) for b in bwd[len(fwd) - warmup :]]
    return tuple(row)


def _split_backward(row: Iterable[Action], *, delay: int) -> tuple:
    """Replace each B with I, and run the W of the k-th I right after the (k + delay)-th I."""
    out, pending = [], []
    for a in row:
        if a.kind != "B":
            out.append(a)
            continue
        out.append(Action("I", a.stage, a.microbatch))
        pending.append(Action("W", a.stage, a.microbatch))
        if len(pending) > delay:
            out.append(pending.pop(0))
    return tuple(out + pending)


def _depth_first_order(p: int, m: int, v: int, r: int) -> tuple[list, list]:
    """Rank `r`'s (stage, microbatch) order for forwards and backwards in Megatron's interleaving:
    `p` microbatches through chunk 0, the same `p` through chunk 1, ..., then the next `p`."""
    fwd, bwd = [], []
    for k in range(m * v):
        group, within = divmod(k, p * v)
        chunk, mb = within // p, group * p + within % p
        fwd.append((chunk * p + r, mb))
        bwd.append(((v - 1 - chunk) * p + r, mb))
    return fwd, bwd


def _round_robin(p: int, v: int) -> tuple[int, ...]:
    return tuple(s % p for s in range(p * v))


def check_counts(name: str, **counts: int) -> None:
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {key} must be an int >= 1, got {value!r}")


def check_rounds(name: str, p: int, m: int) -> None:
    if m % p:
        lo, hi = m - m % p, m + p - m % p
        raise ValueError(
            f"{name}: m={m} microbatches is not a multiple of p={p} ranks; interleaving sends microbatches "
            f"through each rank's chunks in groups of p (as Megatron does). Use m={hi}" + (f" or m={lo}" if lo else "")
        )


def _zbv_row(p: int, m: int, r: int) -> tuple:
    """Rank r's ZB-V order, the schedule drawn in Qi et al. 2023.

    `a` is the rank's down stage `r`, `b` its up stage `2p - 1 - r`. Phases, each a pattern run
    some number of times (a pattern entry is skipped once that kind has covered every microbatch):

    - warm-up: `Fa` x (2(p - r) - 1), then `Fb Fa` x r, then `Fb Ib Wb` x (p - r);
    - steady: `Fa Ia Wa Fb Ib Wb` until every `Fb` is out;
    - cool-down: `Ia Ib` x r, `Ia Wa` x (p - r), then the `Wb` and the `Wa` still owed.

    The V needs `2p - 1` microbatches in flight to fill, so the order is built for
    `n = max(m, 2p - 1)` and the microbatches past `m` are dropped. Dropping whole microbatches
    keeps it runnable: no action waits on another microbatch's action.
    """
    n = max(m, 2 * p - 1)
    stage = {"a": r, "b": 2 * p - 1 - r}
    issued: dict[tuple[str, int], int] = {}
    row: list[Action] = []

    def run(pattern: str, times: int) -> None:
        for _ in range(times):
            for kind, chunk in pattern.split():
                key = (kind, stage[chunk])
                if issued.get(key, 0) < n:
                    row.append(Action(kind, key[1], issued.get(key, 0)))
                    issued[key] = issued.get(key, 0) + 1

    run("Fa", 2 * (p - r) - 1)
    run("Fb Fa", r)
    run("Fb Ib Wb", p - r)
    run("Fa Ia Wa Fb Ib Wb", n - p)
    run("Ia Ib", r)
    run("Ia Wa", p - r)
    run("Wb", n)
    run("Wa", n)
    return tuple(a for a in row if a.microbatch < m)
