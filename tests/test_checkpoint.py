"""DCP checkpoints: reload on another mesh and zero level, and refuse bad checkpoints cleanly.

Method: a run on 4 gloo ranks trains 2 steps and saves; a fresh run on
another mesh or zero level loads. Right after the load, the full parameters,
the full-precision values (fp32 masters where kept), AdamW's moments and
steps, and every rank's CPU RNG state must equal the saver's bitwise. It then
trains 2 more steps, whose losses must equal steps 3 and 4 of the saver's
own run, which carries on after saving as if uninterrupted (fp64 to 1e-12, the
parity contract; bf16 to its parity tolerance, as the meshes reduce in another
order); once, that run is also checked against `train_parallel`'s 4 steps.
Loading into a run that trained on must roll it back bitwise. Bad
checkpoints (missing, corrupt, truncated, of another model, of other shapes)
must raise the same clear error on every rank and leave the parameters,
optimizer state and RNG exactly as they were.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from meshlib import Mesh, Precision
from meshlib_torch import data, models, parallelize
from meshlib_torch.runtime import checkpoint
from meshlib_torch.testing.parity import TOLERANCE, RunConfig, _init, train_parallel
from meshlib_torch.testing.pool import get_pool

pytestmark = pytest.mark.ranks


# -- jobs (run on every rank) ----------------------------------------------------------------
def _setup(run: RunConfig):
    cfg = models.config(run.model, **run.overrides)
    mesh = Mesh.parse(run.mesh)
    par = parallelize(
        models.build(cfg, dtype=run.torch_dtype), mesh=mesh, rules=models.default_rules(cfg, mesh),
        example_inputs=_batch(run, 0), init=_init(cfg), seed=run.seed, zero=run.zero,
        precision=Precision.parse(run.precision) if run.precision else None, microbatches=run.microbatches,
        schedule=run.schedule, uneven=run.uneven,
    )  # fmt: skip
    return par, par.optimizer(lr=run.lr, betas=(0.9, 0.95), weight_decay=0.1)


def _batch(run: RunConfig, step: int) -> tuple:
    return data.batch(step, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)


def _train(par, opt, run: RunConfig, steps: range) -> list[float]:
    return [par.train_step(_batch(run, s), opt) for s in steps]


def _full_state(par, opt) -> dict[str, torch.Tensor]:
    """Every parameter, full-precision value, moment and step count, whole, by parameter FQN (from every
    rank: pipeline ranks hold different stages)."""
    whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()  # noqa: E731
    out = {}
    for name, p in par.named_model_parameters().items():
        out[f"param {name}"] = whole(p)
        master = opt.master.get(name)
        target = master if master is not None else p
        out[f"value {name}"] = whole(target)
        for key, v in opt.inner.state.get(target, {}).items():
            out[f"{key} {name}"] = whole(v)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, out)
    return {k: v for part in everyone for k, v in part.items()}


def _save_job(run: RunConfig, path: str, steps: int, more: int):
    """Train, save, and train on: the uninterrupted run, beside the checkpoint."""
    par, opt = _setup(run)
    losses = _train(par, opt, run, range(steps))
    torch.manual_seed(1000 + torch.distributed.get_rank())  # a different RNG state on every rank
    rng = torch.get_rng_state()
    checkpoint.save(path, par, opt, step=steps, extra={"data_position": steps * run.batch_size})
    state = _full_state(par, opt)
    return state, rng, losses + _train(par, opt, run, range(steps, steps + more))


def _resume_job(run: RunConfig, path: str, more: int):
    par, opt = _setup(run)
    info = checkpoint.load(path, par, opt)
    state, rng = _full_state(par, opt), torch.get_rng_state()
    losses = _train(par, opt, run, range(info["step"], info["step"] + more))
    return info, state, rng, losses


def _save_then_resume(tmp_path, saver: RunConfig, loader: RunConfig):
    """Save after 2 steps, resume for 2: state bitwise, losses as the saver's own steps 3 and 4."""
    path = str(tmp_path / "ckpt")
    saved = get_pool(Mesh.parse(saver.mesh).size).run(_save_job, saver, path, 2, 2)
    resumed = get_pool(Mesh.parse(loader.mesh).size).run(_resume_job, loader, path, 2)
    want, _, straight = saved[0]
    for rank, (info, got, rng, _) in enumerate(resumed):
        assert info == {"step": 2, "extra": {"data_position": 2 * saver.batch_size}}
        assert torch.equal(rng, saved[rank % len(saved)][1]), f"rank {rank}: RNG state not restored"
        common = {k for k in got if k.split()[0] in ("param", "value", "exp_avg", "exp_avg_sq", "step")}
        assert set(got) == set(want) == common
        for key in sorted(common):
            a, b = got[key], want[key]
            if key.startswith("param") and a.dtype != b.dtype:  # bf16 parameters beside fp32 FSDP shards
                low = min(a.dtype, b.dtype, key=lambda t: t.itemsize)
                a, b = a.to(low), b.to(low)
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: {key} differs after loading"
    rtol, atol = TOLERANCE[loader.tolerance]
    torch.testing.assert_close(torch.tensor(resumed[0][3]), torch.tensor(straight[2:]), rtol=rtol, atol=atol)
    return straight


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{"steps": 2, **kw})


# -- resharding ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_saved_on_dp4_loads_on_dp2_tp2(tmp_path, model):
    saver = _cfg(model=model, mesh="dp=4")
    straight = _save_then_resume(tmp_path, saver, _cfg(model=model, mesh="dp=2,tp=2"))
    if model == "gpt-tiny":  # saving changed nothing: the saver's own run is the uninterrupted one
        assert straight == get_pool(4).run(train_parallel, RunConfig(**{**saver.__dict__, "steps": 4}))[0].losses


# llama-tiny: gpt-tiny in bf16 fails at zero=3 with tp even without checkpoints (its fused qkv bias stays fp32)
_BF16 = dict(model="llama-tiny", dtype="float32", precision="bf16", lr=1e-3)


@pytest.mark.parametrize(
    "saver, loader",
    [
        (dict(mesh="dp=4", zero=0), dict(mesh="dp=2,tp=2", zero=3)),
        (dict(mesh="dp=2,tp=2", zero=1), dict(mesh="dp=4", zero=0)),
        (dict(mesh="dp=4", zero=1, **_BF16), dict(mesh="dp=2,tp=2", zero=3, **_BF16)),
        (dict(mesh="dp=2,tp=2", zero=3, **_BF16), dict(mesh="dp=4", zero=1, **_BF16)),
        (dict(mesh="dp=3", zero=1, batch_size=6, **_BF16), dict(mesh="dp=2,tp=2", zero=1, batch_size=6, **_BF16)),
        (dict(mesh="dp=2,tp=3", zero=1, uneven="chunk"), dict(mesh="dp=2,tp=2", zero=3)),
        (dict(mesh="dp=2,tp=2", zero=0), dict(mesh="dp=2,tp=3", zero=3, uneven="chunk")),
    ],
    ids=["z0-dp4_to_z3-dp2tp2", "z1-dp2tp2_to_z0-dp4", "bf16-z1-dp4_to_z3-dp2tp2", "bf16-z3-dp2tp2_to_z1-dp4",
         "bf16-z1-dp3-uneven_to_z1-dp2tp2", "z1-dp2tp3-chunk_to_z3-dp2tp2", "z0-dp2tp2_to_z3-dp2tp3-chunk"],
)
def test_across_zero_levels(tmp_path, saver, loader):
    """ZeRO-1 masters and moments are strided shards inside tp's; ZeRO-3's are FSDP2's; bf16 runs keep fp32 masters."""
    _save_then_resume(tmp_path, _cfg(**{"model": "gpt-tiny", **saver}), _cfg(**{"model": "gpt-tiny", **loader}))


def _rollback_job(run: RunConfig, path: str):
    par, opt = _setup(run)
    _train(par, opt, run, range(2))
    checkpoint.save(path, par, opt, step=2)
    first = _train(par, opt, run, range(2, 4))
    checkpoint.load(path, par, opt)  # into live FSDP2 shards and AdamW state
    return first, _train(par, opt, run, range(2, 4))


def test_loading_into_a_run_that_trained_on_rolls_it_back(tmp_path):
    """ZeRO-2 keeps FSDP2's unsharded parameters between forward and backward: the load must reach the shards."""
    first, again = get_pool(4).run(_rollback_job, _cfg(mesh="dp=2,tp=2", zero=2), str(tmp_path / "ckpt"))[0]
    assert first == again


# -- bad checkpoints ---------------------------------------------------------------------------
def _save_sources(root: str) -> str:
    """Checkpoints to load: fresh (before the first step), good (after one step, saved over
    the fresh one), of another model and of other shapes. Returns what saving over a
    directory that is not a checkpoint raises."""
    run = _cfg(model="gpt-tiny", mesh="dp=4")
    par, opt = _setup(run)
    checkpoint.save(os.path.join(root, "fresh"), par, opt, step=0)
    checkpoint.save(os.path.join(root, "good"), par, opt, step=0)
    _train(par, opt, run, range(1))
    checkpoint.save(os.path.join(root, "good"), par, opt, step=1)
    try:
        checkpoint.save(root, par, opt, step=1)
        refused = ""
    except FileExistsError as exc:
        refused = str(exc)
    for name, run in [
        ("other_model", _cfg(model="llama-tiny", mesh="dp=4")),
        ("other_shapes", _cfg(model="gpt-tiny", mesh="dp=4", overrides={"block_size": 32})),
    ]:
        par, opt = _setup(run)
        checkpoint.save(os.path.join(root, name), par, opt, step=0)
    return refused


def _try_bad_loads(run: RunConfig, root: str, cases: list[str]):
    """Every rank: the error each bad case raises, whether the run is unchanged, then a good load."""
    par, opt = _setup(run)
    _train(par, opt, run, range(2))
    before, rng = _full_state(par, opt), torch.get_rng_state()
    errors = {}
    for case in cases:
        try:
            checkpoint.load(os.path.join(root, case), par, opt)
            errors[case] = None
        except (ValueError, FileNotFoundError) as exc:
            errors[case] = (type(exc).__name__, str(exc))
    after = _full_state(par, opt)
    changed = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))
    changed += ["rng"] if not torch.equal(rng, torch.get_rng_state()) else []
    good = checkpoint.load(os.path.join(root, "good"), par, opt)  # the ranks are still in step
    fresh = checkpoint.load(os.path.join(root, "fresh"), par, opt)  # saved before AdamW had state
    empty = len(opt.inner.state) == 0
    _train(par, opt, run, range(1))
    return errors, changed, (good["step"], fresh["step"], empty)


def test_bad_checkpoints_raise_on_every_rank_and_change_nothing(tmp_path):
    root = str(tmp_path)
    refused = get_pool(4).run(_save_sources, root)
    assert all("exists and is not a checkpoint" in r for r in refused), refused
    assert not any(name.endswith((".saving", ".old")) for name in os.listdir(root))
    good = os.path.join(root, "good")
    data_file = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))[1]
    for case in ("corrupt", "truncated", "bad_metadata"):
        shutil.copytree(good, os.path.join(root, case))
    with open(os.path.join(root, "corrupt", data_file), "r+b") as f:  # garbage, same length
        f.write(os.urandom(os.path.getsize(f.name)))
    os.truncate(os.path.join(root, "truncated", data_file), os.path.getsize(os.path.join(good, data_file)) // 2)
    with open(os.path.join(root, "bad_metadata", ".metadata"), "wb") as f:
        f.write(b"not a pickle")

    cases = ["missing", "bad_metadata", "corrupt", "truncated", "other_model", "other_shapes"]
    results = get_pool(4).run(_try_bad_loads, _cfg(model="gpt-tiny", mesh="dp=2,tp=2"), root, cases)
    errors = results[0][0]
    for rank, (errs, changed, good) in enumerate(results):
        assert errs == errors, f"rank {rank} raised other errors than rank 0"
        assert changed == [], f"rank {rank}: a failed load changed {changed}"
        assert good == (1, 0, True)  # the later save replaced the earlier; a fresh one empties AdamW

    gpt = {n for n, _ in models.build("gpt-tiny").named_parameters()}
    llama = {n for n, _ in models.build("llama-tiny").named_parameters()}
    want = {
        "missing": ("FileNotFoundError", ["does not exist"]),
        "bad_metadata": ("ValueError", ["unreadable .metadata"]),
        "corrupt": ("ValueError", ["could not be read", "nothing was loaded"]),
        "truncated": ("ValueError", ["truncated", data_file]),
        "other_model": ("ValueError", ["another model", f"missing parameters {sorted(gpt - llama)[0]}",
                                       f"unexpected parameters {sorted(llama - gpt)[0]}"]),
        "other_shapes": ("ValueError", ["model.wpe.weight saved (32, 32), this run (64, 32)"]),
    }  # fmt: skip
    for case, (kind, parts) in want.items():
        assert errors[case] is not None, f"{case}: no error"
        assert errors[case][0] == kind, f"{case}: {errors[case]}"
        for part in parts:
            assert part in errors[case][1], f"{case}: {part!r} not in {errors[case][1]!r}"


# -- pipeline meshes -----------------------------------------------------------------------------
_PP = dict(model="llama-tiny", microbatches=2, schedule="1f1b", batch_size=8)


@pytest.mark.parametrize(
    "saver, loader",
    [
        (dict(mesh="dp=2,pp=2", zero=0), dict(mesh="dp=2,pp=2", zero=0)),
        (dict(mesh="dp=2,pp=2", zero=1), dict(mesh="dp=2,tp=2", zero=3)),
        (dict(mesh="dp=2,tp=2", zero=1), dict(mesh="pp=2,tp=2", zero=0)),
        (dict(mesh="pp=2,tp=2", zero=0), dict(mesh="dp=2,pp=2", zero=1)),
        (dict(mesh="dp=2,tp=2", zero=2), dict(mesh="dp=2,pp=2", zero=0)),
        (dict(mesh="dp=2,pp=2", zero=3), dict(mesh="dp=2,tp=2", zero=2)),
        (dict(mesh="dp=2,pp=2", zero=1, model="gpt-tiny"), dict(mesh="dp=2,tp=2", zero=1, model="gpt-tiny")),
    ],
    ids=["z0-dp2pp2_same", "z1-dp2pp2_to_z3-dp2tp2", "z1-dp2tp2_to_z0-pp2tp2", "z0-pp2tp2_to_z1-dp2pp2",
         "z2-dp2tp2_to_z0-dp2pp2", "z3-dp2pp2_to_z2-dp2tp2", "tied-gpt-z1-dp2pp2_to_dp2tp2"],
)
def test_pipeline_meshes_save_and_resume(tmp_path, saver, loader):
    """A pipeline rank holds only its stages' parameters and optimizer state; the checkpoint holds the
    whole model, and resuming on any mesh takes the saver's next losses (fp64, 1e-12)."""
    _save_then_resume(tmp_path, _cfg(**{**_PP, **saver}), _cfg(**{**_PP, **loader}))


# -- expert parallelism ----------------------------------------------------------------------------
@pytest.mark.parametrize("loader, zero", [("dp=4", 1), ("ep=4", 1), ("ep=4", 3), ("dp=4", 0)])
def test_expert_parallel_checkpoints_reshard_between_ep_sizes(tmp_path, loader, zero):
    """moe-tiny-ds (sigmoid routing with a balancing bias, a shared expert): saved on dp=2×ep=2 with ZeRO-1,
    where each rank holds 4 of the 8 experts and half their optimizer state (the rest's quarter), resumed with
    no ep (every rank all 8, a quarter of the state) and on ep=4 (2 each, whole: no data rank is left to
    spread them over), under ZeRO-1, ZeRO-3 and ZeRO-0."""
    saver = _cfg(model="moe-tiny-ds", mesh="dp=2,ep=2", seq_len=8, zero=1)
    _save_then_resume(tmp_path, saver, _cfg(model="moe-tiny-ds", mesh=loader, seq_len=8, zero=zero))
