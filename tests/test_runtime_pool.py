"""Process groups from a `Mesh`, on real gloo ranks from a shared `RankPool`.

Method: each test sends a module-level job to every rank of a pool of gloo
workers (`get_pool(n)`) and compares what each rank returns with a closed form
or with the pure core (`Mesh.group`). The failure tests make one rank raise,
die or skip a collective, and time how long the others take to be released.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as c10d  # noqa: E402

from meshlib import Mesh  # noqa: E402
from meshlib_torch.runtime import dist as runtime  # noqa: E402
from meshlib_torch.testing.pool import RankError, get_pool  # noqa: E402

pytestmark = pytest.mark.ranks


def _timeout_of(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


# -- jobs: module-level, so they pickle by name --------------------------------------------------
def all_reduce_arange(n: int) -> list[float]:
    t = torch.arange(n, dtype=torch.float64) * (c10d.get_rank() + 1)
    c10d.all_reduce(t)
    return t.tolist()


def mesh_groups(mesh: Mesh, multi: list[tuple[str, ...]]) -> dict:
    """Each group's ranks, the sum of ranks over it, its timeout, and the refusals."""
    runtime.init()  # already initialized by the pool: a no-op
    dm = runtime.device_mesh(mesh)
    out = {"cached": runtime.device_mesh(mesh) is dm, "world_timeout": _timeout_of(c10d.group.WORLD)}
    for axes in [(a,) for a in mesh.axis_names] + multi:
        pg = runtime.group(dm, axes if len(axes) > 1 else axes[0])
        t = torch.tensor([float(c10d.get_rank())])
        c10d.all_reduce(t, group=pg)
        out[axes] = (c10d.get_process_group_ranks(pg), t.item(), _timeout_of(pg))
    try:
        runtime.group(dm, tuple(reversed(mesh.axis_names)))
    except ValueError as err:
        out["reversed"] = str(err)
    return out


def wrong_world_size(mesh: Mesh) -> tuple[str, float, bool]:
    """Ranks arrive 0.3 s apart: a collective inside would hold rank 0 until rank 3 came."""
    time.sleep(0.3 * c10d.get_rank())
    groups_before, start = c10d.distributed_c10d.get_pg_count(), time.monotonic()
    try:
        runtime.device_mesh(mesh)
    except ValueError as err:
        return str(err), time.monotonic() - start, c10d.distributed_c10d.get_pg_count() == groups_before
    return "no error", time.monotonic() - start, False


def raise_on(bad: int, then_all_reduce: bool) -> int:
    if c10d.get_rank() == bad:
        raise ValueError(f"boom on rank {bad}")
    print(f"rank {c10d.get_rank()} got past the check")
    if then_all_reduce:
        c10d.all_reduce(torch.ones(1))  # waits for `bad`, which never comes
    return c10d.get_rank()


def die_between_all_reduces(bad: int) -> None:
    c10d.all_reduce(torch.ones(1))
    if c10d.get_rank() == bad:
        os._exit(3)
    c10d.all_reduce(torch.ones(1))


def skip_tp_all_reduce(skipper: int, timeout: float) -> tuple:
    dm = runtime.device_mesh(Mesh(dp=2, tp=2), timeout=timeout)
    tp = runtime.group(dm, "tp")
    limits = {_timeout_of(pg) for pg in dm.get_all_groups()}
    if c10d.get_rank() == skipper:
        return "skipped", 0.0, limits
    start = time.monotonic()
    try:
        c10d.all_reduce(torch.ones(1), group=tp)
    except RuntimeError as err:
        return f"raised: {err}", time.monotonic() - start, limits
    return "completed", time.monotonic() - start, limits


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def leave_the_group() -> int:
    rank = c10d.get_rank()
    runtime.shutdown()
    return rank


# -- tests ---------------------------------------------------------------------------------------
def _started(pool) -> tuple[int, ...]:
    """The worker pids once the pool is up (an earlier test may have torn it down)."""
    pool.run(sleep, 0)
    return pool.pids


def test_without_torchrun_init_and_device_mesh_explain_what_is_missing(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert (runtime.device_type(), runtime.backend()) == ("cpu", "gloo")
    assert not c10d.is_initialized()
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        runtime.init()
    with pytest.raises(ValueError, match="call meshlib_torch.runtime.dist.init"):
        runtime.device_mesh(Mesh(dp=2))


def test_all_reduce_is_the_closed_form_sum_on_every_rank():
    # rank r contributes (r + 1) * arange(n); the sum over 4 ranks is 10 * arange(n)
    results = get_pool(4).run(all_reduce_arange, 6)
    assert results == [[10.0 * i for i in range(6)]] * 4


@pytest.mark.parametrize(
    "mesh, multi",
    [
        (Mesh(dp=2, tp=2), [("dp", "tp")]),
        (Mesh(dp=2, cp=2, tp=2), [("dp", "cp"), ("dp", "tp"), ("cp", "tp"), ("dp", "cp", "tp")]),
    ],
    ids=["dp2-tp2", "dp2-cp2-tp2"],
)
def test_groups_follow_the_core_mesh_order(mesh, multi):
    results = get_pool(mesh.size).run(mesh_groups, mesh, multi)
    for rank, out in enumerate(results):
        assert out["cached"]
        assert "not in mesh order" in out["reversed"]
        for axes in [(a,) for a in mesh.axis_names] + multi:
            ranks, total, timeout = out[axes]
            assert tuple(ranks) == mesh.group(rank, axes), (rank, axes)
            assert total == sum(mesh.group(rank, axes))
            assert timeout == out["world_timeout"], f"{axes} kept torch's default timeout"


def test_wrong_world_size_raises_on_every_rank_before_any_collective():
    results = get_pool(4).run(wrong_world_size, Mesh(dp=2, tp=4))
    for message, elapsed, no_new_groups in results:
        assert "Mesh(dp=2, tp=4) has 8 ranks but the world size is 4" in message
        assert elapsed < 0.2 and no_new_groups
    assert get_pool(4).run(all_reduce_arange, 2) == [[0.0, 10.0]] * 4


def test_an_error_on_one_rank_names_it_and_keeps_the_pool(capsys):
    pool = get_pool(4)
    pids = _started(pool)
    with pytest.raises(RankError, match="rank 2 raised ValueError: boom on rank 2") as info:
        pool.run(raise_on, 2, False)
    assert info.value.ranks == (2,) and info.value.stuck == ()
    assert "in raise_on" in info.value.tracebacks[2]
    assert "[rank 3] rank 3 got past the check" in capsys.readouterr().out  # the ranks' prints reach the caller
    assert pool.pids == pids  # the others finished: no restart
    assert pool.run(all_reduce_arange, 2) == [[0.0, 10.0]] * 4


def test_ranks_stuck_behind_an_error_are_released_and_the_pool_restarts():
    pool = get_pool(4)
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 2 raised ValueError: boom on rank 2") as info:
        pool.run(raise_on, 2, True)
    assert time.monotonic() - start < pool.grace + 3
    assert info.value.ranks == (2,) and info.value.stuck == (0, 1, 3)
    assert pool.run(all_reduce_arange, 2) == [[0.0, 10.0]] * 4


def test_a_rank_that_dies_mid_step_fails_fast_and_the_pool_restarts():
    pool = get_pool(4)
    pids = _started(pool)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)") as info:
        pool.run(die_between_all_reduces, 1)
    assert time.monotonic() - start < pool.grace + 3  # the pool timeout is 120 s
    # Survivors next to rank 1 in gloo's ring raise "Connection closed by peer" at once; a survivor
    # whose only wait is on another (live, now idle) survivor stays blocked and is killed as stuck.
    err = info.value
    assert set(err.failures) | set(err.stuck) == {0, 1, 2, 3}
    raised = [r for r in (0, 2, 3) if r in err.failures]
    assert raised and all(err.failures[r].startswith("raised RuntimeError") for r in raised), err.failures
    assert pool.run(all_reduce_arange, 2) == [[0.0, 10.0]] * 4
    assert set(pool.pids).isdisjoint(pids)


def test_a_job_past_its_timeout_is_killed_and_the_pool_restarts():
    pool = get_pool(2)
    with pytest.raises(RankError, match="rank 0 timed out"):
        pool.run(sleep, 30, timeout=1)
    assert pool.run(all_reduce_arange, 1) == [[0.0]] * 2


def test_a_job_that_leaves_the_group_returns_and_the_pool_restarts():
    pool = get_pool(2)
    pids = _started(pool)
    assert pool.run(leave_the_group) == [0, 1]
    assert pool.run(all_reduce_arange, 1) == [[0.0]] * 2
    assert set(pool.pids).isdisjoint(pids)


def test_a_sub_group_collective_times_out_instead_of_hanging():
    # torch gives DeviceMesh sub-groups a 30 min default; device_mesh() must bound them too
    pool = get_pool(4)
    try:
        results = pool.run(skip_tp_all_reduce, 1, 3.0, timeout=30)
    finally:
        pool.close()  # rank 0's tp group is broken now; give later tests fresh ranks
    assert [r[2] for r in results] == [{3.0}] * 4
    (status0, elapsed0, _), (status1, *_), *others = results
    assert status1 == "skipped"
    assert status0.startswith("raised") and 2.5 < elapsed0 < 10, (status0, elapsed0)
    assert [r[0] for r in others] == ["completed", "completed"]  # the other tp group is unaffected


def test_workers_do_not_outlive_their_parent():
    code = textwrap.dedent(
        """
        import os, signal, threading, time
        from meshlib_torch.testing.pool import RankPool
        from test_runtime_pool import sleep
        if __name__ == "__main__":
            pool = RankPool(2)
            pool.run(sleep, 0)
            print(*pool.pids, flush=True)
            threading.Thread(target=pool.run, args=(sleep, 60), daemon=True).start()
            time.sleep(0.5)  # the workers are inside the job now
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def zero3_under_two_timeouts() -> list[bool]:
    """gpt-tiny under ZeRO-3 on dp=2×tp=2, built twice in one process with two collective timeouts (two equal
    DeviceMeshes): whether every parameter is a DTensor on the device mesh its build asked for."""
    from meshlib_torch import parallelize
    from meshlib_torch.models import build, default_rules

    mesh, x = Mesh(dp=2, tp=2), torch.zeros(4, 16, dtype=torch.long)
    out = []
    for timeout in (60.0, 20.0):
        par = parallelize(build("gpt-tiny"), mesh=mesh, rules=default_rules("gpt-tiny", mesh), example_inputs=(x, x),
                          init=lambda n: ("normal", 0.02), zero=3, timeout=timeout)  # fmt: skip
        out.append(all(p.device_mesh is par.device_mesh for p in par.named_model_parameters().values()))
    return out


def test_equal_meshes_with_two_timeouts_in_one_process_each_keep_their_parameters():
    """torch's DTensor caches sharding propagations under keys that compare meshes by value: a parameter made
    on the second mesh came back on the first, and FSDP2 refused it ("different mesh objects"). The runtime
    clears those caches when it hands out another mesh equal to the last (`torch_private.forget_mesh_specs`)."""
    assert get_pool(4).run(zero3_under_two_timeouts) == [[True, True]] * 4
