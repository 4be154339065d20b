"""The compiler's plans, on the meta device with an abstract mesh (no processes).

Method: compile the bundled models and check the collectives the plan lists
against closed forms: Megatron's per-layer count and bytes (2 all-reduces of
b*s*h forward and 2 backward, or an all-gather plus a reduce-scatter each with
sequence parallelism), data-parallel gradient all-reduces (in DDP's buckets)
that move every parameter shard once, and no gather for a fused qkv projection.
"""

import math

import pytest
import torch

from meshlib import Mesh, P, pattern_rules
from meshlib_torch import compile_model
from meshlib_torch.compiler.placement.placements import Shard
from meshlib_torch.models import build, config, default_rules

B, T = 4, 16


def _compile(name, mesh, sp=False, batch=B, **overrides):
    model = build(name, **overrides)
    x = torch.zeros(batch, T, dtype=torch.long, device="meta")
    return compile_model(model, mesh=mesh, rules=default_rules(name, mesh), example_inputs=(x, x.clone()), sequence_parallel=sp)


def _count(plan, phase, kind, axis, nbytes=None):
    return sum(
        c.count for c in plan.collectives if (c.phase, c.kind, c.axes) == (phase, kind, (axis,)) and (nbytes is None or c.bytes == nbytes)
    )


def test_trace_paths_are_recorded():
    gpt = _compile("gpt-tiny", Mesh(tp=2)).plan.note_map
    assert gpt["trace"] == "export" and "control flow" in gpt["trace fallback reason"]
    assert _compile("llama-tiny", Mesh(tp=2)).plan.note_map["trace"] == "fx"


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_all_reduces(name, tp):
    """Forward: embedding + 2 per layer; backward: 2 per layer + the head's input; each b*s*h."""
    cfg = config(name)
    layers, h = getattr(cfg, "n_layers", None) or cfg.n_layer, getattr(cfg, "dim", None) or cfg.n_embd
    plan = _compile(name, Mesh(tp=tp)).plan
    bsh = B * T * h * 4
    assert _count(plan, "forward", "all_reduce", "tp", bsh) == 2 * layers + 1
    assert _count(plan, "backward", "all_reduce", "tp", bsh) == 2 * layers + 1
    assert _count(plan, "forward", "all_gather", "tp") == 0  # the fused qkv split needs no gather


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_an_axis_of_size_one_gets_no_collective(name):
    """The rules shard the weights over tp; on Mesh(dp=2, tp=1) that splits nothing, so the plan places no
    collective on tp (before, every weight was all-gathered over one rank, a copy each forward, kept from a
    zero-bubble schedule's input-gradient pass to its weight pass), and its dp collectives are Mesh(dp=2)'s."""
    plan = _compile(name, Mesh(dp=2, tp=1)).plan
    alone = _compile(name, Mesh(dp=2)).plan
    assert not [c for c in plan.collectives if "tp" in c.axes]
    assert sorted((c.phase, c.kind, c.bytes, c.count) for c in plan.collectives) == sorted(
        (c.phase, c.kind, c.bytes, c.count) for c in alone.collectives)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_sequence_parallel_swaps_each_all_reduce(name):
    cfg = config(name)
    layers, h = getattr(cfg, "n_layers", None) or cfg.n_layer, getattr(cfg, "dim", None) or cfg.n_embd
    plan = _compile(name, Mesh(tp=2), sp=True).plan
    bsh = B * T * h * 4
    assert _count(plan, "forward", "all_reduce", "tp", bsh) == 0
    assert _count(plan, "forward", "reduce_scatter", "tp", bsh) == 2 * layers + 1
    assert _count(plan, "forward", "all_gather", "tp", bsh) == 2 * layers + 1
    assert _count(plan, "backward", "reduce_scatter", "tp", bsh) == 2 * layers + 1
    assert plan.note_map["sequence parallel"] == "on"


def test_fused_qkv_holds_whole_heads():
    c = _compile("gpt-tiny", Mesh(tp=2))
    assert c.param_layouts["h.0.attn.c_attn.weight"] == (Shard(0, 3),)
    assert c.param_layouts["h.0.attn.c_attn.bias"] == (Shard(0, 3),)
    assert c.local_param_shape("h.0.attn.c_attn.weight") == (48, 32)
    assert "h.0.attn.c_attn.weight (3 parts)" in c.plan.note_map["fused projections"]


def test_data_parallel_sync_is_one_all_reduce_per_parameter_shard():
    c = _compile("llama-tiny", Mesh(dp=2, tp=2))
    dp = [col for col in c.plan.collectives if col.axes == ("dp",) and col.phase == "backward"]
    local_bytes = sum(math.prod(c.local_param_shape(n)) * 4 for n in c.traced.params)
    assert sum(col.bytes for col in dp) == local_bytes
    assert {col.kind for col in dp} == {"all_reduce"}


def test_memory_per_rank_is_the_shards_and_the_dry_run_peak():
    mesh = Mesh(dp=2, tp=2)
    model = build("llama-tiny")
    x = torch.zeros(B, T, dtype=torch.long)
    for zero in (0, 1, 3):
        c = compile_model(model, mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), zero=zero, estimate_memory=True)
        local = sum(math.prod(c.local_param_shape(n)) * 4 for n in c.traced.params)
        m = c.plan.memory
        want = {0: (local, local, 2 * local), 1: (local, local, local), 3: (local / 2, local / 2, local)}[zero]
        assert (m.params, m.grads, m.optimizer) == want
        assert 0 < m.activations < m.peak and m.peak > m.params + m.optimizer


def test_plan_round_trips_and_lists_provenance():
    plan = _compile("llama-tiny", Mesh(tp=2)).plan
    assert type(plan).from_json(plan.to_json()) == plan
    sources = {c.source for c in plan.collectives if c.kind == "all_reduce" and c.phase == "forward"}
    assert any(s.startswith("llama.py:") for s in sources)


def test_bad_input_errors_name_what_to_fix():
    model = build("llama-tiny")
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"no rule \(patterns 'tok_embeddings\.weight'\) matches 20 leaves: layers\.0\.attention\.wk\.weight"):
        compile_model(model, mesh=Mesh(tp=2), rules=pattern_rules({"tok_embeddings.weight": P("tp")}), example_inputs=(x, x))
    bad = pattern_rules({"**.wq.weight": P("tp", None)}, default=P())
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq\.weight: dim 0 of shape \(32, 32\) has size 32, which spec P\('tp', None\) splits 3 ways"):
        compile_model(model, mesh=Mesh(tp=3), rules=bad, example_inputs=(x, x))
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq\.weight: spec P\('tp', None\) names mesh axis 'tp', but Mesh\(dp=2\) has axes \('dp',\)"):
        compile_model(model, mesh=Mesh(dp=2), rules=bad, example_inputs=(x, x))
    odd = torch.zeros(3, T, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"input 'tokens': dim 0 of shape \(3, 16\) has size 3, which spec P\('dp'\) splits 2 ways"):
        compile_model(model, mesh=Mesh(dp=2), rules=default_rules("llama-tiny", Mesh(dp=2)), example_inputs=(odd, odd))


def test_less_common_ops_stay_sharded_on_heads():
    """chunk/permute/einsum/softmax/bmm/matmul/cat on heads need no gather: Megatron's all-reduces only."""
    plan = _compile("ops-tiny", Mesh(tp=4)).plan
    assert {(c.phase, c.kind) for c in plan.collectives} == {("forward", "all_reduce"), ("backward", "all_reduce")}
    assert _count(plan, "forward", "all_reduce", "tp", B * T * 32 * 4) == 2  # embedding, proj


def test_precision_is_given_as_text_or_a_precision():
    model = build("llama-tiny")
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    mesh = Mesh(dp=2)
    plan = compile_model(model, mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), precision="bf16").plan
    assert (plan.precision.param, plan.precision.reduce, plan.precision.output) == ("bfloat16", "float32", "float32")
    assert plan.memory.params == 2 * sum(p.numel() for p in model.parameters())  # bf16 copies, whole on each dp rank
    with pytest.raises(ValueError, match=r"precision 'bf17': use one of"):
        compile_model(model, mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), precision="bf17")
    with pytest.raises(TypeError, match=r"pass a meshlib.Precision, or text such as 'bf16'"):
        compile_model(model, mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), precision=torch.bfloat16)
