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

from meshlib import Mesh
from meshlib_torch.runtime.parallel import check_max_norm
from meshlib_torch.testing.parity import RunConfig, compare, train_parallel, train_reference
from meshlib_torch.testing.pool import get_pool

CASES = {
    "dp2-zero1": RunConfig(model="llama-tiny", mesh="dp=2", zero=1, max_norm=0.05),
    "dp2tp2-zero0": RunConfig(model="llama-tiny", mesh="dp=2,tp=2", max_norm=0.05),
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
