"""The stage split, without processes: the exact min-max partition against brute force, the cost per
layer against closed-form FLOPs and bytes, and the plan's stages from `compile_model` on a pipeline mesh.

Method: `min_max_partition` is checked against an enumeration of every way to cut a short list
(hypothesis draws the lists), with and without fixed costs on the first and last part, and
the most even of the optimal splits (least sum of squares) is the one returned. The
per-layer costs come from `FlopCounterMode` on the meta device, so a stack of plain Linear
layers, whose forward FLOPs are 2·b·in·out each, checks them exactly; what runs before the first
layer and after the last is charged to the first and last stage.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from meshlib import Mesh, min_max_partition
from meshlib_torch import compile_model
from meshlib_torch.compiler.capture.blocks import layer_paths
from meshlib_torch.compiler.capture.call import bind_call
from meshlib_torch.compiler.pipeline.costs import LayerCosts, layer_costs, stage_ranges
from meshlib_torch.models import build, config, default_rules


def _brute_force(costs, parts, first=0.0, last=0.0, *, even=False):
    """The smallest largest part over every way to cut `costs` into `parts` runs (with `even`:
    and the least sum of squares among the splits that reach it)."""
    n = len(costs)
    best = (float("inf"), float("inf"))
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = [0, *cuts, n]
        sums = [sum(costs[a:b]) for a, b in itertools.pairwise(edges)]
        sums[0] += first
        sums[-1] += last
        best = min(best, (max(sums), sum(x * x for x in sums)))
    return best if even else best[0]


def _largest(costs, ranges, first=0.0, last=0.0):
    return max(LayerCosts(list(costs), first, last).of(ranges))


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=1, max_size=9),
    parts=st.integers(1, 9),
    first=st.integers(0, 60),
    last=st.integers(0, 60),
)
def test_min_max_partition_is_optimal(costs, parts, first, last):
    if parts > len(costs):
        with pytest.raises(ValueError, match="cannot split"):
            min_max_partition(costs, parts)
        return
    ranges = min_max_partition(costs, parts, first=first, last=last)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in itertools.pairwise(ranges))
    sums = LayerCosts(list(costs), first, last).of(ranges)
    assert (max(sums), sum(x * x for x in sums)) == _brute_force(costs, parts, first, last, even=True)


def test_fixed_costs_move_layers_off_the_end_stages():
    costs = [10.0] * 8
    assert min_max_partition(costs, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 10 equal layers on 4 stages: 3, 3, 2, 2 (some order), never 3, 3, 3, 1
    assert sorted(b - a for a, b in min_max_partition([1.0] * 10, 4)) == [2, 2, 3, 3]
    # a head as heavy as two layers: the last stage keeps one layer, the others take the rest
    ranges = min_max_partition(costs, 4, last=20.0)
    assert _largest(costs, ranges, last=20.0) == 30.0 and ranges[-1] == (7, 8)


class _Uneven(nn.Module):
    """Linear layers of different widths between an input and an output projection."""

    def __init__(self, widths=(8, 32, 16, 64, 8, 8)):
        super().__init__()
        self.inp = nn.Linear(4, widths[0], bias=False)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(widths))
        self.out = nn.Linear(widths[-1], 2, bias=False)
        self.widths = widths

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).sum()


def test_layer_costs_are_forward_flops_with_the_ends_apart():
    model, b = _Uneven().to("meta"), 5
    x = torch.empty(b, 4, device="meta")
    w = model.widths
    costs = layer_costs(model, layer_paths(model), bind_call(model, (x,)))
    assert costs.layers == [2.0 * b * i * o for i, o in itertools.pairwise(w)]
    assert costs.first == 2.0 * b * 4 * w[0] and costs.last == 2.0 * b * w[-1] * 2
    by_bytes = layer_costs(model, layer_paths(model), bind_call(model, (x,)), by="params")
    assert by_bytes.layers == [4.0 * i * o for i, o in itertools.pairwise(w)]
    assert by_bytes.first == 4.0 * 4 * w[0] and by_bytes.last == 4.0 * w[-1] * 2
    ranges = stage_ranges(costs, 3)
    assert max(costs.of(ranges)) == _brute_force(costs.layers, 3, costs.first, costs.last)


def test_split_points_override_the_cost_and_are_checked():
    costs = LayerCosts([1.0] * 6)
    assert stage_ranges(costs, 3, split_points=[1, 5]) == [(0, 1), (1, 5), (5, 6)]
    with pytest.raises(ValueError, match=r"split points \[1, 6\] must be 2 distinct layer indices in 1..5"):
        stage_ranges(costs, 3, split_points=[1, 6])
    with pytest.raises(ValueError, match="7 pipeline stages but the model has 6 layers; each stage needs at "
                                         "least one. Fix: use at most 6 stages, or 8 with balance='layers'"):
        stage_ranges(costs, 7)


def test_even_stages_may_leave_the_first_and_the_last_without_a_layer():
    """balance="layers": 6 layers fill 8 stages, the first and the last (the embedding's and the head's) with
    none; 9 stages would leave a middle one empty and are refused."""
    costs = LayerCosts([1.0] * 6)
    assert stage_ranges(costs, 8, even=True) == [(0, 0), *((i, i + 1) for i in range(6)), (6, 6)]
    assert stage_ranges(costs, 7, even=True) == [(0, 0), *((i, i + 1) for i in range(6))]
    with pytest.raises(ValueError, match="9 pipeline stages but the model has 6 layers; at most the first and the "
                                         "last stage can be without one. Fix: use at most 8 stages"):
        stage_ranges(costs, 9, even=True)


def _pipeline(**kw):
    cfg = config("llama-tiny") if "cfg" not in kw else kw.pop("cfg")
    mesh = Mesh.parse(kw.pop("mesh", "pp=2"))
    x = torch.empty(8, 16, dtype=torch.long, device="meta")
    compiled = compile_model(build(cfg), mesh=mesh, rules=default_rules(cfg, mesh), example_inputs=(x, x), **kw)
    return compiled, compiled.stages, compiled.schedule


def test_plan_stages_carry_the_min_max_split_and_its_costs():
    cfg = config("llama-tiny", n_layers=6)
    compiled, stages, core = _pipeline(cfg=cfg, microbatches=4, schedule="1f1b", mesh="pp=3")
    model = build(cfg)
    micro = torch.empty(2, 16, dtype=torch.long, device="meta")
    costs = layer_costs(model, layer_paths(model), bind_call(model, (micro, micro)))
    plan = compiled.plan
    assert [s.cost for s in plan.stages] == costs.of(stages.layers)
    assert max(s.cost for s in plan.stages) == _brute_force(costs.layers, 3, costs.first, costs.last)
    assert [s.rank for s in plan.stages] == [0, 1, 2] and core.name == "1f1b"
    assert [m for s in plan.stages for m in s.modules] == [f"layers.{i}" for i in range(6)]
    assert plan.note_map["stage split"] == "by layer FQN on the fx graph, balanced by flops"


def test_user_split_points_are_recorded_in_the_plan():
    cfg = config("llama-tiny", n_layers=4)
    compiled, stages, _ = _pipeline(cfg=cfg, microbatches=2, split_points=[3])
    assert stages.layers == [(0, 3), (3, 4)]
    assert [s.modules for s in compiled.plan.stages] == [("layers.0", "layers.1", "layers.2"), ("layers.3",)]
    assert compiled.plan.note_map["stage split"].endswith("balanced by user split points")


def test_layers_balance_splits_as_the_planner_prices():
    """balance="layers": 10 layers over 2 x 2 virtual stages hold 2, 3, 3, 2 (`even_layers`: the first and the
    last, with the embedding and the head, give up a layer each), the stages the closed form's `layer_split`
    puts on each rank; the plan says so."""
    from meshlib import ModelShape
    from meshlib.schedules import even_layers
    from meshlib.transformer_work import layer_split

    cfg = config("llama-tiny", n_layers=10)
    compiled, stages, _ = _pipeline(cfg=cfg, microbatches=4, schedule="interleaved-1f1b", chunks=2, mesh="pp=2",
                                    balance="layers")  # fmt: skip
    counts = [b - a for a, b in stages.layers]
    assert counts == even_layers(10, 4) == [2, 3, 3, 2]
    shape = ModelShape(layers=10, hidden=32, heads=4, ffn=64, vocab=256)
    by_rank = [[d for d, _ in row] for row in layer_split(shape, 2, 2)]
    assert by_rank == [[counts[0], counts[2]], [counts[1], counts[3]]]
    assert compiled.plan.note_map["stage split"] == "by layer FQN on the fx graph, balanced by layers"


@pytest.mark.parametrize("mesh, options", [
    ("pp=4,tp=2", {"microbatches": 8, "sequence_parallel": True, "recompute": "block", "precision": "bf16"}),
    ("pp=4,dp=2", {"microbatches": 4, "schedule": "interleaved-1f1b", "zero": 2, "recompute": "selective"}),
    ("pp=4,cp=2,tp=2", {"microbatches": 4, "schedule": "zbv", "sequence_parallel": True}),
])  # fmt: skip
def test_alike_stages_are_dry_run_once_and_plan_what_each_run_apart_would(monkeypatch, mesh, options):
    """A deep model's middle stages run the same ops on the same shapes: the dry run runs each distinct one
    once (`stage_key`, node names left out). llama-tiny with 8 layers on pp=4: fewer runs than stages, and
    every stage's memory and compute as when each stage runs apart."""
    from meshlib_torch.compiler.estimates import dryrun

    cfg, m = config("llama-tiny", n_layers=8), Mesh.parse(mesh)
    example = tuple(torch.empty(8, 32, dtype=torch.long, device="meta") for _ in range(2))

    def plan():
        return compile_model(build(cfg, device="meta"), mesh=m, rules=default_rules(cfg, m), example_inputs=example,
                             estimate_memory=True, **options).plan  # fmt: skip

    keys, key = [], dryrun.stage_key
    monkeypatch.setattr(dryrun, "stage_key", lambda c, s, *a: keys.append(key(c, s, *a)) or keys[-1])
    once = plan()
    assert len(set(keys)) < len(keys), len(keys)
    monkeypatch.setattr(dryrun, "stage_key", lambda c, s, *a: s)
    apart = plan()
    assert once.stage_memory == apart.stage_memory
    assert once.compute == apart.compute and len(once.compute) == 4
