"""Gradient clipping on every layout: `train_step(..., max_norm=)` (`Parallel.clip_grad_norm_`) against
`torch.nn.utils.clip_grad_norm_` on the whole model in one process, the parity harness's reference.

The norm is the whole model's: over data and tensor axes, over pipeline stages, and under ZeRO-1 of the
gradients summed over the data axes, which no rank holds before the step. Each case clips every step (the
reference's norms are all above `max_norm`), so a norm read on one stage or one rank's unsummed gradient
would step differently: with the norm taken 1.5 times too large, the three fp64 cases fail. (AdamW is nearly
blind to a gradient's scale, so the fp16 case, at fp16's tolerance, checks the loss-scaling path runs, not
the coefficient.)
"""

import pytest
import torch

from meshlib import Mesh
from meshlib_torch.runtime.parallel import check_max_norm
from meshlib_torch.testing.parity import RunConfig, compare, train_parallel, train_reference
from meshlib_torch.testing.pool import get_pool

CASES = {
    "dp2-zero1": RunConfig(model="llama-tiny", mesh="dp=2", zero=1, max_norm=0.05),
    "dp2tp2-zero0": RunConfig(model="llama-tiny", mesh="dp=2,tp=2", max_norm=0.05),
    "dp2tp2-zero1-fused-qkv": RunConfig(model="gpt-tiny", mesh="dp=2,tp=2", zero=1, max_norm=0.05),
    "dp2pp2-zero3-tied": RunConfig(model="gpt-tiny", mesh="dp=2,pp=2", zero=3, microbatches=2, max_norm=0.05),
    "dp2tp2-zero1-fp16": RunConfig(model="gpt-tiny", mesh="dp=2,tp=2", zero=1, dtype="float32", precision="fp16",
                                   lr=1e-3, max_norm=0.05),  # fmt: skip
}


@pytest.mark.ranks
@pytest.mark.parametrize("case", list(CASES))
def test_clipped_training_equals_torchs_clipping_on_one_process(case):
    run = CASES[case]
    reference = train_reference(run)
    assert min(reference.grad_norms) > run.max_norm  # every step clips
    got = get_pool(Mesh.parse(run.mesh).size).run(train_parallel, run)[0]
    compare(reference, got, run.tolerance)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_a_clipping_norm_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match=r"max_norm=.*positive, finite gradient norm"):
        check_max_norm(bad)


def _norms_and_reduces(run):
    """After one backward: torch's own `clip_grad_norm_` over the parameters (it must read ZeRO-1's
    unsummed gradients as Partial over the data axes and sum them), then meshlib's from the optimizer's
    reduce-scattered pieces, with the all-reduces that one issues (their element counts)."""
    from meshlib_torch.testing.parity import batch_of, build_parallel

    par = build_parallel(run)
    opt = par.optimizer(lr=1e-3)
    par(*batch_of(run, 0)).backward()
    placements = {str(p.grad.placements) for p in par.parameters()}
    torchs = float(torch.nn.utils.clip_grad_norm_(list(par.parameters()), float("inf")))
    opt.reduce_gradients()  # the step's reduce-scatters: what the clipping below reads
    sizes, reduce = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda t, *a, **k: (sizes.append(t.numel()), reduce(t, *a, **k))[1]
    try:
        ours = par.clip_grad_norm_(1e9, opt=opt)
    finally:
        torch.distributed.all_reduce = reduce
    return torchs, ours, sizes, placements


@pytest.mark.ranks
@pytest.mark.parametrize("mesh", ["dp=2", "dp=2,tp=2"])
def test_zero1s_unsummed_gradients_are_partial_and_its_norm_is_one_scalar_all_reduce(mesh):
    """Under ZeRO-1 backward leaves each rank its own gradient; labeled Partial over the data axes,
    torch's `clip_grad_norm_` sums it and reads the whole model's norm (the single process's). Taken from
    the optimizer's reduce-scattered pieces (as `train_step(max_norm=)` takes it), the norm is the same
    and costs one all-reduce of one number."""
    run = RunConfig(model="gpt-tiny", mesh=mesh, zero=1, steps=1)
    expected = train_reference(run).grad_norms[0]
    for torchs, ours, sizes, placements in get_pool(Mesh.parse(mesh).size).run(_norms_and_reduces, run):
        assert all("Partial" in p for p in placements)
        assert torchs == pytest.approx(expected, rel=1e-9)
        assert ours == pytest.approx(expected, rel=1e-9)
        assert sizes == [1]


def _backward_between_clipping_and_step(run):
    from meshlib_torch.testing.parity import batch_of, build_parallel

    par = build_parallel(run)
    opt = par.optimizer(lr=1e-3)
    par(*batch_of(run, 0)).backward()
    par.clip_grad_norm_(1.0, opt=opt)
    par(*batch_of(run, 1)).backward()  # too late: its gradients are not in the sums the step would apply
    try:
        opt.step()
    except RuntimeError as err:
        refused = str(err)
    else:
        refused = None
    opt.zero_grad()  # starting over works
    par(*batch_of(run, 0)).backward()
    par.clip_grad_norm_(1.0, opt=opt)
    return refused, opt.step()


@pytest.mark.ranks
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_backward_after_the_gradients_were_summed_is_refused_at_the_step(precision):
    """ZeRO-1 frees each gradient it reduce-scatters, and a bf16 model's master takes a copy: a backward
    run after clipping summed them would otherwise be dropped from the step without a word."""
    run = RunConfig(model="llama-tiny", mesh="dp=2", zero=1, dtype="float32", precision=precision)
    for refused, stepped in get_pool(2).run(_backward_between_clipping_and_step, run):
        assert refused is not None and "changed after opt.reduce_gradients()" in refused and "Fix:" in refused
        assert stepped is True
