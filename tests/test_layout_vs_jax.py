"""Per-rank layouts equal JAX's `NamedSharding.devices_indices_map`, and torch.chunk's under `chunk`.

Method: hypothesis draws meshes of 1-4 axes (up to 16 ranks), specs with tuple
entries in random axis order, and shapes; the oracle is real JAX on 16 CPU
host devices (rank r = jax.devices()[r]). For `uneven="chunk"` the oracle is
JAX for which block a rank holds and `torch.chunk` for the block's extent.
"""

import math

import jax
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as JaxP

from meshlib import Mesh, NamedSharding, P
from meshlib.interop.jax import to_jax_mesh, to_jax_spec

NAMES = ("dp", "tp", "pp", "ep", "cp", "x")


@st.composite
def meshes(draw):
    n = draw(st.integers(1, 4))
    names = draw(st.permutations(NAMES))[:n]
    sizes = []
    for _ in range(n):
        room = 16 // math.prod(sizes or [1])
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 3, 4, 8, 16) if s <= room])))
    return Mesh(tuple(sizes), tuple(names))


@st.composite
def specs_for(draw, mesh):
    ndim = draw(st.integers(0, 4))
    spec_len = draw(st.integers(0, ndim))
    dims: list[list[str]] = [[] for _ in range(spec_len)]
    for axis in mesh.axis_names:
        if spec_len and draw(st.booleans()):
            dims[draw(st.integers(0, spec_len - 1))].append(axis)
    entries = []
    for axes in dims:
        axes = draw(st.permutations(axes)) if axes else axes
        if not axes:
            entries.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    return P(*entries), ndim


def _ways(mesh, spec, ndim):
    return [mesh.axis_size(spec.dim_axes(d)) if d < len(spec) else 1 for d in range(ndim)]


def _jax_map(mesh, spec, shape):
    jmesh = to_jax_mesh(mesh)
    sharding = jax.sharding.NamedSharding(jmesh, to_jax_spec(spec))
    return {dev.id: idx for dev, idx in sharding.devices_indices_map(shape).items()}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_even_layouts_equal_jax(data):
    mesh = data.draw(meshes())
    spec, ndim = data.draw(specs_for(mesh))
    shape = tuple(w * data.draw(st.integers(1, 3)) for w in _ways(mesh, spec, ndim))
    ours = NamedSharding(mesh, spec).devices_indices_map(shape)
    assert ours == _jax_map(mesh, spec, shape)
    assert NamedSharding(mesh, spec).shard_shape(shape) == jax.sharding.NamedSharding(
        to_jax_mesh(mesh), to_jax_spec(spec)
    ).shard_shape(shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_uneven_error_like_jax_and_chunk_like_torch(data):
    mesh = data.draw(meshes())
    spec, ndim = data.draw(specs_for(mesh))
    ways = _ways(mesh, spec, ndim)
    shape = tuple(data.draw(st.integers(0, 3 * w + 2)) for w in ways)
    uneven = any(n % w for n, w in zip(shape, ways))
    jax_blocks = _jax_map(mesh, spec, tuple(ways))  # rank -> which block of each dim
    if uneven:
        with pytest.raises(ValueError, match="not a multiple"):
            NamedSharding(mesh, spec).devices_indices_map(shape)
        with pytest.raises(ValueError):
            _jax_map(mesh, spec, shape)
    ours = NamedSharding(mesh, spec, uneven="chunk").devices_indices_map(shape)
    for rank, slices in ours.items():
        for dim, (n, w) in enumerate(zip(shape, ways)):
            block = jax_blocks[rank][dim].indices(w)[0]
            chunks = torch.arange(n).chunk(w) if n else ()
            got = torch.arange(n)[slices[dim]]
            want = chunks[block] if block < len(chunks) else torch.arange(0)
            assert torch.equal(got, want), (rank, dim, slices, block)


def test_tuple_entry_out_of_mesh_order():
    """P(('tp', 'dp')) on a (dp, tp) mesh: tp is the major factor, as in JAX."""
    mesh = Mesh(dp=2, tp=4)
    ours = NamedSharding(mesh, P(("tp", "dp"))).devices_indices_map((16,))
    assert ours == _jax_map(mesh, P(("tp", "dp")), (16,))
    assert ours[1] == (slice(4, 6),)  # dp=0, tp=1 -> block 1*2+0


def test_rank_order_matches_jax_make_mesh():
    mesh = Mesh(dp=2, pp=2, tp=4)
    jmesh = jax.make_mesh(mesh.axis_sizes, mesh.axis_names, devices=jax.devices()[:16])
    for coords, dev in zip(__import__("itertools").product(*map(range, mesh.axis_sizes)), jmesh.devices.flat):
        assert mesh.rank(dict(zip(mesh.axis_names, coords))) == dev.id


def test_unreduced_round_trips_with_jax():
    spec = P("dp", None, unreduced={"tp"})
    assert to_jax_spec(spec) == JaxP("dp", None, unreduced={"tp"})
    assert NamedSharding(Mesh(dp=2, tp=2), spec).is_fully_replicated is False
