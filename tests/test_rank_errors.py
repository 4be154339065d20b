"""Bad input fails on every rank before any collective, and a dead rank ends the run.

Method: jobs on a pool of gloo ranks call `parallelize` with a flaw; each
rank catches the error and reports it with the number of collectives it had
issued (`COUNTER.calls`, plus whether a DeviceMesh was built). A job where
one rank exits mid-step must fail for the caller within seconds.
"""

import os
import time

import pytest
import torch

from meshlib import Mesh, P, pattern_rules
from meshlib_torch import COUNTER, parallelize
from meshlib_torch.models import build, default_rules
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.testing.pool import RankError, get_pool

pytestmark = pytest.mark.ranks


def _try(flaw: str):
    model = build("llama-tiny")
    mesh, rules = Mesh(dp=2, tp=2), default_rules("llama-tiny", Mesh(dp=2, tp=2))
    x = torch.zeros(4, 16, dtype=torch.long)
    if flaw == "unmatched":
        rules = pattern_rules({"tok_embeddings.weight": P("tp", None)})
    elif flaw == "unfit":
        rules = pattern_rules({"**.w1.weight": P("ep", None)}, default=P())
    elif flaw == "world":
        mesh = Mesh(dp=2, tp=4)
    elif flaw == "batch":
        x = torch.zeros(3, 16, dtype=torch.long)
    COUNTER.reset()
    meshes_before = len(mdist._MESHES)
    try:
        parallelize(model, mesh=mesh, rules=rules, example_inputs=(x, x.clone()), init=lambda n: ("zeros", 0.0))
    except ValueError as err:
        return str(err), COUNTER.calls, len(mdist._MESHES) - meshes_before
    return "no error", COUNTER.calls, 0


@pytest.mark.parametrize(
    "flaw, message",
    [
        ("unmatched", r"no rule .* matches 20 leaves"),
        ("unfit", r"2 specs cannot be laid out on Mesh\(dp=2, tp=2\):\n  layers\.0\.feed_forward\.w1\.weight: spec P\('ep', None\) names mesh axis 'ep'"),
        ("world", r"Mesh\(dp=2, tp=4\) has 8 ranks but the world size is 4"),
        ("batch", r"input 'tokens': dim 0 of shape \(3, 16\) has size 3, which spec P\('dp'\) splits 2 ways"),
    ],
)
def test_bad_input_raises_on_every_rank_before_any_collective(flaw, message):
    import re

    results = get_pool(4).run(_try, flaw)
    for text, calls, new_meshes in results:
        assert re.search(message, text), text
        assert calls == 0 and new_meshes == 0
    assert len({text for text, _, _ in results}) == 1


def _die_mid_step():
    """Rank 1 exits after its forward; the others are then inside backward collectives."""
    mesh = Mesh(dp=2, tp=2)
    x = torch.zeros(4, 16, dtype=torch.long)
    par = parallelize(build("gpt-tiny"), mesh=mesh, rules=default_rules("gpt-tiny", mesh), example_inputs=(x, x), init=lambda n: ("normal", 0.02))
    loss = par(x, x)
    if torch.distributed.get_rank() == 1:
        os._exit(7)
    loss.backward()
    return float(loss)


def test_a_dead_rank_ends_the_run_quickly():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died"):
        get_pool(4).run(_die_mid_step)
    assert time.monotonic() - start < 30  # gloo notices the closed socket at once; the pool's job timeout is 120 s
    assert get_pool(4).run(torch.distributed.get_world_size) == [4, 4, 4, 4]  # the pool restarts
