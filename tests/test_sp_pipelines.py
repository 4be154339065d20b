"""The configuration large runs use: pipeline stages with tensor and sequence parallelism, in bf16.

Method: every rank of a `RankPool` trains with `parallelize`; the parent runs the single process in
bf16. The bundled Llama trains 3 AdamW steps against the bf16 single-process run with fp32 masters
(`testing.parity`: bf16 tolerance, 2e-2). transformers' Llama (grouped-query attention, 4 layers)
takes one step, whose loss and gradients are compared with the unmodified model cast to bf16 and
run as it is (bf16 keeps 8 bits: the loss to 1e-2, each gradient to a tenth of its largest entry,
sums taken in other orders). Every pipeline schedule, on pp=2 x tp=2 with sequence parallelism;
dp=2 x pp=2 x tp=2 with ZeRO-1 and block recompute, clipped or not; and stages holding only the embedding or the head.
"""

import pytest
import real_models as rm
import torch

from meshlib import Mesh
from meshlib_torch.compiler.capture.call import batch_call, pick_loss
from meshlib_torch.testing.parity import RunConfig, compare, train_parallel, train_reference
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, run_parallel

pytestmark = pytest.mark.ranks

SCHEDULES = {  # schedule: (layers, stages per rank)
    "gpipe": (2, None), "1f1b": (2, None), "interleaved-1f1b": (4, 2), "zb-h1": (2, None), "zbv": (4, None),
}  # fmt: skip
BF16 = dict(sequence_parallel=True, precision="bf16", dtype="float32", microbatches=4, batch_size=8, lr=1e-3)
_REFERENCES: dict = {}


def _bundled(mesh: str, **options) -> None:
    run = RunConfig(model="llama-tiny", mesh=mesh, **BF16, **options)
    key = (run.overrides.get("n_layers", 2), run.max_norm)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_reference(run)
    results = get_pool(Mesh.parse(mesh).size).run(train_parallel, run)
    assert all(r.losses == results[0].losses for r in results)
    compare(_REFERENCES[key], results[0], run.tolerance)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_bundled_llama_on_every_schedule(schedule):
    layers, chunks = SCHEDULES[schedule]
    _bundled("pp=2,tp=2", schedule=schedule, chunks=chunks, overrides={"n_layers": layers})


def test_bundled_llama_with_dp_zero1_and_block_recompute():
    _bundled("dp=2,pp=2,tp=2", zero=1, recompute="block", schedule="1f1b")


def test_bundled_llama_with_dp_zero1_block_recompute_and_clipping():
    """The same, clipped to a global norm every step: the norm (compared step by step with the reference's,
    which torch's `clip_grad_norm_` takes on the whole bf16 model) is summed from ZeRO-1's pieces over dp,
    tp and both stages."""
    _bundled("dp=2,pp=2,tp=2", zero=1, recompute="block", schedule="1f1b", max_norm=0.05)


def build_llama4(dtype=torch.float32):
    tf = rm._quiet_transformers()
    cfg = tf.LlamaConfig(
        vocab_size=rm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(dtype).train()


def _hf(mesh: str, **options):
    trial = Trial(build_llama4, rm.hf_batch, mesh=mesh, rules=rm.rules_llama, steps=1,
                  options=dict(sequence_parallel=True, precision="bf16", microbatches=4, **options))  # fmt: skip
    got = get_pool(Mesh.parse(mesh).size).run(run_parallel, trial)[0]
    model = build_llama4().to(torch.bfloat16)
    args, kwargs = batch_call(rm.hf_batch(0))
    want = pick_loss(model(*args, **kwargs), None)
    want.backward()
    assert got.losses[0] == pytest.approx(want.item(), rel=1e-2)
    for n, p in model.named_parameters():
        scale = float(p.grad.float().abs().max())
        assert float((got.grads[n].float() - p.grad.float()).abs().max()) <= 0.1 * scale, n
    return got


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_transformers_llama_on_every_schedule(schedule):
    _hf("pp=2,tp=2", schedule=schedule, chunks=SCHEDULES[schedule][1])


def test_transformers_llama_with_dp_zero1_and_block_recompute():
    _hf("dp=2,pp=2,tp=2", zero=1, recompute="block", schedule="1f1b")


def test_transformers_llama_with_stages_of_only_the_embedding_or_the_head():
    """Llama 3 405B's layout (126 layers on 128 virtual stages): 4 layers on 2 ranks of 3 chunks with
    balance="layers", the first stage the embedding alone, the last the final norm and the head alone."""
    got = _hf("pp=2,tp=2", schedule="interleaved-1f1b", chunks=3, balance="layers")
    stages = got.plan.stages
    assert len(stages) == 6 and stages[0].modules == stages[-1].modules == ()
    assert [s.modules for s in stages[1:-1]] == [(f"model.layers.{i}",) for i in range(4)]


def test_stage_boundaries_send_the_bf16_sequence_shard():
    """Under bf16 compute with sequence parallelism a stage sends the residual stream's sequence shard
    in bf16: b * s/t * h * 2 bytes per microbatch (the compiler's collectives carry the dtype they run
    in, so the boundary and the next stage's input are bf16, not the trace's fp32)."""
    import torch as _torch

    from meshlib_torch import compile_model, models

    cfg, mesh = models.config("llama-tiny", n_layers=4), Mesh(pp=2, tp=2)
    example = tuple(_torch.empty(8, 32, dtype=_torch.long, device="meta") for _ in range(2))
    plan = compile_model(
        models.build(cfg, device="meta"), mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=example,
        sequence_parallel=True, precision="bf16", microbatches=4,
    ).plan  # fmt: skip
    sends = [b for stage in plan.stages for b in stage.sends if b.grad]
    assert sends and all(b.dtype == "bfloat16" and b.bytes == 2 * (32 // 2) * cfg.dim * 2 for b in sends)
