"""ZeRO-1's reduce-scatters and all-gathers in buckets: the ranks issue exactly the plan's collectives, one
per bucket, in order and bytes (padding included), fewer than the parameters they move; and training
equals the single process's. Buckets are shrunk so that tiny models fill several.

References: the plan's records (`estimates.records.dp_collectives`), and the unsharded run (the parity
harness).
"""

import pytest
from test_grad_buckets import _patched, _restore, _train

from meshlib import Mesh
from meshlib_torch.testing.parity import RunConfig, compare, train_reference
from meshlib_torch.testing.pool import get_pool


def _one_step(run: RunConfig, first: int, cap: int):
    """One step on the ranks: ZeRO-1's collectives as issued, the plan's, and how many parameters ZeRO-1
    splits on this rank."""
    from meshlib_torch.runtime.comm import CommCounter
    from meshlib_torch.testing.parity import batch_of, build_parallel

    saved = _patched(first, cap)
    try:
        par = build_parallel(run)
        opt = par.optimizer(lr=1e-3)
        issued = []

        class Log(CommCounter):
            def record(self, phase, kind, axis, nbytes, where):
                if where == "zero-1":
                    issued.append((phase, kind, axis, nbytes))

        opt.buckets.counter = Log()
        par(*batch_of(run, 0)).backward()
        opt.step()
        planned = [(c.phase, c.kind, "_".join(c.axes), c.bytes) for c in par.plan.collectives
                   if c.reason.startswith("zero-1")]  # fmt: skip
        return issued, planned, len(opt.buckets.shapes)
    finally:
        _restore(saved)


CASES = [
    RunConfig(model="llama-tiny", mesh="dp=3", zero=1, batch_size=6),  # no dim divides by 3: padded pieces
    RunConfig(model="llama-tiny", mesh="dp=2,tp=2", zero=1, dtype="float32", precision="bf16", lr=1e-3),
    RunConfig(model="moe-tiny", mesh="dp=2,ep=2", zero=1, seq_len=8),
]


@pytest.mark.ranks
@pytest.mark.parametrize("run", CASES, ids=lambda r: f"{r.model}-{r.mesh}-{r.precision or r.dtype}")
def test_the_ranks_move_the_plans_buckets(run):
    """Buckets of 4 KiB, the first 1 KiB: one reduce-scatter and one all-gather per planned bucket, in the
    plan's order and bytes, at least 3 of each and fewer than the parameters split; three AdamW steps
    equal the single process's. With experts, their weights (sharded over dp alone) bucket apart."""
    pool = get_pool(Mesh.parse(run.mesh).size)
    for issued, planned, split in pool.run(_one_step, run, 1024, 4096):
        assert sorted(issued) == sorted(planned)
        scatters = [x for x in issued if x[1] == "reduce_scatter"]
        assert issued == scatters + [x for x in issued if x[1] == "all_gather"]  # every sum before the update
        assert [x for x in planned if x[1] == "reduce_scatter"] == scatters
        assert 3 <= len(scatters) < split
    if "ep" in run.mesh:
        assert {axis for _, _, axis, _ in planned} == {"dp", "dp_ep"}
    compare(train_reference(run), pool.run(_train, run, 1024, 4096)[0], run.tolerance)


def _step_extra(run: RunConfig) -> int:
    """Bytes the optimizer step adds, at its peak, above the model state and the gradients (`PeakTracker`)."""
    import torch

    from meshlib_torch import PeakTracker
    from meshlib_torch.testing.parity import batch_of, build_parallel

    par = build_parallel(run)
    opt = par.optimizer(lr=1e-3)
    par(*batch_of(run, 0)).backward()
    opt.step()  # the moments exist from here on
    opt.zero_grad()
    par(*batch_of(run, 1)).backward()
    state = list(par.parameters()) + list(par.buffers()) + list(opt.master.values())
    state += [t for s in opt.inner.state.values() for t in s.values() if torch.is_tensor(t)]
    state += [p.grad for p in par.parameters() if p.grad is not None]
    pieces = list((opt.buckets.landed or {}).values())  # reduce-scattered behind backward: held into the step
    assert len(pieces) == len(opt.buckets.shapes)
    with PeakTracker() as tracker:
        tracker.baseline(state)
        base = tracker.live
        tracker.baseline(pieces)
        del state, pieces  # the tracker sees a gradient freed once nothing holds it
        opt.step()
    return tracker.peak - base


STEP_CASES = [
    RunConfig(model="llama-tiny", mesh="dp=2", zero=1, dtype="float32"),
    RunConfig(model="llama-tiny", mesh="dp=2,tp=2", zero=1, dtype="float32", precision="bf16"),
    RunConfig(model="llama-tiny", mesh="dp=3", zero=1, dtype="float32", precision="bf16", batch_size=6),
]


@pytest.mark.ranks
@pytest.mark.parametrize("run", STEP_CASES, ids=lambda r: f"{r.mesh}-{r.precision or r.dtype}")
def test_the_plan_holds_what_the_step_holds(run):
    """The optimizer step's peak above the model state and the gradients, measured on every rank, is the dry
    run's (`stepmem.step_extra`): the buckets' inputs and outputs, each parameter's gradient freed once its
    bucket holds it, the update's temporaries, the gathers. Buckets of 4 KiB, the first 1 KiB."""
    from meshlib import Precision
    from meshlib_torch import compile_model, models
    from meshlib_torch.compiler.estimates.stepmem import step_extra
    from meshlib_torch.testing.parity import batch_of

    saved = _patched(1024, 4096)
    try:
        cfg, mesh = models.config(run.model), Mesh.parse(run.mesh)
        compiled = compile_model(
            models.build(cfg), mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=batch_of(run, 0),
            zero=1, precision=Precision.parse(run.precision) if run.precision else None,
        )  # fmt: skip
        planned = step_extra(compiled)
    finally:
        _restore(saved)
    measured = get_pool(mesh.size).run(_step_extra_small, run)
    assert max(measured) == pytest.approx(max(planned, 0), rel=0.02), (measured, planned)


def _step_extra_small(run: RunConfig) -> int:
    saved = _patched(1024, 4096)
    try:
        return _step_extra(run)
    finally:
        _restore(saved)


def _ways(run: RunConfig) -> dict:
    """One update of fresh copies of `run`'s model, its gradients summed in different ways: per way, the
    reduce-scatters issued by the time backward returned and in the step (by phase), and the parameters
    after it."""
    import torch

    from meshlib_torch.runtime.comm import CommCounter
    from meshlib_torch.testing.parity import batch_of, build_parallel

    def way(sync: bool, backwards: int = 1, clip: bool = False, raised: bool = False, frozen: bool = False):
        par = build_parallel(run)
        if frozen:  # fine-tuning with a layer frozen: its parameters get no gradient, their buckets still run
            for name, p in par.named_model_parameters().items():
                p.requires_grad_(not name.startswith("layers.0."))
        opt = par.optimizer(lr=1e-2)
        if raised:  # a backward that raises on the gradient backward makes last, after buckets have started
            first = next(iter(par.named_model_parameters().values()))
            handle = first.register_hook(lambda g: (_ for _ in ()).throw(ValueError("stop")))
            with pytest.raises(ValueError, match="stop"):
                par(*batch_of(run, 1)).backward()
            handle.remove()
            opt.zero_grad()
        issued = []

        class Log(CommCounter):
            def record(self, phase, kind, axis, nbytes, where):
                if where == "zero-1" and kind == "reduce_scatter":
                    issued.append(phase)

        opt.buckets.counter = Log()
        par.set_gradient_sync(sync)
        for i in range(backwards):
            par(*batch_of(run, i)).backward()
        in_backward, landed = list(issued), len(opt.buckets.landed or {})
        par.set_gradient_sync(True)
        if clip:  # torch's own clipping, on every parameter's (Partial) gradient, in place
            torch.nn.utils.clip_grad_norm_(list(par.parameters()), 1e-3)
        opt.step()
        after = {n: p.detach().full_tensor().clone() for n, p in par.named_model_parameters().items()}
        return {"backward": in_backward, "step": issued[len(in_backward) :], "landed": landed,
                "buckets": len(opt.buckets.buckets), "split": len(opt.buckets.shapes), "params": after}  # fmt: skip

    saved = _patched(1024, 4096)  # several buckets: some have started when the raising backward stops
    try:
        return {
            "overlap": way(True), "in_step": way(False), "clip": way(True, clip=True),
            "clip_in_step": way(False, clip=True), "accumulate": way(True, backwards=2),
            "init": {n: p.detach().full_tensor().clone() for n, p in build_parallel(run).named_model_parameters().items()},
            "accumulate_in_step": way(False, backwards=2), "after_a_raise": way(True, raised=True),
            "frozen": way(True, frozen=True), "frozen_in_step": way(False, frozen=True),
        }  # fmt: skip
    finally:
        _restore(saved)


@pytest.mark.ranks
def test_the_reduce_scatters_run_behind_backward_and_the_step_applies_them_only_while_the_gradients_are_unchanged():
    """With gradient sync on, every bucket's reduce-scatter is issued before backward returns and lands there
    (each split parameter's piece), and the step issues none; with it off, the step issues them all. Where
    the gradients changed after backward (torch's `clip_grad_norm_` scaled them in place; a second backward
    added to them, each one reduce-scattering again), the step reduce-scatters afresh. A backward that raised
    midway leaves nothing behind for the next; a frozen layer is left as it was. Each update equals the one
    whose sums all ran in the step, to the bit."""
    import torch

    for got in get_pool(2).run(_ways, RunConfig(model="llama-tiny", mesh="dp=2", zero=1, dtype="float32")):
        n = got["overlap"]["buckets"]
        assert n >= 3 and got["overlap"]["landed"] == got["overlap"]["split"]
        assert (got["overlap"]["backward"], got["overlap"]["step"]) == (["backward"] * n, [])
        assert (got["in_step"]["backward"], got["in_step"]["step"]) == ([], ["optimizer"] * n)
        assert (got["clip"]["backward"], got["clip"]["step"]) == (["backward"] * n, ["optimizer"] * n)
        assert (got["accumulate"]["backward"], got["accumulate"]["step"]) == (["backward"] * 2 * n, [])
        assert got["after_a_raise"]["step"] == []  # the backward after it ran whole, behind backward again
        assert (got["frozen"]["backward"], got["frozen"]["step"]) == (["backward"] * n, [])
        for a, b in (("overlap", "in_step"), ("clip", "clip_in_step"), ("accumulate", "accumulate_in_step"),
                     ("after_a_raise", "in_step"), ("frozen", "frozen_in_step")):  # fmt: skip
            assert got[a]["params"].keys() == got[b]["params"].keys()
            assert all(torch.equal(got[a]["params"][k], got[b]["params"][k]) for k in got[a]["params"]), (a, b)
        assert not all(
            torch.equal(got["overlap"]["params"][k], got["clip"]["params"][k]) for k in got["clip"]["params"]
        )  # the clipping did change the update
        held = [k for k in got["frozen"]["params"] if k.startswith("layers.0.")]
        assert held and all(torch.equal(got["frozen"]["params"][k], got["init"][k]) for k in held)
