"""Pipeline schedules: the simulator against the published closed forms, validation, memory, names.

Method: every generator's per-rank lists are run by `meshlib.simulate`, an event-driven clock in
which a rank runs its list in order and an action waits for its dependencies (see
meshlib/simulation.py). Times are per action (per stage-chunk and microbatch) with no
communication, so makespans are exact small integers and each closed form is checked exactly:
the makespan as an integer identity, the bubble to 1e-12. Completeness is checked here
independently of `validate_schedule`, by counting actions.
"""

import os
from collections import Counter

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports matplotlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshlib
from meshlib import (
    Action,
    Schedule,
    bubble_formula,
    gantt,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
    simulate,
    validate_schedule,
    zb_h1,
    zbv,
)
from meshlib.schedules import splits_backward

GRID = [(p, m) for p in range(1, 9) for m in range(p, 17)]


def _equal_times(s: Schedule):
    """t_F = t_I = t_W = 1 (a full B is 2), the zero-bubble papers' setting."""
    return simulate(s, t_f=1, t_b=2, t_w=1)


def _assert_complete(s: Schedule) -> None:
    """Every (stage, microbatch) has one F and one B, or one F, one I and one W, on its rank."""
    seen = Counter((a.kind, a.stage, a.microbatch) for row in s.actions for a in row)
    assert all(n == 1 for n in seen.values())
    for stage in range(s.p * s.v):
        for mb in range(s.m):
            kinds = {k for k in "FBIW" if (k, stage, mb) in seen}
            assert kinds in ({"F", "B"}, {"F", "I", "W"}), (s.name, stage, mb, kinds)
    for rank, row in enumerate(s.actions):
        assert all(s.placement[a.stage] == rank for a in row)


# -- bubbles against the closed forms ----------------------------------------------------------


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(build):
    for p, m in GRID:
        sim = simulate(build(p, m), t_f=1, t_b=2)
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert bubble_formula(build(p, m).name, p, m) == pytest.approx(sim.bubble, abs=1e-12)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_interleaved_bubble_is_megatrons(p, v):
    """t_b = 2 t_f per chunk: the makespan is (v m + p - 1)(t_f + t_b), so the bubble is
    (p - 1) / (v m + p - 1), about 1/v of 1F1B's."""
    for m in (p, 2 * p, 3 * p, 4 * p):
        sim = simulate(interleaved_1f1b(p, m, v), t_f=1, t_b=2)
        assert sim.makespan == 3 * (v * m + p - 1)
        assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert bubble_formula("interleaved-1f1b", p, m, v) == pytest.approx(sim.bubble, abs=1e-12)


def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_memory():
    for p, m in GRID:
        sim, base = _equal_times(zb_h1(p, m)), _equal_times(one_f_one_b(p, m))
        assert sim.makespan == 3 * m + p - 1
        assert sim.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert bubble_formula("zb-h1", p, m) == pytest.approx(sim.bubble, abs=1e-12)
        if p > 1:
            assert sim.bubble < base.bubble
        assert sim.peak_inflight == base.peak_inflight == tuple(p - r for r in range(p))


@pytest.mark.parametrize("t_f,t_i,t_w", [(1, 1.5, 0.5), (2, 1, 1), (1, 2, 1), (1, 1, 0.5)])
def test_zb_h1_matches_the_papers_general_form(t_f, t_i, t_w):
    """Qi et al.: idle (p - 1)(t_F + t_I - t_W) per rank, here whenever t_W <= min(t_F, t_I)."""
    for p, m in [(2, 4), (4, 4), (4, 8), (8, 16)]:
        sim = simulate(zb_h1(p, m), t_f=t_f, t_b=t_i + t_w, t_w=t_w)
        idle = (p - 1) * (t_f + t_i - t_w)
        assert sim.bubble == pytest.approx(idle / (m * (t_f + t_i + t_w) + idle), abs=1e-12)


def test_interleaved_zero_bubble_variant():
    """zb_h1 over v round-robin chunks (torch's ScheduleInterleavedZeroBubble): (p-1)/(3vm+p-1)."""
    for p, v in [(2, 2), (4, 2), (4, 3), (8, 2)]:
        for m in (p, 2 * p):
            sim = _equal_times(zb_h1(p, m, v))
            assert sim.makespan == 3 * v * m + p - 1
            assert bubble_formula("ScheduleInterleavedZeroBubble", p, m, v) == pytest.approx(sim.bubble, abs=1e-12)
            assert sim.peak_inflight[0] == v * p  # p stages' worth: 1F1B's rank-0 peak


def test_zbv_beats_zb_h1_at_1f1b_memory():
    """Equal per-chunk times. ZB-V idles only the p - 1 start-up steps per rank, half of ZB-H1's
    on the same model; every rank holds 2p chunk activations = p stages' worth, which is what Qi
    et al. state (1F1B's peak, p M_B)."""
    for p in range(1, 9):
        for m in range(2 * p - 1, 2 * p + 9):
            sim = _equal_times(zbv(p, m))
            assert sim.makespan == 6 * m + p - 1
            assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
            assert bubble_formula("zbv", p, m) == pytest.approx(sim.bubble, abs=1e-12)
            if p > 1:
                assert sim.bubble < _equal_times(zb_h1(p, m)).bubble
            assert sim.peak_inflight == (2 * p,) * p
            assert sim.peak_inflight[0] / 2 == simulate(one_f_one_b(p, m)).peak_inflight[0]


def test_closed_forms_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError, match=r"assumes m >= 4 .*meshlib.simulate"):
        bubble_formula("zb-h1", 4, 3)
    with pytest.raises(ValueError, match="assumes m >= 7"):
        bubble_formula("zbv", 4, 6)
    with pytest.raises(ValueError, match="not a multiple of p=4"):
        bubble_formula("interleaved-1f1b", 4, 6, 2)


def test_peak_inflight_1f1b_and_gpipe():
    for p, m in GRID + [(8, 3), (5, 1)]:
        assert simulate(one_f_one_b(p, m)).peak_inflight == tuple(min(p - r, m) for r in range(p))
        assert simulate(gpipe(p, m)).peak_inflight == (m,) * p


def test_the_five_schedules_at_p4_m8():
    """The numbers quoted in the docs: p=4, m=8, t_F = t_I = t_W = 1 (full B = 2), v=2 interleaved."""
    got = {name: round(_equal_times(schedule(name, 4, 8)).bubble, 4) for name in meshlib.SCHEDULE_NAMES}
    assert got == {"gpipe": 0.2727, "1f1b": 0.2727, "interleaved-1f1b": 0.1579, "zb-h1": 0.1111, "zbv": 0.0588}


def test_communication_time_delays_cross_rank_hops():
    base, slow = simulate(one_f_one_b(4, 8)), simulate(one_f_one_b(4, 8), t_comm=0.5)
    assert slow.makespan > base.makespan and slow.bubble > base.bubble
    assert simulate(one_f_one_b(1, 4), t_comm=5).makespan == simulate(one_f_one_b(1, 4)).makespan
    # ZB-V's turn at the bottom of the V stays on one rank: no hop there
    assert simulate(zbv(1, 3), t_comm=5).makespan == simulate(zbv(1, 3)).makespan


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.sampled_from(["gpipe", "1f1b"]), st.sampled_from([0.25, 0.5, 3.0]))
def test_host_time_per_action_adds_to_each_rank_and_counts_as_idle(p, m, name, h):
    """Closed form: with t_comm = 0 a host time h after every action delays the last rank's 2m
    actions by h each but the last, (m + p - 1)(t_F + t_B) + (2m - 1) h; it is idle in the bubble."""
    sim = simulate(schedule(name, p, m), t_f=1.0, t_b=2.0, t_host=h)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0 + (2 * m - 1) * h)
    assert sim.bubble == pytest.approx(1 - 3.0 * m / sim.makespan)
    assert sim.t_host == h
    with pytest.raises(ValueError, match="t_host must be a number >= 0"):
        simulate(schedule(name, p, m), t_host=-1.0)


# -- validation --------------------------------------------------------------------------------

shapes = st.integers(1, 6).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, 12), st.integers(1, 3)))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_every_generated_schedule_is_complete_and_valid(shape):
    p, m, v = shape
    rounded = p * max(1, m // p)  # interleaving needs m % p == 0
    built = [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), zbv(p, m)]
    built += [interleaved_1f1b(p, rounded, v), zb_h1(p, rounded, v)]
    for s in built:
        _assert_complete(s)
        validate_schedule(s)
        sim = simulate(s)
        assert sum(len(row) for row in sim.timelines) == sum(len(row) for row in s.actions)


def _edit(s: Schedule, rank: int, row) -> Schedule:
    rows = list(s.actions)
    rows[rank] = tuple(row)
    return Schedule(s.name, s.p, s.m, s.v, s.placement, tuple(rows))


def test_validate_rejects_a_swap_that_deadlocks():
    s = one_f_one_b(2, 2)  # rank 1: F0 B0 F1 B1
    row = list(s.actions[1])
    row[0], row[1] = row[1], row[0]
    with pytest.raises(ValueError, match=r"(?s)deadlocks.*B0@s1 \(next on rank 1\) needs F0@s1, queued behind it"):
        validate_schedule(_edit(s, 1, row))
    s = gpipe(2, 2)  # rank 0 runs B0 before F1: B0@s0 waits on rank 1, which waits for F1@s0
    with pytest.raises(ValueError, match=r"B0@s0 \(next on rank 0\) needs B0@s1, queued behind F1@s1 on rank 1"):
        validate_schedule(_edit(s, 0, [s.actions[0][i] for i in (0, 2, 1, 3)]))


def test_validate_rejects_w_before_i():
    s = zb_h1(3, 3)
    row = list(s.actions[2])
    i = row.index(Action("I", 2, 0))
    w = row.index(Action("W", 2, 0))
    row[i], row[w] = row[w], row[i]
    with pytest.raises(ValueError, match=r"W0@s2 \(next on rank 2\) needs I0@s2"):
        validate_schedule(_edit(s, 2, row))


def test_validate_rejects_missing_duplicate_and_misplaced_actions():
    s = zb_h1(3, 4)
    with pytest.raises(ValueError, match="missing W2@s1"):
        validate_schedule(_edit(s, 1, [a for a in s.actions[1] if a != Action("W", 1, 2)]))
    with pytest.raises(ValueError, match="F1@s0 appears 2 times"):
        validate_schedule(_edit(s, 0, s.actions[0] + (Action("F", 0, 1),)))
    moved = Action("I", 2, 3)
    s2 = _edit(_edit(s, 2, [a for a in s.actions[2] if a != moved]), 0, s.actions[0] + (moved,))
    with pytest.raises(ValueError, match="I3@s2 is on rank 0, but stage 2 lives on rank 2"):
        validate_schedule(s2)
    with pytest.raises(ValueError, match="out of range"):
        validate_schedule(_edit(s, 0, s.actions[0] + (Action("F", 0, 9),)))
    mixed = _edit(s, 1, [Action("B", 1, 0) if a == Action("I", 1, 0) else a for a in s.actions[1]])
    with pytest.raises(ValueError, match="has B0@s1 and a split I/W"):
        validate_schedule(mixed)


def test_values_are_checked_at_construction():
    assert str(Action("W", stage=2, microbatch=5)) == "W5@s2"
    assert repr(Action("F", 1, 3)) == "Action('F', stage=1, microbatch=3)"
    with pytest.raises(ValueError, match="kind 'X'"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="microbatch must be an int >= 0, got -1"):
        Action("F", 0, -1)
    with pytest.raises(ValueError, match="placement has 3 stages; p \\* v = 2 \\* 1 = 2"):
        Schedule("x", 2, 1, 1, (0, 1, 1), ((), ()))
    with pytest.raises(TypeError, match="not an Action"):
        Schedule("x", 1, 1, 1, (0,), (("F", 0, 0),))
    as_dict = Schedule("x", 2, 1, 1, (0, 1), {0: [Action("F", 0, 0)]})
    assert as_dict.actions == ((Action("F", 0, 0),), ())
    with pytest.raises(ValueError, match=r"actions name ranks \[5\] outside 0..1"):
        Schedule("x", 2, 1, 1, (0, 1), {5: [Action("F", 0, 0)]})
    assert hash(one_f_one_b(2, 2)) == hash(one_f_one_b(2, 2))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gpipe(0, 4), "p must be an int >= 1, got 0"),
        (lambda: one_f_one_b(4, 0), "m must be an int >= 1, got 0"),
        (lambda: interleaved_1f1b(4, 8, 0), "v must be an int >= 1, got 0"),
        (lambda: interleaved_1f1b(4, 6, 2), r"m=6 microbatches is not a multiple of p=4 .* Use m=8 or m=4"),
        (lambda: zb_h1(4, 6, 2), "not a multiple of p=4"),
        (lambda: zbv(2.0, 4), "p must be an int >= 1, got 2.0"),
        (lambda: simulate(gpipe(2, 2), t_f=-1), "t_f must be a number >= 0, got -1"),
        (lambda: simulate(zb_h1(2, 2), t_b=2, t_w=3), r"t_w=3 must lie in \[0, t_b=2\]"),
    ],
)
def test_bad_sizes_and_times_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias,name,v",
    [
        ("gpipe", "gpipe", 1),
        ("GPipe", "gpipe", 1),
        ("ScheduleGPipe", "gpipe", 1),
        ("1F1B", "1f1b", 1),
        ("schedule1f1b", "1f1b", 1),
        ("Interleaved-1F1B", "interleaved-1f1b", 2),
        ("interleaved_1f1b", "interleaved-1f1b", 2),
        ("SCHEDULEINTERLEAVED1F1B", "interleaved-1f1b", 2),
        ("ZB-H1", "zb-h1", 1),
        ("zb_h1", "zb-h1", 1),
        ("ScheduleInterleavedZeroBubble", "zb-h1", 2),
        ("ZBV", "zbv", 2),
        ("ScheduleZBVZeroBubble", "zbv", 2),
    ],
)
def test_names_are_case_insensitive_and_take_torch_class_names(alias, name, v):
    s = schedule(alias, 4, 8)
    assert (s.name, s.v) == (name, v)
    assert s == schedule(name, 4, 8, v)
    # what the name says about the backward is what the schedule it builds runs
    assert splits_backward(alias) == s.split_backward == any(a.kind == "W" for row in s.actions for a in row)


def test_unknown_names_and_wrong_chunk_counts_raise():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'dualpipe'.*gpipe, 1f1b, .*ScheduleZBVZeroBubble"):
        schedule("dualpipe", 4, 8)
    with pytest.raises(ValueError, match="zbv runs 2 chunk"):
        schedule("zbv", 4, 8, v=3)
    with pytest.raises(ValueError, match="1f1b runs 1 chunk"):
        bubble_formula("1f1b", 4, 8, v=2)
    with pytest.raises(TypeError, match="must be a str"):
        schedule(None, 4, 8)
    assert schedule("interleaved-1f1b", 4, 8, 3).v == 3
    assert interleaved_1f1b(4, 6, 1).actions == one_f_one_b(4, 6).actions


# -- the picture -------------------------------------------------------------------------------


def test_gantt_draws_on_agg_and_returns_the_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for s in (zbv(3, 6), interleaved_1f1b(2, 4, 2)):
        ax = gantt(simulate(s))
        assert ax.get_title().startswith(s.name)
        assert len(ax.patches) == sum(len(row) for row in s.actions)
        ax.figure.canvas.draw()
        plt.close(ax.figure)
    _, ax = plt.subplots()
    assert gantt(simulate(gpipe(2, 2)), ax=ax) is ax
    plt.close(ax.figure)


def test_gantt_without_matplotlib_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install 'meshlib\[plot\]'"):
        gantt(simulate(gpipe(2, 2)))
