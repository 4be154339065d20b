"""NamedSharding: checks with paths, shard shapes, replicas, and the chunk policy's sizes."""

import pytest

from meshlib import Mesh, NamedSharding, P

MESH = Mesh(dp=2, tp=4)


def test_errors_name_path_values_and_fix():
    with pytest.raises(ValueError, match=r"names mesh axis 'ep', but Mesh\(dp=2, tp=4\) has axes \('dp', 'tp'\)"):
        NamedSharding(MESH, P("ep"))
    s = NamedSharding(MESH, P("dp", "tp", None))
    with pytest.raises(ValueError, match=r"layers\.0\.w: spec .* has 3 entries but the tensor has rank 2"):
        s.check((4, 4), path="layers.0.w")
    with pytest.raises(
        ValueError,
        match=r"w: dim 1 of shape \(4, 6\) has size 6, which spec P\('dp', 'tp'\) splits 4 ways over "
        r"mesh axes tp=4; 6 is not a multiple of 4\. Fix: .*uneven='chunk'",
    ):
        NamedSharding(MESH, P("dp", "tp")).check((4, 6), path="w")
    with pytest.raises(ValueError, match="UNCONSTRAINED"):
        NamedSharding(MESH, P(P.UNCONSTRAINED)).devices_indices_map((4,))
    with pytest.raises(ValueError, match="uneven='pad'"):
        NamedSharding(MESH, P(), uneven="pad")


def test_shard_shapes_and_replicas():
    s = NamedSharding(MESH, P(("dp", "tp"), None))
    assert s.shard_shape((16, 3)) == (2, 3)
    assert s.local_shape((16, 3), 5) == (2, 3)
    assert s.replica_ranks(5) == (5,)
    r = NamedSharding(MESH, P(None, "tp"))
    assert r.replica_ranks(5) == (1, 5)
    assert not r.is_fully_replicated and NamedSharding(MESH, P()).is_fully_replicated
    assert NamedSharding(Mesh(dp=1, tp=4), P("dp")).is_fully_replicated
    assert s.shard_bytes((16, 3), 4) == 24


def test_chunk_policy_sizes_match_torch_chunk_rule():
    """torch.chunk: blocks of ceil(n/k), the last short, the rest empty."""
    s = NamedSharding(Mesh(tp=4), P("tp"), uneven="chunk")
    assert [s.local_shape((6,), r) for r in range(4)] == [(2,), (2,), (2,), (0,)]
    assert [s.local_shape((5,), r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    assert s.shard_shape((5,)) == (2,)
    assert repr(s) == "NamedSharding(Mesh(tp=4), P('tp'), uneven='chunk')"


def test_scalar_and_equality():
    assert NamedSharding(MESH, P()).devices_indices_map(()) == {r: () for r in range(8)}
    assert NamedSharding(MESH, P("dp")) == NamedSharding(MESH, ("dp",))
    assert NamedSharding(MESH, P("dp")) != NamedSharding(MESH, P("dp"), uneven="chunk")
