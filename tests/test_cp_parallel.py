"""Context parallelism in compiled models: the bundled GPT and Llama on `cp` train as the single process.

Method: the same fp64 weights and batches run once in one process (the reference: the model as written,
`F.scaled_dot_product_attention` on the whole sequence) and once compiled on gloo ranks, where the inputs'
sequence dim is split over `cp` by the default input spec and each attention call is a `ring_attention`
region (keys and values around the ring of cp ranks, contiguous layout); outside attention `cp` is a data
axis. The losses, every gradient after the first backward and every parameter after 3 AdamW steps must
agree to 1e-12. The plan's ring bytes must equal the bytes each rank counted and the closed form.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshlib as ml
from meshlib_torch import compile_model
from meshlib_torch.models import build, default_rules
from meshlib_torch.testing.measure import measure_step, planned
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

BATCH, SEQ = 4, 8


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = build(name, device="cpu", dtype=torch.float64)
    for pname, p in model.named_parameters():
        if not pname.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            nn.init.normal_(p, std=0.05)
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    return model


def build_gpt() -> nn.Module:
    return _build("gpt-tiny")


def build_llama() -> nn.Module:
    return _build("llama-tiny")


def rules_gpt(mesh):
    return default_rules("gpt-tiny", mesh)


def rules_llama(mesh):
    return default_rules("llama-tiny", mesh)


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


MODELS = {"gpt-tiny": (build_gpt, rules_gpt), "llama-tiny": (build_llama, rules_llama)}
_REFERENCES: dict = {}


def _reference(name: str):
    if name not in _REFERENCES:
        _REFERENCES[name] = run_single(Trial(MODELS[name][0], batch, lr=1e-3))
    return _REFERENCES[name]


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize(
    "mesh, options",
    [("cp=2", {}), ("dp=2,cp=2", {}), ("cp=4", {}), ("dp=2,cp=2", {"zero": 3}), ("cp=2", {"zero": 1}),
     ("tp=2,cp=2", {}), ("pp=2,cp=2", {"microbatches": 2})],
)
def test_a_dense_model_on_cp_trains_as_the_single_process(name, mesh, options):
    """Positions come out global (gpt's learned positions and llama's rotary tables are sliced to each
    rank's tokens), the loss is the mean over every token of every rank, and the gradients are summed over
    dp×cp: losses, gradients and parameters equal the single process's to 1e-12 on every rank."""
    build_fn, rules = MODELS[name]
    trial = Trial(build_fn, batch, mesh=mesh, rules=rules, lr=1e-3, options=options)
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    ref = _reference(name)
    worst = [assert_same(ref, rank, rtol=1e-12, atol=1e-12) for rank in got]
    print(f"{name} {mesh} {options}: max |diff|", {k: max(w[k] for w in worst) for k in worst[0]})
    notes = dict(got[0].plan.notes)
    assert "cp" in notes["data-parallel axes"] and "ring_attention over cp=" in notes["context parallelism"]


@pytest.mark.ranks
@pytest.mark.parametrize(
    "name, mesh", [("gpt-tiny", "dp=2,cp=2"), ("llama-tiny", "cp=2"), ("gpt-tiny", "cp=4"), ("llama-tiny", "tp=2,cp=2")]
)
def test_the_plan_counts_the_ring_as_each_rank_runs_it(name, mesh):
    """Plan = measured = closed form, on every rank: per layer and step the ring moves (cp-1) hops of K and V,
    2·B·Hkv·(S/cp)·D·itemsize bytes each, forward, and their gradients the same way back (B the batch per
    dp rank, Hkv the key/value heads per tp rank). Learned positions are sliced, not gathered: nothing else
    moves over cp in forward or backward but the ring, the loss's sum and the gradient sync."""
    build_fn, rules = MODELS[name]
    trial = Trial(build_fn, batch, mesh=mesh, rules=rules, lr=1e-3)
    results = get_pool(ml.Mesh.parse(mesh).size).run(measure_step, trial)
    m = ml.Mesh.parse(mesh)
    cp = m.axis_size("cp")
    dp, tp = (m.axis_size(a) if a in m.axis_names else 1 for a in ("dp", "tp"))
    model = build_fn()
    layers = len(model.h) if name == "gpt-tiny" else len(model.layers)
    heads = model.config.n_head if name == "gpt-tiny" else model.config.kv_heads
    head_dim = 32 // 4  # both: 4 heads of a width of 32
    ring = (cp - 1) * 2 * (BATCH // dp) * (heads // tp) * (SEQ // cp) * head_dim * 8
    for got in results:
        plan = planned(got["plan"], got["coords"])["comm"]
        assert got["comm"] == plan, (got["rank"], got["coords"])
        assert plan[("forward", "send_recv", "cp")] == layers * ring
        assert plan[("backward", "send_recv", "cp")] == layers * ring
        print(f"{name} {mesh}: ring bytes per layer {ring} forward, {ring} backward (closed form = plan = counted)")
        over_cp = {k for k in plan if "cp" in k[2].split("_") and k[1] not in ("send_recv",)}
        assert over_cp <= {("forward", "all_reduce", "cp"), ("forward", "all_reduce", "dp_cp"),
                           ("backward", "all_reduce", "dp_cp"), ("backward", "all_reduce", "cp")}, over_cp


def _compile(name, mesh, tokens):
    model = build(name, device="meta", dtype=torch.float64)
    m = ml.Mesh.parse(mesh)
    return compile_model(model, mesh=m, rules=default_rules(name, m), example_inputs=(tokens, tokens))


def test_a_sequence_cp_does_not_divide_is_refused_naming_the_fix():
    tokens = torch.zeros(4, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=r"(?s)input 'idx'.*9.*cp"):
        _compile("gpt-tiny", "cp=2", tokens)


class _Masked(nn.Module):
    """One attention call with an option the ring does not run."""

    def __init__(self, **kwargs):
        super().__init__()
        self.emb, self.kwargs = nn.Embedding(16, 8), kwargs

    def forward(self, ids):
        x = self.emb(ids).unsqueeze(1)  # (B, 1, S, 8)
        kwargs = dict(self.kwargs)
        if kwargs.pop("mask", False):
            kwargs["attn_mask"] = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, **kwargs).sum()


@pytest.mark.parametrize("kwargs, match", [({"mask": True}, "attn_mask.*is_causal=True"),
                                           ({"dropout_p": 0.1}, "dropout_p=0.1.*Fix: set the attention dropout")])
def test_attention_options_the_ring_does_not_run_are_refused_at_compile_time(kwargs, match):
    m = ml.Mesh.parse("cp=2")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        compile_model(_Masked(**kwargs), mesh=m, rules=ml.pattern_rules({}, default=ml.P()), example_inputs=(tokens,))


# -- cp_method: the other two ways across the cp ranks ----------------------------------------------------
@pytest.mark.ranks
@pytest.mark.parametrize(
    "name, mesh, method", [("gpt-tiny", "cp=2", "all-gather"), ("llama-tiny", "dp=2,cp=2", "all-gather"),
                           ("gpt-tiny", "dp=2,cp=2", "all-to-all"), ("llama-tiny", "cp=4", "all-to-all")],
)  # fmt: skip
def test_each_cp_method_trains_as_the_single_process_and_is_planned_as_it_runs(name, mesh, method):
    """`cp_method="all-gather"` (keys and values gathered once) and `"all-to-all"` (DeepSpeed-Ulysses: sequence
    shards swapped for head shards) give the single process's losses, gradients and parameters (fp64, 1e-12,
    3 AdamW steps), and each rank's counted bytes equal the plan's; the plan names the method."""
    build_fn, rules = MODELS[name]
    trial = Trial(build_fn, batch, mesh=mesh, rules=rules, lr=1e-3, options={"cp_method": method})
    size = ml.Mesh.parse(mesh).size
    for rank in get_pool(size).run(run_parallel, trial):
        assert_same(_reference(name), rank, rtol=1e-12, atol=1e-12)
    kind = {"all-gather": "all_gather", "all-to-all": "all_to_all"}[method]
    for got in get_pool(size).run(measure_step, trial):
        plan = planned(got["plan"], got["coords"])["comm"]
        assert got["comm"] == plan, (got["rank"], got["coords"])
        assert plan[("forward", kind, "cp")] > 0 and ("forward", "send_recv", "cp") not in plan
        assert method.replace("-", "") in dict(got["plan"].notes)["context parallelism"].replace("ulysses", "alltoall")


def test_ulysses_refuses_heads_cp_does_not_divide_at_compile_time():
    """gpt-tiny's 4 heads, 2 per tp rank on tp=2, do not divide over cp=4: the all-to-all variant says so while
    compiling, naming the numbers and the fix (another cp_method)."""
    tokens = torch.zeros(4, 8, dtype=torch.long)
    m = ml.Mesh.parse("tp=2,cp=4")
    with pytest.raises(ValueError, match=r"(?s)heads.*cp"):
        compile_model(build("gpt-tiny", device="meta", dtype=torch.float64), mesh=m,
                      rules=default_rules("gpt-tiny", m), example_inputs=(tokens, tokens), cp_method="all-to-all")  # fmt: skip
