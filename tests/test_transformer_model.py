"""The closed-form transformer step (`meshlib.transformer`) against independent references.

Method: the parameter counts against the published sizes (GPT-3 175B: 174.6B with its 50,257-token
vocabulary and learned positions; Llama 3 405B; DeepSeek-V3: 671B with MLA approximated by giving every head
the decoupled RoPE key's 64 dims); the FLOPs against Korthikanti et al.'s 72·B·s·l·h²(1 + s/6h + V/12lh) and,
under full recompute, Narayanan et al.'s 96·B·s·l·h²(1 + s/6h + V/16lh); the activations kept per layer against
Korthikanti et al.'s formulas (`meshlib.cost.activation_bytes`); the tensor- and data-parallel bus bytes
against `meshlib.cost.tp_comm_bytes` and `dp_comm_bytes`; the published table (benchmarks/bench_published.py)
within the target error; and, with torch, the collectives of a compiled plan of the bundled Llama.
"""

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from meshlib.cost import activation_bytes, dp_comm_bytes, tp_comm_bytes
from meshlib.devices import A100
from meshlib.transformer import ModelShape, StepConfig, workload
from meshlib.transformer_comm import stage_comm, step_comm
from meshlib.transformer_work import chunk_activation, layer_split, stage_params

BUS = {"all_reduce": 2.0}


def gpt(layers=4, hidden=256, heads=8, vocab=1024, **kw):
    return ModelShape(layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=vocab, positions=2048,
                      bias=True, tied=True, dropout=True, **kw)  # fmt: skip


def bus(comm, n):
    return comm.count * comm.bytes * BUS.get(comm.kind, 1.0) * (n - 1) / n


# -- parameters -------------------------------------------------------------------------------------------
def test_gpt3_175b_parameters():
    shape = ModelShape(layers=96, hidden=12288, heads=96, ffn=49152, vocab=50257, positions=2048, bias=True,
                       tied=True)  # fmt: skip
    assert shape.params() / 1e9 == pytest.approx(174.6, abs=0.05)
    assert shape.params() == 12 * 96 * 12288**2 + 13 * 96 * 12288 + (50257 + 2048) * 12288 + 2 * 12288


def test_llama3_405b_parameters():
    shape = ModelShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, gated=True,
                       norm="rmsnorm")  # fmt: skip
    assert shape.params() / 1e9 == pytest.approx(405, rel=0.005)
    per_layer = 2 * 16384 * 16384 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384
    assert shape.params() == 126 * per_layer + 2 * 128256 * 16384 + 16384


def test_deepseek_v3_parameters():
    """671B in all, 37B active per token (DeepSeek-V3 report); MLA's decoupled RoPE key (64 dims shared by the
    heads, projected from the hidden state) is counted inside each head's key: head_dim 192 = 128 + 64."""
    shape = ModelShape(layers=61, hidden=7168, heads=128, head_dim=192, v_head_dim=128, q_rank=1536, kv_rank=512,
                       ffn=18432, vocab=129280, gated=True, experts=256, top_k=8, moe_ffn=2048, shared_experts=1,
                       dense_layers=3, norm="rmsnorm")  # fmt: skip
    assert shape.params() / 1e9 == pytest.approx(671, rel=0.002)
    assert shape.matmul_params() / 1e9 == pytest.approx(37, rel=0.03)


# -- FLOPs ------------------------------------------------------------------------------------------------
def _hardware_flops(w):
    """Every FLOP the step's ranks compute: per stage (forward, backward, recompute) x microbatches x ranks."""
    ranks = w.mesh.size // w.pp
    return sum((s.forward.total_flops + s.backward.total_flops + s.recompute.total_flops) * w.microbatches * ranks
               for s in w.stages)  # fmt: skip


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_flops_equal_korthikanti_and_narayanan(tp, pp):
    n, h, s, v, b = 4, 256, 512, 1024, 8  # layers, hidden, sequence, vocabulary, batch
    shape = gpt(layers=n, hidden=h, vocab=v)
    model = 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
    assert 3 * shape.forward_flops(b * s, s) == pytest.approx(model, rel=1e-12)
    c = StepConfig(dp=1, tp=tp, pp=pp, recompute="block", flash=False, schedule="1f1b")
    w = workload(shape, c, batch=b, seq=s)
    assert w.model_flops == pytest.approx(model, rel=1e-12)
    narayanan = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert _hardware_flops(w) == pytest.approx(narayanan, rel=1e-12)


def test_flash_attention_halves_the_causal_scores():
    shape = gpt(vocab=1024)
    full = workload(shape, StepConfig(dp=1, tp=1, pp=1, flash=False), batch=2, seq=512)
    flash = workload(shape, StepConfig(dp=1, tp=1, pp=1, flash=True), batch=2, seq=512)
    attention = 4 * 512 * 512 * 256 * shape.layers  # QK^T and PV, forward, one sequence per microbatch
    assert full.stages[0].forward.total_flops - flash.stages[0].forward.total_flops == pytest.approx(attention / 2)
    fwd, bwd = flash.stages[0].forward.attention, flash.stages[0].backward.attention
    assert [(q, d, back) for _, q, d, back, _ in fwd + bwd] == [(512, 32, False), (512, 32, True)]  # query rows, head dim
    assert bwd[0][0] == pytest.approx(2.5 * fwd[0][0])  # recomputed scores


# -- activations ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", ["none", "selective", "block"])
@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True)])
def test_activations_equal_korthikanti(recompute, tp, sp):
    """34sbh + 5as²b on one device; sbh(10 + 24/t + 5as/(ht)) with tp; sbh(34/t + 5as/(ht)) with sp;
    without the scores under selective recompute; 2sbh (2sbh/t with sp) under block recompute."""
    s, b, h, a = 2048, 2, 1024, 16
    shape = gpt(hidden=h, heads=a)
    c = StepConfig(dp=1, tp=tp, pp=1, sp=sp, recompute=recompute, flash=False, dtype="float16")
    expected = activation_bytes(s, b, h, a, t=tp, sp=sp, recompute=recompute)
    assert chunk_activation(shape, c, b, s, 1, 0) == pytest.approx(expected, rel=1e-12)


def test_pipeline_memory_counts_the_schedules_microbatches_in_flight():
    shape, b, s = gpt(layers=8), 1, 1024
    kept = []
    for sched, v in (("1f1b", 1), ("gpipe", 1)):
        c = StepConfig(dp=1, tp=1, pp=4, schedule=sched, chunks=v, recompute="block", flash=False)
        kept.append(workload(shape, c, batch=16, seq=s).stages[1].memory)
    layer = activation_bytes(s, b, 256, 8, recompute="block")
    assert kept[1] - kept[0] == pytest.approx((16 - 3) * 2 * layer)  # stage 1 of 1F1B holds 3, GPipe 16


# -- communication ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallel_bytes_equal_megatron(t):
    b, s, h, layers = 2, 1024, 512, 6
    shape = gpt(layers=layers, hidden=h)
    plain = stage_comm(shape, StepConfig(dp=1, tp=t, pp=1, flash=False), b, s, layers, 0, embed=False, head=False)
    assert sum(bus(c, t) for c in plain) == pytest.approx(tp_comm_bytes(b, s, h, layers, t, itemsize=2))
    assert {c.kind for c in plain} == {"all_reduce"}
    sp = stage_comm(shape, StepConfig(dp=1, tp=t, pp=1, sp=True, flash=False), b, s, layers, 0, embed=False, head=False)
    # the same bus bytes, plus backward's re-gather of each column-parallel product's input (Megatron keeps it split)
    assert sum(bus(c, t) for c in sp) == pytest.approx(1.25 * tp_comm_bytes(b, s, h, layers, t, itemsize=2))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_bytes_equal_zero(zero):
    n = 8
    c = StepConfig(dp=n, tp=1, pp=1, zero=zero, reduce_dtype="bfloat16")
    params = stage_params(gpt(), c, 4, 0, embed=True, head=True)
    comms = step_comm(params, c, 1, tied=False, embed_bytes=0.0)
    assert sum(bus(x, n) for x in comms) == pytest.approx(dp_comm_bytes(2 * params[0], n, zero=zero))


def test_context_and_expert_parallel_bytes():
    """Ring: (cp-1) K/V hops forward, K, V and their gradients back; EP: T·k·h each way, twice forward."""
    shape = ModelShape(layers=2, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=100, experts=8, top_k=2,
                       moe_ffn=128, gated=True)  # fmt: skip
    cp = stage_comm(shape, StepConfig(dp=1, tp=1, pp=1, cp=4), 1, 1024, 0, 2, embed=False, head=False)
    kv = 2 * 256 * 2 * (256 // 8 * 2)  # bytes of a rank's 256 tokens of K and V (2 kv heads of 32)
    hops = [c for c in cp if c.axes == ("cp",)]
    assert sum(c.bytes * c.count for c in hops if c.phase == "forward") == 3 * 2 * kv
    assert sum(c.bytes * c.count for c in hops if c.phase == "backward") == 2 * 3 * 2 * kv
    ep = stage_comm(shape, StepConfig(dp=1, tp=1, pp=1, ep=4), 1, 1024, 0, 2, embed=False, head=False)
    assert [(c.kind, c.bytes, c.count) for c in ep if c.phase == "forward"] == [("all_to_all", 2 * 1024 * 2 * 256, 4)]


# -- layout and validation --------------------------------------------------------------------------------
def test_llama3_layers_fill_virtual_stages():
    """126 layers over 16 x 8 virtual stages: the first and the last (embedding, head) hold none."""
    shape = ModelShape(layers=126, hidden=128, heads=8, ffn=256, vocab=100)
    split = layer_split(shape, 16, 8)
    assert split[0][0] == (0, 0) and split[15][7] == (0, 0)
    assert sum(d for row in split for d, _ in row) == 126
    assert {sum(d for d, _ in row) for row in split[1:15]} == {8}


def test_zbv_puts_each_ranks_two_stages_on_the_v():
    """ZB-V: rank r holds stages r and 2p-1-r, so rank 0 holds both the first and the last stage, and with 14
    layers over 8 stages gives up a layer in each."""
    shape = ModelShape(layers=14, hidden=128, heads=8, ffn=256, vocab=100)
    assert layer_split(shape, 4, 2, zbv=True) == (((1, 0), (1, 0)), ((2, 0), (2, 0)), ((2, 0), (2, 0)),
                                                  ((2, 0), (2, 0)))  # fmt: skip
    assert layer_split(shape, 4, 2)[0] == ((1, 0), (2, 0)) and layer_split(shape, 4, 2)[3] == ((2, 0), (1, 0))


def test_the_first_and_the_last_stage_may_hold_no_layer():
    """Llama 3 405B's 126 layers on 16 ranks of 8 chunks: the first stage holds only the embedding, the last
    only the head; one stage more would leave a middle one empty and is refused."""
    shape = ModelShape(layers=126, hidden=128, heads=8, ffn=256, vocab=100)
    split = layer_split(shape, 16, 8)
    assert split[0][0] == (0, 0) and split[15][7] == (0, 0) and sum(d for row in split for d, _ in row) == 126
    config = StepConfig(dp=1, tp=1, pp=16, schedule="interleaved-1f1b", chunks=8, microbatch=1)
    assert len(workload(shape, config, batch=16, seq=64).stages) == 16
    with pytest.raises(ValueError, match="pp x chunks = 128 stages: at most layers \\+ 2 = 127"):
        workload(dataclasses.replace(shape, layers=125), config, batch=16, seq=64)


def test_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="kv_heads=3"):
        ModelShape(layers=2, hidden=64, heads=4, kv_heads=3, ffn=128, vocab=10)
    with pytest.raises(ValueError, match="top_k"):
        ModelShape(layers=2, hidden=64, heads=4, ffn=128, vocab=10, experts=4)
    with pytest.raises(ValueError, match="recompute='all'"):
        StepConfig(dp=1, tp=1, pp=1, recompute="all")
    with pytest.raises(ValueError, match="sp=True needs tp > 1"):
        StepConfig(dp=1, tp=1, pp=1, sp=True)
    with pytest.raises(ValueError, match="batch=6 must be a multiple of dp\\*ep\\*microbatch=4"):
        workload(gpt(), StepConfig(dp=4, tp=1, pp=1), batch=6, seq=128)


# -- the published table ----------------------------------------------------------------------------------
def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_published.py"
    spec = importlib.util.spec_from_file_location("bench_published", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def published():
    bench = _bench()
    rows = bench.rows()
    return [(row, abs(err)) for row, err in zip(rows, bench.errors([(r, bench.predicted(r)) for r in rows]))]


def test_published_a100_rows_within_target(published):
    """Korthikanti et al. 2022 table 5 (8 rows) and Narayanan et al. 2021's 1T: mean |error| <= 4%, max <= 10%."""
    errors = [e for row, e in published if row.profile is A100]
    assert len(errors) == 9
    assert sum(errors) / len(errors) <= 0.04 and max(errors) <= 0.10, errors


def test_published_nvidia_h100_rows_within_target(published):
    """NVIDIA's Megatron-Core runs of the Llama 3.1 405B shape in bf16 on 576, 1,152 and 2,304 H100s (its DGX
    Cloud benchmark), their tensor-parallel collectives counted exposed: within the target. The recipe overlaps
    them (userbuffers), so this bounds the H100 profile from one side: counted hidden, the rows are 17-18% fast,
    as Llama 3's own rows are 14-19% (benchmarks/README.md)."""
    errors = [e for row, e in published if row.source.startswith("NVIDIA")]
    assert len(errors) == 3
    assert sum(errors) / len(errors) <= 0.04 and max(errors) <= 0.10, errors


@pytest.mark.xfail(strict=True, reason="Llama 3's H100 rows are predicted 14-19% fast (benchmarks/README.md)")
def test_published_all_rows_within_target(published):
    errors = [e for _, e in published]
    assert sum(errors) / len(errors) <= 0.04 and max(errors) <= 0.10, errors


# -- against a compiled plan (torch) ----------------------------------------------------------------------
def test_closed_form_bytes_equal_the_compiled_plan():
    """llama-tiny on Mesh(dp=2, tp=2) in fp32: the plan's tensor-parallel collectives of b·s·h and its
    data-parallel gradient all-reduce carry the bytes the closed form gives them."""
    torch = pytest.importorskip("torch")
    from meshlib import Mesh
    from meshlib_torch import compile_model
    from meshlib_torch.models import build, config, default_rules

    b, s, mesh = 4, 16, Mesh(dp=2, tp=2)
    cfg = config("llama-tiny")
    x = torch.zeros(b, s, dtype=torch.long, device="meta")
    plan = compile_model(build("llama-tiny"), mesh=mesh, rules=default_rules("llama-tiny", mesh),
                         example_inputs=(x, x.clone())).plan  # fmt: skip
    shape = ModelShape(layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, ffn=cfg.hidden_dim,
                       vocab=cfg.vocab_size, gated=True, norm="rmsnorm")  # fmt: skip
    c = StepConfig(dp=2, tp=2, pp=1, microbatch=b // 2, dtype="float32", reduce_dtype="float32")
    w = workload(shape, c, batch=b, seq=s)
    bsh = b // 2 * s * cfg.dim * 4
    ours = sum(x.bytes * x.count for x in w.stages[0].comm if x.axes == ("tp",) and x.bytes == bsh)
    theirs = sum(x.bytes * x.count for x in plan.collectives if x.axes == ("tp",) and x.bytes == bsh)
    assert ours == theirs
    grads = sum(x.bytes * x.count for x in w.stages[0].step_comm if x.kind == "all_reduce")
    synced = sum(x.bytes * x.count for x in plan.collectives if x.axes == ("dp",) and x.op == "grad sync")
    assert synced == pytest.approx(grads)
    assert math.isclose(grads, 4 * stage_params(shape, c, cfg.n_layers, 0, embed=True, head=True)[0])
