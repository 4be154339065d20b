"""The ring's hops are asynchronous: each transfer is under way while a block is computed, forward and backward.

Method: `ring_attention` (cp=4, full attention, contiguous layout: one block per hop) runs on real gloo ranks
with its events logged in order on each rank, not timed: a hop begun (`EagerBackend.permute_start`), a hop
waited for (`InFlight.wait`) and a block computed (`local.attend` forward, `local.shard_grads` backward). Forward,
every hop must be begun before a block and waited for after it. Backward, the keys and values go around the
ring again with their gradient: each K/V hop is begun before a block and waited for after it, and each
gradient hop begun after a block is waited for after the next one. `lax.ppermute_start`
itself: its values and gradients equal `lax.ppermute`'s, and a dry run records the same bytes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from meshlib import Mesh, P  # noqa: E402
from meshlib_torch.testing.pool import get_pool  # noqa: E402

FORWARD = ["start", "block", "wait"] * 3 + ["block"]  # cp=4: 3 hops, 4 blocks
# backward, step by step: the K/V hop begun before the block and its gradient's after it; each waited for
# one block later (the last step's shard is the rank's own: no K/V hop)
BACKWARD = ["start", "block", "start"] + ["wait", "start", "block", "wait", "start"] + [
    "wait", "block", "wait", "start"] + ["block", "wait"]


def logged_ring_job() -> dict:
    from meshlib_torch import shard_map
    from meshlib_torch.attention import local, ring, ring_attention
    from meshlib_torch.spmd import backend, eager

    log: list = []
    saved = local.attend, eager.EagerBackend.permute_start, backend.InFlight.wait, ring.shard_grads

    def attend(*args):  # the shard_map's dry run first (meta tensors) is not logged
        out, lse = saved[0](*args)
        log.extend([] if out.is_meta else ["block"])
        return out, lse

    def grads(*args):
        log.append("block")
        return saved[3](*args)

    def start(self, *args):
        log.append("start")
        return saved[1](self, *args)

    def wait(self):
        out = saved[2](self)
        log.extend([] if out.is_meta else ["wait"])
        return out

    local.attend, eager.EagerBackend.permute_start, backend.InFlight.wait, ring.shard_grads = attend, start, wait, grads
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
        mapped = shard_map(ring_attention, mesh=Mesh(cp=4), in_specs=(P(None, None, "cp"),) * 3,
                           out_specs=P(None, None, "cp"))  # fmt: skip
        log.clear()
        y = mapped(q, k, v).to_local()
        forward = list(log)
        log.clear()
        y.sum().backward()
        return {"forward": forward, "backward": list(log)}
    finally:
        local.attend, eager.EagerBackend.permute_start, backend.InFlight.wait, ring.shard_grads = saved


def permute_job() -> dict:
    """ppermute and ppermute_start of the same values (a pytree of two), with their gradients."""
    from meshlib_torch import lax, shard_map

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, dtype=torch.float64, generator=g)
    perm = [(0, 2), (1, 0), (3, 3)]  # rank 2 sends to no one, rank 1 receives nothing: zeros
    weights = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    out = {}
    for name in ("blocking", "async"):

        def f(a, w, name=name):
            pair = {"a": a.tanh(), "b": a * 2}
            got = lax.ppermute(pair, "i", perm) if name == "blocking" else lax.ppermute_start(pair, "i", perm).wait()
            return got["a"] * w + got["b"]

        leaf = x.clone().requires_grad_()
        y = shard_map(f, mesh=Mesh(i=4), in_specs=(P("i"), P("i")), out_specs=P("i"))(leaf, weights).full_tensor()
        y.sum().backward()
        out[name] = (y.detach(), leaf.grad)
    return out


@pytest.mark.ranks
def test_each_hop_is_under_way_while_a_block_is_computed():
    for rank, got in enumerate(get_pool(4).run(logged_ring_job)):
        assert got["forward"] == FORWARD, (rank, got["forward"])
        assert got["backward"] == BACKWARD, (rank, got["backward"])


@pytest.mark.ranks
def test_ppermute_start_equals_ppermute():
    for got in get_pool(4).run(permute_job):
        (y0, g0), (y1, g1) = got["blocking"], got["async"]
        assert torch.equal(y0, y1) and torch.equal(g0, g1)


def test_a_dry_run_records_ppermute_start_as_ppermute():
    """The same records (op, kind, bytes, phase) on meta tensors, forward and backward."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch import lax
    from meshlib_torch.spmd import region_collectives

    perm = [(j, (j + 1) % 4) for j in range(4)]
    plans = [
        region_collectives(f, mesh=Mesh(i=4), in_specs=(P("i"),), out_specs=P("i"), args=(ShapeDtype((2, 3), "float32"),))
        for f in (lambda x: lax.ppermute(x, "i", perm), lambda x: lax.ppermute_start(x, "i", perm).wait())
    ]
    blocking, started = ([(r.op, r.kind, r.bytes, r.phase) for r in plan.records] for plan in plans)
    assert blocking == started == [("ppermute", "send_recv", 24, "forward"), ("ppermute", "send_recv", 24, "backward")]
