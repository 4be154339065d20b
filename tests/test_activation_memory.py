"""What a layer keeps for backward, against Korthikanti et al. 2022 and against real ranks.

Method. Closed forms, per layer and microbatch on one rank, in bf16 (2 bytes), with sequence
parallelism over t ranks (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4 and table 2: sbh(34/t + 5as/(ht)), `meshlib.cost.activation_bytes`):

- the bundled GPT (LayerNorm, GELU, no dropout, flash attention) keeps Korthikanti's GPT layer
  less its two dropout masks (sbh/t bytes each) and its attention scores (the 5as/(ht) term: the
  attention kernel keeps none), plus what the plan itemises: the kernel's log-sum-exp
  (4 bytes per head and token) and each LayerNorm's mean and rstd (4 bytes per token each);
- the bundled Llama (RMSNorm, SwiGLU of width F, rotary positions, flash attention) keeps the same
  terms where its layer has them, a shard each: the inputs of the two norms, of the q, k, v
  projections, of the output projection and of the MLP, and q, k and v (8 shards of 2sbh/t), and
  for SwiGLU its four sbF-sized values (the gate's input and output, the up projection, their
  product: 4 * 2sbF/t); plus what the plan itemises: RMSNorm written as ops keeps its normalized
  input for its weight's gradient (2 more shards) and its rsqrt (2 bytes per token), and the
  attention kernel's log-sum-exp;
- block recompute keeps the layer's input, 2sbh/t;
- selective recompute keeps what the layer's collectives (but its all-gathers), projections and
  attention kernel return: the input, q, k, v, the attention output and the log-sum-exp, the two
  reduce-scatters' shards, the gate and up projections (2sbF/t each), and the two row-parallel
  projections' outputs before their reduce-scatter, whole (2sbh each): the plan's note says so.

On real gloo ranks (`PeakTracker` on the CPU), what each layer's forward made is alive when the
forward ends is exactly the plan's kept bytes (but for CPU's LayerNorm statistics in bf16), and the
step's peak, the optimizer's update included, is within 5% of the dry run's.
"""

import pytest
import torch

from meshlib import Mesh
from meshlib.cost import activation_bytes
from meshlib_torch import PeakTracker, compile_model, models, parallelize
from meshlib_torch import data as mdata
from meshlib_torch.testing.pool import get_pool

BATCH, SEQ = 8, 128
CASES = [  # model, mesh, options
    ("llama-small", "tp=2", {"recompute": "none"}),
    ("llama-small", "tp=2", {"recompute": "block"}),
    ("llama-small", "tp=2", {"recompute": "selective"}),
    ("llama-small", "tp=4", {"recompute": "none"}),
    ("llama-small", "tp=4", {"recompute": "block"}),
    ("llama-small", "tp=4", {"recompute": "selective"}),
    ("gpt-small", "tp=2", {"recompute": "none"}),
    ("llama-small", "pp=2,tp=2", {"recompute": "none", "microbatches": 4}),
    ("llama-small", "pp=2,tp=2", {"recompute": "block", "microbatches": 4}),
]


def _plan(model: str, mesh: str, **options):
    cfg, m = models.config(model), Mesh.parse(mesh)
    example = tuple(torch.empty(BATCH, SEQ, dtype=torch.long, device="meta") for _ in range(2))
    return compile_model(
        models.build(cfg, device="meta"), mesh=m, rules=models.default_rules(cfg, m), example_inputs=example,
        sequence_parallel=True, precision="bf16", estimate_memory=True, **options,
    ).plan  # fmt: skip


def closed_form(model: str, t: int, recompute: str, micro: int = BATCH) -> int:
    """Bytes one layer keeps per microbatch of `micro` sequences on one rank (see the module docstring)."""
    cfg = models.config(model)
    s, b = SEQ, micro
    if model.startswith("gpt"):
        h, a = cfg.n_embd, cfg.n_head
        korthikanti = activation_bytes(s, b, h, a, t=t, sp=True, recompute=recompute)
        if recompute == "block":
            return korthikanti
        no_dropout = korthikanti - 2 * s * b * h / t - 5 * a * s * s * b / t
        return int(no_dropout + 4 * b * (a // t) * s + 2 * 2 * 4 * b * s / t)
    h, f, a = cfg.dim, cfg.hidden_dim, cfg.n_heads
    shard, wide, lse = 2 * s * b * h // t, 2 * s * b * f // t, 4 * b * (a // t) * s
    if recompute == "block":
        return shard
    if recompute == "selective":
        return 7 * shard + 2 * t * shard + 2 * wide + lse
    return 8 * shard + 4 * wide + 2 * shard + 2 * 2 * b * s // t + lse


def _cpu_norm_stats(model: str, t: int) -> int:
    """CPU's LayerNorm keeps a bf16 input's mean and rstd in bf16, where the meta device (as CUDA) keeps
    them in fp32: 2 bytes less per token for each, for each of a GPT layer's two norms."""
    return 2 * 2 * 2 * BATCH * SEQ // t if model.startswith("gpt") else 0


def _measure(model: str, mesh: str, options: dict) -> tuple[int, list[int]]:
    """One bf16 step's peak bytes on this rank; and (no pipeline) what each layer's forward made that is
    alive when the forward ends, so what it keeps for backward."""
    cfg, m = models.config(model), Mesh.parse(mesh)
    with torch.device("meta"):
        module = models.build(cfg)
    batch = mdata.batch(0, batch_size=BATCH, seq_len=SEQ)
    par = parallelize(
        module, mesh=m, rules=models.default_rules(cfg, m), example_inputs=batch, init=lambda n: ("normal", 0.02),
        sequence_parallel=True, precision="bf16", **options,
    )  # fmt: skip
    opt = par.optimizer(lr=1e-3)
    par.train_step(batch, opt)  # the optimizer's state exists from here on
    state = [v for st in opt.state.values() for v in st.values()] + list(opt.master.values())
    kept = []
    if par.pipeline is None:
        with PeakTracker(device="cpu") as tracker:
            tracker.baseline(list(par.parameters()) + list(par.buffers()) + state)
            hooks = [b.register_forward_pre_hook(lambda _m, _a, i=i: setattr(tracker, "label", i))
                     for i, b in enumerate(par.blocks())]  # fmt: skip
            hooks += [b.register_forward_hook(lambda *_: setattr(tracker, "label", None)) for b in par.blocks()]
            loss = par(*mdata.batch(2, batch_size=BATCH, seq_len=SEQ))
            by_layer = tracker.live_by_label()
            kept = [by_layer.get(i, 0) for i in range(len(par.blocks()))]
            del loss
            for h in hooks:
                h.remove()
    with PeakTracker(device="cpu") as tracker:
        tracker.baseline(list(par.parameters()) + list(par.buffers()) + state)
        par.train_step(mdata.batch(1, batch_size=BATCH, seq_len=SEQ), opt)
    return tracker.peak, kept


@pytest.mark.ranks
@pytest.mark.parametrize("model, mesh, options", CASES, ids=[f"{m}-{me}-{o['recompute']}" for m, me, o in CASES])
def test_kept_per_layer_is_the_closed_form_and_what_ranks_measure(model, mesh, options):
    plan = _plan(model, mesh, **options)
    t = Mesh.parse(mesh).axis_size("tp")
    micro = BATCH // options.get("microbatches", 1)
    want = closed_form(model, t, options["recompute"], micro)
    steady = plan.kept[2:]  # past the first layers, whose inputs the embedding made
    assert steady and all(k.bytes == want for k in steady), (want, plan.kept)
    if options["recompute"] == "none":
        assert all(sum(n for _, n in k.items) == k.bytes for k in steady)  # itemised in full
    measured = get_pool(Mesh.parse(mesh).size).run(_measure, model, mesh, options)
    for rank, (peak, layers) in enumerate(measured):
        pp = Mesh.parse(mesh).coords(rank).get("pp") if "pp" in mesh else None
        assert plan.rank_memory(pp).peak == pytest.approx(peak, rel=0.05), (rank, plan.rank_memory(pp), peak)
        assert layers[2:] == [k.bytes - _cpu_norm_stats(model, t) for k in steady] or "pp" in mesh, (rank, layers)


def test_the_plan_names_what_a_llama_layer_keeps_beyond_the_closed_form():
    """Without recompute the extras are the unfused RMSNorm's normalized inputs, its rsqrt and the attention
    kernel's log-sum-exp: the plan lists each, and the rest is the closed form's terms."""
    plan = _plan("llama-small", "tp=2")
    items = dict(plan.kept[2].items)
    own = [k for k in items if "kept by the op itself" in k]
    assert len(own) == 1 and "scaled_dot_product_attention" in own[0]  # the log-sum-exp
    assert len([k for k in items if k.split(" ")[0].startswith("rsqrt")]) == 2
    assert plan.note_map["all-gathered values"].startswith("an all-gathered value backward needs is kept as its shard")
