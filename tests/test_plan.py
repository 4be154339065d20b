"""Plan: exact JSON round-trip (hypothesis over random plans), readable diffs, tables."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlib import Boundary, Collective, Memory, Mesh, P, Plan, Precision, Stage
from meshlib.plan import COLLECTIVE_KINDS, PHASES

axes = st.sampled_from(["dp", "tp", "pp"])
texts = st.text(max_size=12)
specs = st.builds(lambda e, u: P(*e, unreduced=u), st.lists(st.sampled_from([None, "dp", ("tp", "pp")]), max_size=3, unique=True).filter(lambda e: sum(x is not None for x in e) <= 1), st.sets(st.just("cp")))
collectives = st.builds(
    Collective, st.sampled_from(COLLECTIVE_KINDS), st.tuples(axes), st.integers(0, 2**40), texts, texts, texts, texts,
    st.sampled_from(PHASES), st.integers(1, 8),
)
boundaries = st.builds(Boundary, texts, st.tuples(st.integers(1, 64), st.integers(1, 64)), st.just("bfloat16"), st.integers(0, 2**30))
stages = st.builds(Stage, st.integers(0, 7), st.integers(0, 3), st.tuples(texts, texts), st.floats(0, 1e12), st.tuples(boundaries))
plans = st.builds(
    Plan,
    st.just(Mesh(dp=2, tp=2, pp=2, cp=1)),
    st.dictionaries(texts, specs, max_size=5),
    st.lists(collectives, max_size=4),
    st.lists(stages, max_size=3),
    st.sampled_from(["", "1f1b", "zbv"]),
    st.integers(1, 16),
    st.integers(0, 3),
    st.builds(Precision, st.sampled_from(["float32", "bfloat16"])),
    st.sampled_from(["none", "block", "selective"]),
    st.sampled_from(["error", "chunk"]),
    st.one_of(st.none(), st.builds(Memory, st.integers(0, 2**50), st.integers(0, 2**50))),
    st.dictionaries(st.sampled_from(["trace", "model"]), texts),
)


@settings(max_examples=200, deadline=None)
@given(plans)
def test_json_round_trip_is_exact(plan):
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert hash(again.mesh) == hash(plan.mesh)
    assert plan.diff(again) == ""


def test_diff_reads_line_by_line():
    a = Plan(Mesh(dp=2, tp=2), specs={"w": P("tp", None), "b": P()}, collectives=[Collective("all_reduce", ("tp",), 1024)])
    b = a.replace(
        zero=3,
        specs={"w": P(None, "tp"), "c": P()},
        collectives=[Collective("all_reduce", ("tp",), 1024, count=2), Collective("all_gather", ("dp",), 64)],
    )
    assert a.diff(b).splitlines() == [
        "~ forward all_gather over dp: 0 x -> 1 x, 0 B -> 64 B per rank per step",
        "~ forward all_reduce over tp: 1 x -> 2 x, 1.00 KiB -> 2.00 KiB per rank per step",
        "- spec b: P()",
        "+ spec c: P()",
        "~ spec w: P('tp', None) -> P(None, 'tp')",
        "~ zero: 0 -> 3",
    ]


def test_tables_and_totals():
    plan = Plan(
        Mesh(dp=2, tp=2),
        specs={"layers.0.wq.weight": P("tp", None)},
        collectives=[Collective("all_reduce", ("tp",), 4096, node="add_1", op="aten.add", source="model.py:12", reason="Partial(tp) -> Replicate", count=3)],
        memory=Memory(params=10, peak=20),
        notes={"trace": "fx"},
    )
    assert plan.comm_bytes() == 3 * 4096 and plan.comm_bytes(kind="all_gather") == 0
    # ring bus bytes: 2(n-1)/n of an all-reduce's payload, (n-1)/n of a gather's; a send moves all of it
    assert Collective("all_reduce", ("tp",), 1000, count=4, group=2).bus_bytes == 4000
    assert Collective("send_recv", ("pp",), 1000, count=4, group=2).bus_bytes == 4000
    assert Collective("all_gather", ("dp",), 1000, count=4, group=4).bus_bytes == 3000
    text = str(plan)
    for piece in ("layers.0.wq.weight", "P('tp', None)", "model.py:12", "Partial(tp) -> Replicate", "total 12.00 KiB", "trace"):
        assert piece in text
    assert "<table>" in plan._repr_html_()
    # a note of several lines (both trace failures) continues under its own column, never past 100 wide
    failed = "failed\nfx: TraceError: control flow at m.py:3\nexport: " + "can not trace this " * 20
    text = str(Plan(Mesh(dp=2), notes={"trace": failed, "model": "llama"}))
    lines = text.splitlines()
    at = next(i for i, s in enumerate(lines) if s.startswith("trace"))
    column = lines[at].index("failed")
    assert lines[at + 1] == " " * column + "fx: TraceError: control flow at m.py:3"
    assert lines[at + 2].startswith(" " * column + "export: can not") and max(map(len, lines)) <= column + 100
    assert lines[at + 3].startswith(" " * column + "can not") or lines[at + 3].startswith(" " * column + "this")
    with pytest.raises(ValueError, match="collective kind 'gather'"):
        Collective("gather", ("dp",), 1)
    with pytest.raises(TypeError, match="not a P"):
        Plan(Mesh(dp=2), specs={"w": ("dp",)})
