"""A persistent pool of gloo ranks, so multi-rank tests pay process start-up once.

`RankPool(n)` starts `n` worker processes that join one gloo process group and
then wait for jobs. `pool.run(fn, *args)` runs `fn(*args)` on every rank and
returns the results in rank order; a rank that raises, dies or hangs becomes a
`RankError` in the caller. Tests share one pool per world size through
`get_pool(n)`.

Workers start from a forkserver that has already imported torch, so each
worker is a cheap fork of a single-threaded process: never a fork of the
parent, which may have run multi-threaded torch (a forked child then hangs on
its first parallel op) or jax.

Example (`fn` must be a module-level function, so that it pickles by name):

    def total(x):
        t = torch.tensor([x * (torch.distributed.get_rank() + 1)])
        torch.distributed.all_reduce(t)
        return t.item()

    get_pool(4).run(total, 2.0)   # [20.0, 20.0, 20.0, 20.0]
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["RankError", "RankPool", "close_all", "get_pool"]

_HOST = "127.0.0.1"
# Measured on 2 cores, parent already running torch: forkserver takes ~2.5 s for
# its first pool (it imports _PRELOAD once) and 0.05-0.2 s for each later pool of
# 2-8 ranks; spawn takes 2.5-11 s every time, since every rank imports torch.
_START_METHOD = "forkserver"
# Imported once by the forkserver, so each worker forks with them loaded. The
# first `torch.use_deterministic_algorithms` call imports inductor's config (~1 s).
_PRELOAD = [
    "meshlib_torch.testing.pool",
    "torch._inductor.config",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
]


class RankError(RuntimeError):
    """A job failed on some ranks: raised, died, or ran past its timeout.

    `failures` maps each failing rank to a one-line reason, `tracebacks` holds
    the formatted traceback of every rank that raised, and `stuck` lists ranks
    that were still running `RankPool.grace` seconds after the first failure
    (the pool was then torn down). `str(err)` has all of it.
    """

    def __init__(self, failures: dict[int, str], tracebacks: dict[int, str], stuck: tuple[int, ...] = ()):
        self.failures, self.tracebacks, self.stuck = dict(failures), dict(tracebacks), tuple(stuck)
        lines = [f"rank {r} {why}" for r, why in failures.items()]
        if stuck:
            lines.append(f"{_ranks(stuck)} still running afterwards, so the pool was torn down")
        body = [f"\n--- rank {r} ---\n{tb.rstrip()}" for r, tb in tracebacks.items()]
        super().__init__("; ".join(lines) + "".join(body))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The failing ranks (not the stuck ones), ascending."""
        return tuple(sorted(self.failures))


class _Reply(NamedTuple):
    """One rank's answer: status "ok" (payload: the pickled result), "error" or "died" (payload: why)."""

    status: str
    payload: bytes | str
    traceback: str = ""
    output: str = ""  # what the job printed to sys.stdout and sys.stderr
    keep: bool = True  # False: the worker is exiting (its job destroyed the process group)


def _ranks(ranks) -> str:
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} were"


# -- the worker side ---------------------------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, timeout: float, conn) -> None:
    """Join the gloo group, report ready, then run jobs until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent()
    try:
        _join_group(rank, world_size, port, timeout)
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit
        conn.send_bytes(pickle.dumps(_failed(exc)))
        os._exit(1)
    conn.send_bytes(pickle.dumps(_Reply("ok", pickle.dumps(None))))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed the pool or died
            os._exit(0)
        sys_path, blob = pickle.loads(message)
        sys.path.extend(p for p in sys_path if p not in sys.path)
        reply = _execute(blob)._replace(keep=dist.is_initialized())
        conn.send_bytes(pickle.dumps(reply))
        if not reply.keep:  # the job left the process group: retire; the parent restarts the pool
            os._exit(0)


def _exit_with_parent() -> None:
    """Exit as soon as the parent dies, even in the middle of a collective."""
    sentinel = mp.parent_process().sentinel

    def watch():
        wait([sentinel])
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _join_group(rank: int, world_size: int, port: int, timeout: float) -> None:
    torch.set_num_threads(1)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    limit = timedelta(seconds=timeout)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=limit)


def _execute(blob: bytes) -> _Reply:
    """Run one job; its pickled result or what it raised, and what it printed."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            fn, args, kwargs = pickle.loads(blob)
            _reset_state()
            reply = _Reply("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - includes DCP's CheckpointException
            reply = _failed(exc)
    return reply._replace(output=output.getvalue())


def _reset_state() -> None:
    """Every job starts from the same seeds and deterministic settings."""
    torch.manual_seed(0)
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _failed(exc: BaseException) -> _Reply:
    return _Reply("error", f"raised {type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))


# -- the parent side ---------------------------------------------------------------------------
class RankPool:
    """`world_size` gloo ranks waiting for jobs; see the module docstring.

    `timeout` bounds start-up, every job (unless `run` is given its own) and
    every collective on the world group. After the first rank fails, the others
    get `grace` seconds to finish or raise before the pool is torn down. A pool
    that was torn down (a rank died, a job timed out or hung) restarts on the
    next `run`.
    """

    grace = 2.0

    def __init__(self, world_size: int, *, timeout: float = 120.0, start_method: str = _START_METHOD):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool needs a positive int world_size; got {world_size!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"RankPool start_method {start_method!r}: use 'forkserver' or 'spawn'; 'fork' hangs when "
                "the parent has already run multi-threaded torch"
            )
        self.world_size, self.timeout, self.start_method = world_size, float(timeout), start_method
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self._ready = False
        self._start()

    def __repr__(self) -> str:
        state = "running" if self._procs else "stopped"
        return f"RankPool({self.world_size}, timeout={self.timeout}) [{state}]"

    @property
    def pids(self) -> tuple[int, ...]:
        """Worker process ids in rank order (empty when stopped)."""
        return tuple(p.pid for p in self._procs)

    def _start(self) -> None:
        """Start the workers; `run` waits for them to join the group."""
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        limit = timedelta(seconds=self.timeout)
        self._store = dist.TCPStore(_HOST, 0, None, True, timeout=limit, wait_for_workers=False)
        for rank in range(self.world_size):
            mine, theirs = ctx.Pipe()
            args = (rank, self.world_size, self._store.port, self.timeout, theirs)
            proc = ctx.Process(target=_worker, args=args, daemon=True, name=f"meshlib-rank{rank}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)

    def close(self) -> None:
        """Kill every worker now; the next `run` starts fresh ones."""
        for proc in self._procs:
            proc.kill()
        for proc, conn in zip(self._procs, self._conns, strict=True):
            proc.join()
            conn.close()
        self._procs, self._conns, self._store, self._ready = [], [], None, False

    def run(self, fn, /, *args, timeout: float | None = None, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank; the results in rank order.

        Raises `RankError` if any rank raises, dies, or is still running after
        `timeout` seconds (default: the pool's). `fn` must be a module-level
        function; it cannot take a keyword named `timeout`.
        """
        blob = _pickle_job(fn, args, kwargs)
        limit = self.timeout if timeout is None else float(timeout)
        try:
            if not self._procs or not all(proc.is_alive() for proc in self._procs):  # torn down, killed, retired
                self.close()
                self._start()
            if not self._ready:
                self._gather("start-up", self.timeout)
                self._ready = True
            message = pickle.dumps((list(sys.path), blob))
            for conn in self._conns:
                conn.send_bytes(message)
            return self._gather("job", limit)
        except RankError:
            raise
        except BaseException:  # Ctrl-C or a broken pipe: leave no worker behind
            self.close()
            raise

    def _gather(self, phase: str, limit: float) -> list:
        """Every rank's result; `RankError` unless all succeeded.

        Tears the pool down first if a rank died, timed out or is stuck, or if
        the job left the process group.
        """
        replies, pending = self._collect(limit)
        for rank, reply in sorted(replies.items()):  # into the caller's stdout, which pytest captures
            sys.stdout.writelines(f"[rank {rank}] {line}\n" for line in reply.output.splitlines())
        failures = {r: reply.payload for r, reply in replies.items() if reply.status != "ok"}
        died = [r for r, reply in replies.items() if reply.status == "died"]
        if died or pending or (phase == "start-up" and failures) or not all(r.keep for r in replies.values()):
            self.close()
        if not failures and not pending:
            return [pickle.loads(replies[r].payload) for r in range(self.world_size)]
        if not failures:
            failures = {r: f"timed out: still running {limit:g} s after the {phase} began" for r in pending}
            pending = []
        order = died + [r for r in failures if r not in died]  # deaths first, then by arrival
        tracebacks = {r: replies[r].traceback for r in sorted(failures) if r in replies and replies[r].traceback}
        raise RankError({r: failures[r] for r in order}, tracebacks, tuple(sorted(pending)))

    def _collect(self, limit: float) -> tuple[dict[int, _Reply], list[int]]:
        """Replies by rank, in order of arrival, and the ranks that never replied.

        Waits up to `limit` seconds, and at most `grace` seconds after the first failure.
        """
        replies: dict[int, _Reply] = {}
        pending = list(range(self.world_size))
        deadline = time.monotonic() + limit
        while pending:
            ready = wait(
                [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                break
            for rank in [r for r in pending if self._conns[r] in ready or self._procs[r].sentinel in ready]:
                pending.remove(rank)
                replies[rank] = self._receive(rank)
                if replies[rank].status != "ok":
                    deadline = min(deadline, time.monotonic() + self.grace)
        return replies, pending

    def _receive(self, rank: int) -> _Reply:
        """The reply of one rank whose pipe or process is ready; "died" if there is none."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        proc.join(timeout=5)
        return _Reply("died", _death(proc.exitcode))


def _death(exitcode) -> str:
    if exitcode is None:
        return "died (closed its pipe; exit code unknown)"
    if exitcode < 0:
        return f"died: killed by {signal.Signals(-exitcode).name}"
    return f"died (exit code {exitcode})"


def _pickle_job(fn, args, kwargs) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"RankPool.run could not pickle {getattr(fn, '__qualname__', fn)!r} and its arguments: {exc}. "
            "Fix: pass a module-level function (not a lambda or a nested function) and picklable arguments"
        ) from exc


_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The shared pool of `world_size` ranks for this process; started on first use."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


def close_all() -> None:
    """Stop every pool that `get_pool` started (also run at exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_all)
