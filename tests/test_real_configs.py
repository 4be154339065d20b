"""Released configurations of families the other tests do not use: Megatron's pattern, and the numbers.

Gemma (padding row 0), Phi-3 (a padding row inside the vocabulary) and OPT (padding row 1, learned
positions offset by 2) set `padding_idx` on their token embedding; Phi-3 fuses q, k and v of unequal
sizes (grouped-query attention) into one `qkv_proj` cut by slicing, and gate and up into one
`gate_up_proj` cut by `chunk`. Each is built by `real_models` from a small config with random weights.

Method (plans, no processes): Megatron's split written against each model's own parameter names
must cost, on the tp axis, exactly the closed form: per layer 2 all-reduces of b*s*h forward and 2
backward, plus the vocab-parallel embedding's forward sum and the head input's backward sum (b*s*h
each), plus the vocab-parallel loss's two reductions (b*s and 2*b*s fp32 values), and nothing else:
no parameter gathered, no activation gathered.

Method (unit): the vocab-parallel embedding on simulated ranks (each rank its torch.chunk piece of
the rows) against `F.embedding` with the same `padding_idx`, gradients included.

Method (parity): as `test_real_models`, every rank of a gloo pool trains the model (3 AdamW steps) on
dp=2 x tp=2 and the parent the unmodified model with the same weights and right-padded batches;
losses, every gradient after the first backward and every parameter after the last step agree to
1e-5 (fp32), and the padding row's gradient is exactly zero on both. Phi-3 also under ZeRO-3,
sequence parallelism and pp=2 x tp=2; a nanoGPT-style model with the same unequal fused qkv (and its
bias), traced by torch.fx, in fp64 to 1e-12.

Method (state): Phi-3's qkv_proj lives as a DTensor of its rows in rank order; a checkpoint saved
with it reloads bitwise on a mesh without tp and the other way round (into ZeRO-1's masters), the
next losses are the saver's own, and it serves as `weights=`; an export is read by transformers'
`from_pretrained` with every tensor as trained; save_pretrained's safetensors load into the parts.
"""

import pytest
import real_models as rm
import torch
import torch.nn.functional as F

import meshlib as ml
from meshlib_torch import compile_model
from meshlib_torch.compiler.placement.placements import chunk_rows
from meshlib_torch.compiler.placement.rank_ops import padding_row
from meshlib_torch.modules.special import VocabEmbedding
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytest.importorskip("transformers")

LAYERS, HIDDEN, FP32 = 2, 32, 4


def _compiled(name: str, mesh: str):
    build, rules, batch, loss = rm.MODELS[name]
    m = ml.Mesh.parse(mesh)
    return compile_model(build(), mesh=m, rules=rules(m), example_inputs=batch(0), loss=loss)


def _on_tp(plan) -> list[tuple[str, str, int]]:
    """Every call on the tp axis: (phase, kind, bytes), one entry per call, sorted."""
    return sorted((c.phase, c.kind, c.bytes) for c in plan.collectives if "tp" in c.axes for _ in range(c.count))


def _megatron(dp: int, itemsize: int = FP32) -> list[tuple[str, str, int]]:
    """The closed form: 2 all-reduces of b*s*h per layer each way, the embedding's sum forward and the
    head input's backward, and the vocab-parallel loss's max (b*s) and sum-exp with target logit (2*b*s)."""
    b, s = rm.BATCH // dp, rm.SEQ
    bsh = b * s * HIDDEN * itemsize
    calls = [("forward", "all_reduce", bsh)] * (2 * LAYERS + 1) + [("backward", "all_reduce", bsh)] * (2 * LAYERS + 1)
    loss = [("forward", "all_reduce", b * s * itemsize), ("forward", "all_reduce", 2 * b * s * itemsize)]
    return sorted(calls + loss)


# OPT on dp=2 x tp=2 is refused (its positions come from a mask it builds at the whole batch's size,
# which the compiler does not slice over dp): that is not the embedding's doing
MESHES = [("gemma", "tp=2"), ("gemma", "dp=2,tp=2"), ("phi3", "tp=2"), ("phi3", "dp=2,tp=2"), ("opt", "tp=2")]


@pytest.mark.parametrize("name, mesh", MESHES)
def test_megatron_pattern_with_padding_rows_and_unequal_fused_parts(name, mesh):
    plan = _compiled(name, mesh).plan
    dp = ml.Mesh.parse(mesh).axis_size("dp") if "dp" in mesh else 1
    assert _on_tp(plan) == _megatron(dp)  # exact counts and bytes: no gather of a weight or an activation
    total = sum(nbytes for _, _, nbytes in _megatron(dp))  # 2 layers: 161.5 KiB on tp=2, 80.75 KiB on dp=2 x tp=2
    assert sum(c.total_bytes for c in plan.collectives if c.axes == ("tp",)) == total == 165376 // dp
    forward_dp = [c for c in plan.collectives if "dp" in c.axes and c.phase == "forward"]
    assert {c.kind for c in forward_dp} <= {"all_reduce"} and all(c.bytes <= 8 for c in forward_dp)  # loss scalars
    assert "ops run whole on every rank (no rule)" not in plan.note_map


@pytest.mark.parametrize("name", ["gqa-sliced", "gqa-split"])
def test_a_fused_qkv_of_unequal_parts_cut_in_the_model_written_for_torch_fx(name):
    """The same cut written by hand and traced by torch.fx (the slices are `getitem`s there) or as a
    `split` into the three sizes; the fused bias is split in the same parts."""
    compiled = _compiled(name, "tp=2")
    assert compiled.plan.note_map["trace"] == "fx"
    assert _on_tp(compiled.plan) == _megatron(1, itemsize=8)
    placements = dict(compiled.plan.placements)
    assert placements["h.0.attn.c_attn.weight"] == placements["h.0.attn.c_attn.bias"] == ("S(0/2:1:1)",)


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["gqa-sliced", "gqa-split"])
@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_a_fused_qkv_of_unequal_parts_trains_as_the_single_process(name, mesh):
    """fp64, to 1e-12: the parts' local bounds, the bias's blocks and the weight's rank order are exact."""
    build, rules, batch, loss = rm.MODELS[name]
    trial = Trial(build, batch, mesh=mesh, rules=rules, loss=loss, lr=1e-3)
    assert_same(
        run_single(trial), get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)[0], rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("name", ["gemma", "phi3"])
def test_sequence_parallel_pattern(name):
    """Each all-reduce becomes a reduce-scatter and an all-gather of b*s*h; each value gathered in forward
    is kept as its shard and gathered again in backward, as Megatron does; the norms' weights (whole on
    every tp rank) sum their gradients over tp (h fp32 values each, 2 per layer and the final norm)."""
    build, rules, batch, loss = rm.MODELS[name]
    m = ml.Mesh.parse("tp=2")
    plan = compile_model(
        build(), mesh=m, rules=rules(m), example_inputs=batch(0), loss=loss, sequence_parallel=True
    ).plan
    bsh, bs = rm.BATCH * rm.SEQ * HIDDEN * FP32, rm.BATCH * rm.SEQ * FP32
    each_way = [("reduce_scatter", bsh)] * (2 * LAYERS + 1) + [("all_gather", bsh)] * (2 * LAYERS + 1)
    want = [("forward", k, b) for k, b in each_way] + [("backward", k, b) for k, b in each_way]
    want += [("backward", "all_gather", bsh)] * (2 * LAYERS + 1)
    want += [("forward", "all_reduce", bs), ("forward", "all_reduce", 2 * bs)]
    want += [("backward", "all_reduce", HIDDEN * FP32)] * (2 * LAYERS + 1)
    assert _on_tp(plan) == sorted(want)


def test_the_padding_row_is_looked_up_by_the_rank_that_holds_it():
    """The vocab-parallel embedding is chosen with a padding row; the plan's op knows which row it is."""
    for name, pad in (("gemma", 0), ("phi3", rm.PHI3_PAD), ("opt", 1)):
        compiled = _compiled(name, "tp=2")
        embeddings = [s.args for s in compiled.specials if s.kind == "vocab_embedding"]
        assert embeddings == [{"axis": "tp", "vocab": rm.VOCAB, "ways": 2, "padding_idx": pad}], name
        assert dict(compiled.plan.placements)[_embedding_name(name)] == ("S(0)",)


def _embedding_name(name: str) -> str:
    return "model.decoder.embed_tokens.weight" if name == "opt" else "model.embed_tokens.weight"


def test_phi3_fused_projections_are_split_part_by_part():
    """qkv_proj (q 32 rows, k and v 16 each) in parts 2:1:1, gate_up_proj in 2 equal halves: each rank
    holds whole heads of q, k and v and half of gate and of up; o_proj and down_proj row-parallel."""
    plan = _compiled("phi3", "tp=2").plan
    placements = dict(plan.placements)
    assert placements["model.layers.0.self_attn.qkv_proj.weight"] == ("S(0/2:1:1)",)
    assert plan.note_map["parameters in rank order"].startswith(
        "model.layers.0.self_attn.qkv_proj.weight, model.layers.1.self_attn.qkv_proj.weight: DTensor has no placement"
    )
    assert placements["model.layers.0.mlp.gate_up_proj.weight"] == ("S(0/2)",)
    assert placements["model.layers.0.self_attn.o_proj.weight"] == ("S(1)",)
    assert placements["model.layers.0.mlp.down_proj.weight"] == ("S(1)",)


# -- the vocab-parallel embedding's padding row, on simulated ranks -------------------------------
@pytest.mark.parametrize("vocab, ways", [(12, 2), (12, 3), (10, 4)])  # 10 over 4: torch.chunk's 3, 3, 3, 1
@pytest.mark.parametrize("pad", [None, 0, 4, 9, -1, -3])
def test_vocab_parallel_embedding_zeroes_only_the_padding_rows_gradient(vocab, ways, pad):
    gen = torch.Generator().manual_seed(vocab * 10 + ways)
    weight = torch.randn(vocab, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, vocab, (4, 7), generator=gen)
    ids[:, -1] = vocab - 1 if pad is not None and pad < 0 else 0  # the padding row is looked up
    grad_out = torch.randn(4, 7, 5, generator=gen, dtype=torch.float64)
    want = F.embedding(ids, weight, padding_idx=pad)
    (want * grad_out).sum().backward()
    row = None if pad is None else pad % vocab
    total, grads = torch.zeros_like(want), []
    for rank in range(ways):
        start, rows = chunk_rows(vocab, ways, rank)
        piece = weight.detach()[start : start + rows].clone().requires_grad_()
        out = VocabEmbedding(vocab=vocab, ways=ways, rank=rank, padding_idx=row)(ids, piece)
        (out * grad_out).sum().backward()
        total, grads = total + out.detach(), grads + [piece.grad]
    torch.testing.assert_close(total, want.detach(), rtol=0, atol=0)  # the partial sums add up to the lookup
    torch.testing.assert_close(torch.cat(grads), weight.grad, rtol=0, atol=0)
    if row is not None:
        assert torch.count_nonzero(weight.grad[row]) == 0


def test_padding_idx_is_read_as_torch_reads_it():
    """F.embedding counts a negative padding_idx from the end; ATen's embedding takes -1 for none."""
    from meshlib_torch.compiler.placement.bind import aten

    class View:
        def __init__(self, pad, target):
            self.p = {"padding_idx": pad, "_target": target}

    assert padding_row(View(None, F.embedding), 96) is None
    assert padding_row(View(-1, F.embedding), 96) == 95
    assert padding_row(View(-3, F.embedding), 96) == 93
    assert padding_row(View(5, F.embedding), 96) == 5
    assert padding_row(View(-1, aten.embedding.default), 96) is None
    assert padding_row(View(0, aten.embedding.default), 96) == 0


# -- parity with the unmodified model -------------------------------------------------------------
_RESULTS: dict = {}


def _trial(name: str, mesh: str = "dp=2,tp=2") -> Trial:
    build, rules, batch, loss = rm.MODELS[name]
    return Trial(build, batch, mesh=mesh, rules=rules, loss=loss, lr=1e-3)


def _run(name: str):
    if name not in _RESULTS:
        trial = _trial(name)
        _RESULTS[name] = run_single(trial), get_pool(4).run(run_parallel, trial)
    return _RESULTS[name]


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["gemma", "phi3"])
def test_parity_with_the_unmodified_model(name):
    ref, results = _run(name)
    assert_same(ref, results[0], rtol=1e-5, atol=1e-5)
    assert all(r.losses == results[0].losses for r in results)
    planned: dict = {}
    for c in results[0].plan.collectives:  # what each rank counted at the collective layer is the plan
        key = (c.phase, c.kind, c.axes[0])
        planned[key] = planned.get(key, 0) + c.total_bytes
    assert results[0].comm["by_kind"] == planned


@pytest.mark.ranks
@pytest.mark.parametrize(
    "mesh, options",
    [("dp=2,tp=2", {"zero": 3}), ("dp=2,tp=2", {"sequence_parallel": True}), ("pp=2,tp=2", {"microbatches": 2})],
    ids=["zero3", "sp", "pp2tp2"],
)
def test_phi3_in_parts_under_fsdp_sequence_parallelism_and_a_pipeline(mesh, options):
    """FSDP2 nests its shard in the parts' rank order, sequence parallelism and pipeline stages keep them."""
    trial = _trial("phi3", mesh)
    trial = Trial(trial.build, trial.batch, mesh=mesh, rules=trial.rules, loss=trial.loss, options=options, lr=1e-3)
    assert_same(_run("phi3")[0], get_pool(4).run(run_parallel, trial)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.ranks
def test_the_padding_rows_gradient_is_zero_on_the_mesh_as_in_the_single_process():
    """Phi-3's embedding is not tied to its head: its padding row (held by tp rank 1) gets no gradient,
    while the rows of the other ids looked up do."""
    ref, results = _run("phi3")
    ids = rm.phi3_batch(0)["input_ids"]
    assert (ids == rm.PHI3_PAD).any()
    for trace in (ref, results[0]):
        grad = trace.grads["model.embed_tokens.weight"]
        assert torch.count_nonzero(grad[rm.PHI3_PAD]) == 0
        others = ids.unique()
        others = others[others != rm.PHI3_PAD]
        assert bool((grad[others].abs().sum(-1) > 0).all())


# -- checkpoints and export of a model held in unequal parts ---------------------------------------
def _phi3(mesh: str, **options):
    from meshlib_torch import parallelize

    m = ml.Mesh.parse(mesh)
    model = rm.build_phi3() if "weights" not in options else _meta_phi3()
    par = parallelize(model, mesh=m, rules=rm.rules_phi3(m), example_inputs=rm.phi3_batch(0), **options)
    return par, par.optimizer(lr=1e-3)


def _meta_phi3():
    with torch.device("meta"):
        return rm.build_phi3()


def _state(par, opt) -> dict[str, torch.Tensor]:
    """Every parameter, full-precision value and AdamW moment, whole in the model's order (`Parallel.whole`)."""
    out = {}
    for name, p in par.named_model_parameters().items():
        target = opt.master.get(name, p)
        out[f"param {name}"] = par.whole(name, p).detach().clone()
        out[f"value {name}"] = par.whole(name, target).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key} {name}"] = par.whole(name, opt.inner.state[target][key]).detach().clone()
    return out


def _save_phi3(mesh: str, path: str, export_to: str | None, options: dict):
    """2 steps, a checkpoint (and an export), 2 more steps: the state saved, the evaluated loss, all losses."""
    from meshlib_torch import checkpoint, export

    par, opt = _phi3(mesh, **options)
    losses = [par.train_step(rm.phi3_batch(s), opt) for s in range(2)]
    checkpoint.save(path, par, opt, step=2)
    if export_to:
        export(par, export_to, config=rm.build_phi3().config, max_shard_size=40_000)
    state, held = _state(par, opt), par.evaluate(rm.phi3_batch(7))
    losses += [par.train_step(rm.phi3_batch(s), opt) for s in range(2, 4)]
    return state, held, losses


def _resume_phi3(mesh: str, path: str, options: dict):
    from meshlib_torch import checkpoint

    par, opt = _phi3(mesh, **options)
    assert checkpoint.load(path, par, opt)["step"] == 2
    state = _state(par, opt)
    return state, [par.train_step(rm.phi3_batch(s), opt) for s in range(2, 4)]


def _weights_phi3(mesh: str, path: str) -> float:
    par, _ = _phi3(mesh, weights=path)
    return par.evaluate(rm.phi3_batch(7))


@pytest.mark.ranks
@pytest.mark.parametrize(
    "saver, saver_options, loader, loader_options",
    [("dp=2,tp=2", {}, "dp=4", {}), ("dp=4", {}, "dp=2,tp=2", {"zero": 1})],
    ids=["from-parts", "into-parts-zero1"],
)
def test_a_checkpoint_in_unequal_parts_reloads_on_another_mesh(tmp_path, saver, saver_options, loader, loader_options):
    """Saved with qkv_proj in parts 2:1:1 over tp and loaded with it whole (dp=4), and the other way round
    (into ZeRO-1's masters): every parameter, value and moment equals the saver's bitwise, and the next
    two steps' losses are the saver's own (the checkpoint also serves as `weights=` on tp=2)."""
    path = str(tmp_path / "ckpt")
    state, held, losses = get_pool(4).run(_save_phi3, saver, path, None, saver_options)[0]
    resumed = get_pool(4).run(_resume_phi3, loader, path, loader_options)
    for got, more in resumed:
        assert sorted(got) == sorted(state)
        for key, value in state.items():
            assert torch.equal(got[key], value), key
        torch.testing.assert_close(torch.tensor(more), torch.tensor(losses[2:]), rtol=1e-5, atol=1e-5)
    assert get_pool(2).run(_weights_phi3, "tp=2", path)[0] == pytest.approx(held, rel=1e-6, abs=1e-6)


@pytest.mark.ranks
def test_phi3_held_in_parts_exports_what_from_pretrained_reads(tmp_path):
    """Exported from dp=2 x tp=2 (qkv_proj in parts over tp): transformers reads every tensor as trained,
    in the model's own row order, and computes meshlib's loss."""
    out = str(tmp_path / "exported")
    state, held, _ = get_pool(4).run(_save_phi3, "dp=2,tp=2", str(tmp_path / "ckpt"), out, {})[0]
    reloaded = rm._quiet_transformers().Phi3ForCausalLM.from_pretrained(out)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), state[f"param {name}"]), name
    with torch.no_grad():
        assert float(reloaded(**rm.phi3_batch(7)).loss) == pytest.approx(held, rel=1e-5, abs=1e-5)


def _phi3_from(path: str) -> float:
    par, _ = _phi3("dp=2,tp=2", weights=path)
    return par.evaluate(rm.phi3_batch(7))


@pytest.mark.ranks
def test_phi3_reads_a_hugging_face_checkpoint_into_its_parts(tmp_path):
    """save_pretrained's safetensors read into qkv_proj's parts (each rank its rows of q, of k and of v,
    one read per run of rows): the loss is the unmodified model's."""
    model = rm.build_phi3()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    with torch.no_grad():
        want = float(model(**rm.phi3_batch(7)).loss)
    assert get_pool(4).run(_phi3_from, str(tmp_path))[0] == pytest.approx(want, rel=1e-6, abs=1e-6)
