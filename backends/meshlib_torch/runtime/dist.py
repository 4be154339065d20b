"""Process groups for a meshlib `Mesh`: one code path for NCCL (cuda) and gloo (cpu).

The device type picks the backend, and nothing else differs between the two.
`device_mesh(mesh)` builds torch's `DeviceMesh` with the mesh's axis names and
sizes, so rank `r` sits at `mesh.coords(r)` (row-major, the last axis fastest),
and `group(dm, axes)` is the process group whose rank order is the core's
`mesh.group(rank, axes)` order (first axis major). Both are checked when a
group is first made.

Every group gets a bounded timeout. `init_process_group(timeout=...)` applies
only to the world group: DeviceMesh sub-groups fall back to torch's 30-minute
default, so a rank that skips a collective would hang its peers for half an hour.
The timeout is given to each group when it is made (`backend_override` options),
not set afterwards: gloo fixes the timeout of a send/recv wait, which is what
pipeline stages use, when the group's context is created.

Example (under torchrun with 4 processes):

    dist.init(timeout=60)
    dm = dist.device_mesh(Mesh(dp=2, tp=2))
    torch.distributed.all_reduce(t, group=dist.group(dm, "tp"))
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshlib import Mesh

from ..torch_private import default_store, flatten_mesh, forget_mesh_specs, group_options, world_timeout

__all__ = ["device_type", "backend", "init", "device_mesh", "group", "leave", "shutdown", "start"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MESHES: dict[tuple[Mesh, float | None], DeviceMesh] = {}
_TIMEOUTS: dict[int, timedelta] = {}  # id(DeviceMesh) -> the timeout of its groups
_LAST: dict[Mesh, DeviceMesh] = {}  # the DeviceMesh last handed out for each mesh
_GROUPS: dict[tuple[int, tuple[str, ...]], tuple[DeviceMesh, c10d.ProcessGroup]] = {}  # pins the mesh: ids stay unique


def device_type() -> str:
    """The device type: "cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """The collective backend for `device_type()`: "nccl" or "gloo"."""
    return "nccl" if device_type() == "cuda" else "gloo"


def init(*, timeout: float = 120.0) -> None:
    """Join the world process group from torchrun's environment; a no-op if already joined."""
    if c10d.is_initialized():
        return
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"meshlib_torch.runtime.dist.init needs the torchrun environment; {', '.join(missing)} "
            "not set. Fix: launch with `torchrun --nproc-per-node N script.py`"
        )
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    c10d.init_process_group(backend(), timeout=timedelta(seconds=timeout))
    # the groups meshlib made are torn down before the interpreter finalizes: left to exit-time
    # destructors, a gloo group's threads can outlive it and abort the process (SIGABRT)
    atexit.register(leave)


EXIT_WAIT = 10.0  # seconds a rank leaving waits for the others to leave too (a dead rank's never come)


def leave() -> None:
    """Leave as a run ends (and at exit): wait until every rank has reached this point (or `EXIT_WAIT`
    passed), then `shutdown`. A rank that tore its gloo group down while a peer was still finishing the
    last collective with it made the peer abort (SIGABRT, "terminate called without an active exception":
    2 of 10 runs of `meshlib run --export` on 2 ranks, whose last call is a collective; and `meshlib run`
    on 3 ranks in CI, whose workers called `shutdown` directly); the ranks meet in the rendezvous store
    instead, which no collective uses."""
    store = default_store() if c10d.is_initialized() else None
    if store is not None and c10d.get_world_size() > 1:
        try:
            store.add("meshlib/exit", 1)
            deadline = time.monotonic() + EXIT_WAIT
            while store.add("meshlib/exit", 0) < c10d.get_world_size() and time.monotonic() < deadline:
                time.sleep(0.005)
        except (RuntimeError, ValueError):  # the store's host (rank 0's agent) gone: nothing to wait for
            pass
    shutdown()


def start(mesh: Mesh, *, timeout: float | None = None) -> DeviceMesh:
    """Join the world group (from torchrun's environment) and return `mesh`'s DeviceMesh; raises on every
    rank, before any collective, if the mesh does not cover the world."""
    init()
    mesh.check_world_size(c10d.get_world_size())
    return device_mesh(mesh, timeout=timeout)


def device_mesh(mesh: Mesh, *, timeout: float | None = None) -> DeviceMesh:
    """The `DeviceMesh` for `mesh`, made once per process and cached.

    Raises ValueError on every rank, before any collective, if the mesh does
    not cover the world. `timeout` (seconds; default: the world group's) is set
    on every group of the mesh. For a 1-D mesh over the whole world that group
    is the world group itself.
    """
    if not c10d.is_initialized():
        raise ValueError("device_mesh needs a process group; call meshlib_torch.runtime.dist.init() first")
    mesh.check_world_size(c10d.get_world_size())
    key = (mesh, timeout)
    if key not in _MESHES:
        limit = _world_timeout() if timeout is None else timedelta(seconds=timeout)
        world = c10d.get_world_size()
        override = {  # a world-wide axis with the world's timeout keeps the world group
            name: _options(limit)
            for name, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
            if size != world or limit != _world_timeout()
        }
        dm = init_device_mesh(
            device_type(), mesh.axis_sizes, mesh_dim_names=mesh.axis_names, backend_override=override or None
        )
        _TIMEOUTS[id(dm)] = limit
        for name, pg in zip(mesh.axis_names, dm.get_all_groups(), strict=True):
            _check_order(dm, (name,), pg)
        _MESHES[key] = dm
    dm = _MESHES[key]
    if _LAST.setdefault(mesh, dm) is not dm:  # an equal mesh with another timeout in use: see forget_mesh_specs
        _LAST[mesh] = dm
        forget_mesh_specs()
    return dm


def group(dm: DeviceMesh, axes: str | tuple[str, ...]) -> c10d.ProcessGroup:
    """The process group over one axis of `dm`, or over several flattened (first axis major).

    Several axes must be given in mesh order: `("dp", "tp")` on a (dp, tp)
    mesh, never `("tp", "dp")`. The group's rank order equals
    `Mesh.group(rank, axes)`.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(dm.mesh_dim_names or ())
    unknown = [a for a in axes if a not in names]
    if unknown or not axes:
        raise ValueError(f"group axes {axes} are not axes of this device mesh {names}. Fix: use some of {names}")
    order = [names.index(a) for a in axes]
    if order != sorted(set(order)):
        raise ValueError(
            f"group axes {axes} are not in mesh order {names}. Fix: pass "
            f"{tuple(sorted(axes, key=names.index))}; a tp-major rank order is a layout "
            "(_StridedShard), not a process group"
        )
    if len(axes) == 1:
        return dm.get_group(axes[0])
    key = (id(dm), axes)
    if key not in _GROUPS:
        limit = _TIMEOUTS.get(id(dm)) or _world_timeout()
        pg = flatten_mesh(dm, axes, _options(limit)).get_group()
        _check_order(dm, axes, pg)
        _GROUPS[key] = (dm, pg)
    return _GROUPS[key][1]


def shutdown() -> None:
    """Leave the world process group (if joined) and forget every cached mesh and group."""
    _MESHES.clear()
    _TIMEOUTS.clear()
    _LAST.clear()
    _GROUPS.clear()
    if c10d.is_initialized():
        c10d.destroy_process_group()


def _world_timeout() -> timedelta:
    """The timeout the world group was created with."""
    return world_timeout(device_type())


def _options(limit: timedelta) -> tuple:
    """(backend, options) that make a new group with timeout `limit`: the device type picks the class."""
    return backend(), group_options(backend(), limit)


def _check_order(dm: DeviceMesh, axes: tuple[str, ...], pg: c10d.ProcessGroup) -> None:
    """Raise unless `pg` lists this rank's group in the core's `Mesh.group` order."""
    ranks = dm.mesh.flatten().tolist()
    core = Mesh(tuple(dm.mesh.shape), tuple(dm.mesh_dim_names))
    expected = [ranks[i] for i in core.group(ranks.index(c10d.get_rank()), axes)]
    actual = c10d.get_process_group_ranks(pg)
    if actual != expected:
        raise RuntimeError(
            f"process group over {axes} has ranks {actual} but the mesh order is {expected}; "
            "collectives over it would not match meshlib's layouts"
        )
