"""To and from `jax.sharding`: Mesh / AbstractMesh, PartitionSpec and NamedSharding.

Needs jax (`pip install 'meshlib[jax]'`). Rank `r` of a meshlib mesh is the
`r`-th device of `jax.devices()` laid out row-major, which is where
`jax.make_mesh` puts it on CPU and GPU hosts.

Example:
    >>> from meshlib.interop import jax as mj
    >>> mj.from_jax_spec(mj.to_jax_spec(P("dp", ("tp", "cp"))))
    P('dp', ('tp', 'cp'))
"""

from __future__ import annotations

try:
    import jax
    import numpy as np
    from jax.sharding import AbstractMesh as _JaxAbstractMesh
    from jax.sharding import Mesh as _JaxMesh
    from jax.sharding import NamedSharding as _JaxNamedSharding
    from jax.sharding import PartitionSpec as _JaxP
except ImportError as err:  # pragma: no cover - exercised by the no-jax test
    raise ImportError(
        "meshlib.interop.jax needs jax, which is not installed. "
        "Fix: pip install 'meshlib[jax]' (or pip install jax)"
    ) from err

from ..mesh import Mesh
from ..sharding import NamedSharding
from ..spec import UNCONSTRAINED, P

__all__ = [
    "to_jax_mesh",
    "to_jax_abstract_mesh",
    "from_jax_mesh",
    "to_jax_spec",
    "from_jax_spec",
    "to_jax_sharding",
    "from_jax_sharding",
]


def to_jax_mesh(mesh: Mesh, devices=None, *, axis_types=None) -> _JaxMesh:
    """A concrete `jax.sharding.Mesh`; rank r is `devices[r]` (default `jax.devices()`).

    `axis_types` passes through to jax (jax's `Mesh` defaults to Auto axes,
    `jax.make_mesh` to Explicit ones).
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < mesh.size:
        raise ValueError(
            f"{mesh!r} needs {mesh.size} devices but jax has {len(devices)}. Fix: on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before importing jax"
        )
    grid = np.asarray(devices[: mesh.size], dtype=object).reshape(mesh.axis_sizes)
    if axis_types is None:
        return _JaxMesh(grid, mesh.axis_names)
    return _JaxMesh(grid, mesh.axis_names, axis_types=axis_types)


def to_jax_abstract_mesh(mesh: Mesh) -> _JaxAbstractMesh:
    return _JaxAbstractMesh(mesh.axis_sizes, mesh.axis_names)


def from_jax_mesh(mesh: _JaxMesh | _JaxAbstractMesh) -> Mesh:
    """A meshlib Mesh with the same axes (device placement is not kept)."""
    return Mesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names))


def to_jax_spec(spec: P) -> _JaxP:
    entries = [_JaxP.UNCONSTRAINED if e is UNCONSTRAINED else e for e in spec]
    return _JaxP(*entries, unreduced=spec.unreduced, reduced=spec.reduced)


def from_jax_spec(spec: _JaxP) -> P:
    parts = getattr(spec, "partitions", None) or tuple(spec)  # `*spec` refuses unreduced specs
    entries = [UNCONSTRAINED if e is _JaxP.UNCONSTRAINED else e for e in parts]
    return P(
        *entries,
        unreduced=getattr(spec, "unreduced", frozenset()),
        reduced=getattr(spec, "reduced", frozenset()),
    )


def to_jax_sharding(sharding: NamedSharding, devices=None) -> _JaxNamedSharding:
    if sharding.uneven != "error":
        raise ValueError(
            f"{sharding!r} uses uneven='chunk', which jax.sharding.NamedSharding does not have; "
            "convert a sharding with the default uneven='error'"
        )
    return _JaxNamedSharding(to_jax_mesh(sharding.mesh, devices), to_jax_spec(sharding.spec))


def from_jax_sharding(sharding: _JaxNamedSharding) -> NamedSharding:
    return NamedSharding(from_jax_mesh(sharding.mesh), from_jax_spec(sharding.spec))
