"""Expert parallelism in compiled models: the bundled MoE models on `ep` train as the single process.

Method: the same fp64 weights and batches run once in one process (the reference: the model as written,
its experts dense) and once compiled on gloo ranks, where each experts module is the `experts_ep`
region (tokens to their experts by all-to-all over `ep`, E/ep experts per rank); the losses, every
gradient after the first backward and every parameter after 3 AdamW steps must agree to 1e-12.
"""

from __future__ import annotations

import moe_models as mm
import pytest

import meshlib as ml
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single

pytestmark = pytest.mark.ranks

MODELS = {"moe-tiny": (mm.build_tiny, mm.rules_tiny), "moe-tiny-ds": (mm.build_ds, mm.rules_ds)}


@pytest.mark.parametrize(
    "name, mesh, options",
    [
        ("moe-tiny", "ep=2", {}),
        ("moe-tiny", "ep=4", {}),
        ("moe-tiny", "dp=2,ep=2", {}),
        ("moe-tiny-ds", "dp=2,ep=2", {}),
    ],
)
def test_an_moe_model_on_ep_trains_as_the_single_process(name, mesh, options):
    build, rules = MODELS[name]
    ref = run_single(Trial(build, mm.batch, lr=1e-3))
    trial = Trial(build, mm.batch, mesh=mesh, rules=rules, lr=1e-3, options=options)
    got = get_pool(ml.Mesh.parse(mesh).size).run(run_parallel, trial)
    for rank in got:
        assert_same(ref, rank, rtol=1e-12, atol=1e-12)
