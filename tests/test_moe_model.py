"""The bundled mixture-of-experts model (`models/moe.py`) in one process, fp64 on the CPU.

Method:
- Blocks against transformers 5: a tiny `MixtralSparseMoeBlock` and a tiny `DeepseekV3MoE` (random
  weights; for DeepSeek a random `e_score_correction_bias`, and the test checks that both the bias and the
  group limit change some token's experts) are copied into our `MoE`; the outputs, the router's choices
  and weights, and the gradients of a random projection of the output with respect to the input and every
  weight agree to 1e-12. transformers computes routers (and norms, rotary angles) in fp32 whatever the
  model's dtype; while a reference runs, `hf_moe_models.fp64_kept` makes `.float()`, `.to(float32)` and
  leave an fp64 tensor as it is, so the reference is fp64 throughout. Unpatched, in fp32, the same blocks
  agree to fp32 accuracy: the patch hides nothing else.
- The whole `moe-tiny` against `MixtralForCausalLM` (sdpa attention, its fp32 rotary frequencies
  recomputed in fp64): our loss equals cross entropy of transformers' logits plus the coefficient times
  the hand-written balancing loss of each layer's router logits (transformers returns them), and every
  parameter's gradient agrees, to 1e-12.
- The balancing loss against a closed form written here with Python loops over tokens and slots; against
  transformers' `load_balancing_loss_func`, which gives top_k times it for one layer and, for several
  layers, the loss of all their tokens pooled (not a sum over layers).
- Aux-loss-free balancing: `tokens_per_expert` equals `torch.bincount` of the experts the router chose,
  summed over forwards; `update_balancing_bias` moves the bias by exactly rate * sign(mean - count),
  computed here in Python floats, zeroes the counts, and leaves routers with rate 0 alone.
- Zero-token experts: router weights no token's top-k reaches (checked by the counts); forward and
  backward run, and the unchosen experts' weights get exactly zero gradient, the chosen ones not.
- The tiny models run forward and backward; torch.fx traces them (buffers proxied, as the compiler's
  tracer does) to the same loss. The big configs build on the meta device with parameter counts equal
  to a closed form from the config, and to transformers' models built on meta: Mixtral-8x7B exactly
  (46.7B); DeepSeek-V3 (671.0B with MLA) plus, layer by layer, our Llama attention minus its MLA.
"""

from __future__ import annotations

import re
from contextlib import ExitStack

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hf_moe_models import fp64_kept
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

from meshlib import Mesh
from meshlib_torch.models import MoE, MoEConfig, build, config, default_rules, update_balancing_bias
from meshlib_torch.models.llama import TransformerBlock
from meshlib_torch.models.moe import MoEBlock, TopKRouter, load_balancing_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)
SOFTMAX = MoEConfig(dim=32, n_experts=8, top_k=2, moe_hidden_dim=16, router="softmax")
SIGMOID = MoEConfig(
    dim=32, n_experts=8, top_k=2, moe_hidden_dim=16, router="sigmoid", n_groups=4, topk_groups=2, n_shared_experts=1,
    routed_scaling_factor=2.5,
)


def _mixtral_block(dtype=torch.float64):
    torch.manual_seed(0)
    hf = MixtralConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
        experts_implementation="eager",
    )  # fmt: skip
    ref = MixtralSparseMoeBlock(hf).to(dtype)
    with torch.no_grad():
        ref.gate.weight.normal_(0, 0.5)
        ref.experts.gate_up_proj.normal_(0, 0.3)
        ref.experts.down_proj.normal_(0, 0.3)
    return ref, _copied(MoE(SOFTMAX).to(dtype), ref, {})


def _deepseek_block(dtype=torch.float64):
    torch.manual_seed(0)
    hf = DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, experts_implementation="eager",
    )  # fmt: skip
    ref = DeepseekV3MoE(hf).to(dtype)
    with torch.no_grad():
        ref.gate.weight.normal_(0, 0.5)
        ref.gate.e_score_correction_bias.normal_(0, 0.3)
        ref.experts.gate_up_proj.normal_(0, 0.3)
        ref.experts.down_proj.normal_(0, 0.3)
    shared = {"shared_experts.w1.": "shared_experts.gate_proj.", "shared_experts.w3.": "shared_experts.up_proj.",
              "shared_experts.w2.": "shared_experts.down_proj."}  # fmt: skip
    return ref, _copied(MoE(SIGMOID).to(dtype), ref, shared)


def _hf_name(name: str, renames: dict) -> str:
    for ours, theirs in renames.items():
        name = name.replace(ours, theirs)
    return name


def _copied(ours: torch.nn.Module, ref: torch.nn.Module, renames: dict) -> torch.nn.Module:
    """`ours` with every parameter and persistent buffer of `ref`, by name; both sides' names all used."""
    theirs = ref.state_dict()
    mine = ours.state_dict()
    assert {_hf_name(n, renames) for n in mine} == set(theirs)
    ours.load_state_dict({n: theirs[_hf_name(n, renames)] for n in mine})
    return ours


def _run(block, x, cotangent, *, keep_fp64=False):
    """The block's output, and the gradients of <output, cotangent> for the input and each parameter."""
    x = x.clone().requires_grad_(True)
    with fp64_kept() if keep_fp64 else ExitStack():
        y = block(x)
    (y * cotangent).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("make, renames", [
    (_mixtral_block, {}),
    (_deepseek_block, {"w1.": "gate_proj.", "w3.": "up_proj.", "w2.": "down_proj."}),
])  # fmt: skip
def test_moe_blocks_equal_transformers_in_fp64(make, renames):
    ref, ours = make()
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cot = torch.randn_like(x)
    y, dx, grads = _run(ours, x, cot)
    y_ref, dx_ref, grads_ref = _run(ref, x, cot, keep_fp64=True)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(dx, dx_ref, **TIGHT)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[_hf_name(name, renames)], **TIGHT, msg=name)
    flat = x.reshape(-1, 32)
    with torch.no_grad(), fp64_kept():
        _, w_ref, i_ref = ref.gate(flat)
    _, w, i = ours.gate(flat)
    torch.testing.assert_close(i.sort(-1).values, i_ref.sort(-1).values, rtol=0, atol=0)
    torch.testing.assert_close(w.gather(1, i.argsort(-1)), w_ref.gather(1, i_ref.argsort(-1)), **TIGHT)


def test_deepseek_reference_exercises_the_bias_and_the_group_limit():
    ref, _ = _deepseek_block()
    torch.manual_seed(1)
    flat = torch.randn(14, 32, dtype=torch.float64)
    with torch.no_grad(), fp64_kept():
        logits, _, chosen = ref.gate(flat)
    scores, bias = logits.sigmoid(), ref.gate.e_score_correction_bias
    as_sets = lambda index: [set(row) for row in index.tolist()]
    assert as_sets(chosen) != as_sets(scores.topk(2, dim=-1)[1])  # the bias moved some token's experts
    assert as_sets(chosen) != as_sets((scores + bias).topk(2, dim=-1)[1])  # so did the group limit


@pytest.mark.parametrize("make", [_mixtral_block, _deepseek_block])
def test_moe_blocks_equal_transformers_unpatched_in_fp32(make):
    ref, ours = make(torch.float32)
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32)
    cot = torch.randn_like(x)
    y, dx, _ = _run(ours, x, cot)
    y_ref, dx_ref, _ = _run(ref, x, cot)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)


def _aux_by_hand(probs: torch.Tensor, chosen: list[list[int]]) -> torch.Tensor:
    """E * sum_e f_e * P_e: f_e the share of (token, slot) pairs that chose e, P_e the mean probability."""
    n_tokens, n_experts = probs.shape
    pairs = [e for row in chosen for e in row]
    total = probs.new_zeros(())
    for e in range(n_experts):
        f = pairs.count(e) / len(pairs)
        p = sum(probs[t, e] for t in range(n_tokens)) / n_tokens
        total = total + f * p
    return n_experts * total


def test_balancing_loss_closed_form_and_transformers():
    torch.manual_seed(2)
    ref, ours = _mixtral_block()
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    with torch.no_grad(), fp64_kept():
        logits, _, chosen = ref.gate(x.reshape(-1, 32))
    _, aux = ours.forward_with_aux(x)
    by_hand = _aux_by_hand(logits.softmax(-1), chosen.tolist())
    torch.testing.assert_close(aux, by_hand, **TIGHT)
    # transformers: top_k times ours for one layer, in fp32 (its sums are fp32)
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert hf.dtype == torch.float32
    torch.testing.assert_close(hf.double(), 2 * aux, rtol=1e-6, atol=0)
    # for two layers: the loss of their tokens pooled, not the sum (or mean) of the layers' losses
    other = torch.randn_like(logits)
    hf_two = load_balancing_loss_func((logits, other), num_experts=8, top_k=2).double()
    pooled = torch.cat([logits, other])
    torch.testing.assert_close(hf_two, 2 * _aux_by_hand(pooled.softmax(-1), pooled.topk(2)[1].tolist()), rtol=1e-6, atol=0)
    per_layer = _aux_by_hand(other.softmax(-1), other.topk(2)[1].tolist()) + by_hand
    assert abs(hf_two - per_layer).item() > 1e-3 and abs(hf_two - per_layer / 2).item() > 1e-3


def test_balancing_loss_sigmoid_router_uses_scores_normalised_per_token():
    ref, ours = _deepseek_block()
    torch.manual_seed(2)
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    with torch.no_grad(), fp64_kept():
        logits, _, chosen = ref.gate(x.reshape(-1, 32))
    _, aux = ours.forward_with_aux(x)
    scores = logits.sigmoid()
    torch.testing.assert_close(aux, _aux_by_hand(scores / scores.sum(-1, keepdim=True), chosen.tolist()), **TIGHT)
    # and the definition: 1 for uniform probabilities and a uniform choice
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    assert load_balancing_loss(uniform, torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]).repeat(2, 1)).item() == 1.0


_TO_MIXTRAL = [(r"^tok_embeddings\.", "model.embed_tokens."), (r"^layers\.", "model.layers."),
               (r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."), (r"\.attention_norm\.", ".input_layernorm."),
               (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.moe\.", ".mlp."), (r"^norm\.", "model.norm."),
               (r"^output\.", "lm_head.")]  # fmt: skip


def _mixtral_name(name: str) -> str:
    for pattern, repl in _TO_MIXTRAL:
        name = re.sub(pattern, repl, name)
    return name


def test_moe_tiny_equals_mixtral_for_causal_lm_in_fp64():
    cfg = config("moe-tiny")
    hf = MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.moe_hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attn_implementation="sdpa",
        experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(3)
    ref = MixtralForCausalLM(hf).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
        rotary = ref.model.rotary_emb
        rotary.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    ours = build(cfg, device="cpu", dtype=torch.float64)
    ours.init_buffers()
    theirs = dict(ref.named_parameters())
    assert {_mixtral_name(n) for n, _ in ours.named_parameters()} == set(theirs)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(theirs[_mixtral_name(name)])
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, 12)).unbind(0)
    loss = ours(tokens, targets)
    loss.backward()
    with fp64_kept():
        out = ref(input_ids=tokens, output_router_logits=True)
    routers = out.router_logits
    assert len(routers) == cfg.n_layers and routers[0].dtype == torch.float64
    aux = sum(_aux_by_hand(r.softmax(-1), r.softmax(-1).topk(cfg.top_k)[1].tolist()) for r in routers)
    loss_ref = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)) + cfg.aux_loss_coef * aux
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, **TIGHT)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[_mixtral_name(name)].grad, **TIGHT, msg=name)


def test_tokens_per_expert_and_update_balancing_bias():
    model = build("moe-tiny-ds", device="cpu", dtype=torch.float64)
    model.init_buffers()
    routers = {n: m for n, m in model.named_modules() if isinstance(m, TopKRouter)}
    assert sorted(routers) == ["layers.1.moe.gate", "layers.2.moe.gate"]
    chosen = {n: [] for n in routers}
    for name, router in routers.items():
        router.register_forward_hook(lambda mod, args, out, name=name: chosen[name].append(out[2].clone()))
    torch.manual_seed(4)
    with torch.no_grad():
        for router in routers.values():
            router.e_score_correction_bias.normal_(0, 0.1)
        before = {n: r.e_score_correction_bias.clone() for n, r in routers.items()}
        for _ in range(2):
            model(*torch.randint(0, 256, (2, 2, 16)).unbind(0))
    rate = model.config.bias_update_rate
    for name, router in routers.items():
        counts = torch.bincount(torch.cat(chosen[name]).reshape(-1), minlength=8).double()
        assert torch.equal(router.tokens_per_expert, counts)
        assert counts.sum().item() == 2 * 2 * 16 * 2  # forwards * tokens * top_k
    expected = {}
    for name, router in routers.items():
        counts = router.tokens_per_expert.tolist()
        mean = sum(counts) / len(counts)
        signs = [(mean > c) - (mean < c) for c in counts]
        expected[name] = [b + rate * s for b, s in zip(before[name].tolist(), signs)]
        assert 0 < signs.count(1) < 8  # some experts under the mean, some not
    update_balancing_bias(model)
    for name, router in routers.items():
        assert router.e_score_correction_bias.tolist() == expected[name]
        assert not router.tokens_per_expert.any()
    # a router whose rate is 0 is left alone
    off = build("moe-tiny-ds", device="cpu", dtype=torch.float64, bias_update_rate=0.0)
    off.init_buffers()
    off(*torch.randint(0, 256, (2, 2, 16)).unbind(0))
    counts = off.layers[1].moe.gate.tokens_per_expert.clone()
    update_balancing_bias(off)
    assert torch.equal(off.layers[1].moe.gate.tokens_per_expert, counts) and counts.sum().item() == 64
    assert not off.layers[1].moe.gate.e_score_correction_bias.any()


@pytest.mark.parametrize("cfg", [SOFTMAX, SIGMOID], ids=["softmax", "sigmoid"])
def test_experts_no_token_chose_get_exactly_zero_gradient(cfg):
    torch.manual_seed(5)
    block = MoE(cfg).double()
    u = F.normalize(torch.randn(32, dtype=torch.float64), dim=0)
    with torch.no_grad():  # experts 0-4 lean along u, 5-7 against it; every token leans along u
        block.gate.weight[:5] = (1 + 0.1 * torch.arange(5.0, dtype=torch.float64))[:, None] * u + 0.05 * torch.randn(5, 32)
        block.gate.weight[5:] = -u
        block.experts.gate_up_proj.normal_(0, 0.3)
        block.experts.down_proj.normal_(0, 0.3)
    x = (3 * u + 0.1 * torch.randn(2, 9, 32, dtype=torch.float64)).requires_grad_(True)
    y, aux = block.forward_with_aux(x)
    ((y * torch.randn_like(y)).sum() + aux).backward()
    counts = block.gate.tokens_per_expert
    unchosen = [e for e in range(8) if counts[e] == 0]
    assert {5, 6, 7} <= set(unchosen) and len(unchosen) < 8
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    for e in range(8):
        for grad in (block.experts.gate_up_proj.grad[e], block.experts.down_proj.grad[e]):
            assert (grad == 0).all() if e in unchosen else (grad != 0).any(), e


class _ProxyBuffers(fx.Tracer):
    proxy_buffer_attributes = True  # as the compiler's tracer: the rotary tables are sliced by a traced length


@pytest.mark.parametrize("name", ["moe-tiny", "moe-tiny-ds"])
def test_tiny_models_train_and_trace(name):
    cfg = config(name)
    torch.manual_seed(6)
    model = build(name, device="cpu", dtype=torch.float64)
    model.init_buffers()
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [TransformerBlock] * cfg.n_dense_layers + [MoEBlock] * (cfg.n_layers - cfg.n_dense_layers)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, 32)).unbind(0)
    loss = model(tokens, targets)
    loss.backward()
    assert loss.dtype == torch.float64 and 4 < loss.item() < 7  # about ln(256) = 5.5 at init
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.any() or "experts" in n, n
    gm = fx.GraphModule(model, _ProxyBuffers().trace(model))
    assert gm(tokens, targets).item() == loss.item()


def test_param_init_and_tensor_parallel_rules():
    cfg = config("moe-tiny-ds")
    cls = type(build(cfg))
    small = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert cls.param_init("layers.1.moe.experts.down_proj", cfg) == ("normal", small)
    assert cls.param_init("layers.1.moe.shared_experts.w2.weight", cfg) == ("normal", small)
    assert cls.param_init("layers.1.moe.experts.gate_up_proj", cfg) == ("normal", 0.02)
    assert cls.param_init("layers.1.ffn_norm.weight", cfg) == ("ones", 0.0)
    rule = default_rules(cfg, Mesh.parse("dp=2,tp=2"))
    specs = {n: rule(n, p) for n, p in build(cfg).named_parameters()}
    assert specs["layers.0.feed_forward.w1.weight"] == specs["layers.1.moe.shared_experts.w3.weight"]
    assert str(specs["layers.2.attention.wq.weight"]) == str(specs["layers.1.moe.shared_experts.w1.weight"])
    assert str(specs["layers.1.moe.shared_experts.w2.weight"]) == str(specs["layers.0.attention.wo.weight"])
    assert "tp" in str(specs["layers.2.attention.wq.weight"])
    for n in ("layers.1.moe.gate.weight", "layers.1.moe.experts.gate_up_proj", "layers.2.moe.experts.down_proj"):
        assert "tp" not in str(specs[n]), n


def test_config_errors_name_the_values():
    with pytest.raises(ValueError, match=r"router='topk'"):
        MoEConfig(router="topk")
    with pytest.raises(ValueError, match=r"n_groups=3 does not divide n_experts=8"):
        MoEConfig(n_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match=r"bias_update_rate=0.001 needs router='sigmoid'"):
        MoEConfig(bias_update_rate=1e-3)
    with pytest.raises(ValueError, match=r"n_dense_layers=3 is not in 0..n_layers=2"):
        config("deepseek-v3", n_layers=2)


def _closed_form_count(cfg: MoEConfig) -> int:
    d, hd, kv = cfg.dim, cfg.dim // cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    attention = 2 * d * cfg.n_heads * hd + 2 * d * kv * hd + 2 * d  # wq, wo; wk, wv; two norms
    dense = 3 * d * cfg.hidden_dim
    moe = cfg.n_experts * d + 3 * cfg.n_experts * d * cfg.moe_hidden_dim + 3 * d * cfg.moe_hidden_dim * cfg.n_shared_experts
    n_moe = cfg.n_layers - cfg.n_dense_layers
    return 2 * cfg.vocab_size * d + d + cfg.n_layers * attention + cfg.n_dense_layers * dense + n_moe * moe


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mixtral_8x7b_on_meta_has_its_published_size():
    model = build("mixtral-8x7b")
    assert next(model.parameters()).is_meta
    total = _count(model)
    assert total == _closed_form_count(config("mixtral-8x7b"))
    with torch.device("meta"):
        hf = MixtralForCausalLM(MixtralConfig(experts_implementation="eager"))  # its defaults: 8x7B's shape
    assert total == _count(hf) == 46_702_792_704  # 46.7B


def test_deepseek_v3_on_meta_is_its_published_size_but_for_attention():
    model = build("deepseek-v3")
    total = _count(model)
    assert total == _closed_form_count(config("deepseek-v3")) == 672_149_632_000
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(DeepseekV3Config(experts_implementation="eager"))  # its defaults: V3's shape
    hf_total = _count(hf)
    assert round(hf_total / 1e9) == 671  # MLA; without the multi-token prediction module, as published
    attention_gap = sum(_count(ours.attention) - _count(theirs.self_attn) for ours, theirs in zip(model.layers, hf.model.layers))
    assert total - hf_total == attention_gap and 1.1e9 < attention_gap < 1.2e9
