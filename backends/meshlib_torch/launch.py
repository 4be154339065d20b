"""`meshlib run --nproc-per-node N`: start the workers with torch.distributed's elastic agent.

The agent is the one torchrun runs (`torch.distributed.launcher.api.elastic_launch`), with
torchrun's rendezvous options and their defaults. A single node with no rendezvous options
gets a local c10d store on a free port, as torchrun does. Every worker runs
`python -m meshlib_torch run ...` with the launcher's own arguments.

The launcher says one thing when the run fails. A worker that meets bad input writes the
message to its error file and prints nothing (`meshlib.cli.fail`). The launcher prints the
first failure's message and exits with its status. A worker that dies any other way has already
printed its own traceback, so the launcher adds one line naming the rank. When one worker
exits, the agent stops the others, and every collective has a timeout besides. The agent's
log lines are silenced; set LOGLEVEL (torch's variable, e.g. LOGLEVEL=INFO) to see them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import uuid

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshlib.cli import LAUNCHED_ENV

__all__ = ["launch"]

_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


def launch(
    worker_argv: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_id: str = "none",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
) -> int:
    """Run `python -m meshlib_torch *worker_argv` on `nproc_per_node` workers of this node; return
    the exit status (0, or the first failed worker's, after printing its message to stderr)."""
    backend, endpoint, run_id, options = _rendezvous(
        nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id, master_addr, master_port
    )
    env = {LAUNCHED_ENV: "1"}
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default: N workers do not each take every core
    with tempfile.TemporaryDirectory(prefix="meshlib-run-") as logs, _quiet(), _environ(env):
        config = LaunchConfig(
            min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node, run_id=run_id,
            rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=options, max_restarts=max_restarts,
            monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=logs),
        )  # fmt: skip
        try:
            elastic_launch(config, sys.executable)("-u", "-m", "meshlib_torch", *worker_argv)
        except ChildFailedError as err:
            return _report(err)
        except SignalException as err:  # Ctrl-C or a kill: the agent has stopped the workers
            return 128 + int(err.sigval)
    return 0


def _rendezvous(nnodes, node_rank, backend, endpoint, run_id, master_addr, master_port) -> tuple:
    """(backend, endpoint, run id, options) as torchrun picks them from the same options."""
    if backend == "static" and not endpoint and master_port is None and nnodes == 1:
        return "c10d", "localhost:0", str(uuid.uuid4()), {}  # one node: a local store on a free port
    if backend == "static":
        return backend, endpoint or f"{master_addr}:{master_port or 29500}", run_id, {"rank": node_rank}
    return backend, endpoint, run_id, {}


def _report(err: ChildFailedError) -> int:
    """Print the first failure once; return its exit status."""
    rank, failure = min(err.failures.items(), key=lambda kv: _when(kv[1]))
    data = failure.error_file_data if os.path.isfile(failure.error_file) else {}
    said = data.get("message")
    if isinstance(said, dict):  # torch's format (`meshlib.cli.fail` writes it too)
        said = said.get("message")
    if said:
        print(said, file=sys.stderr)
    elif failure.exitcode < 0:
        print(f"meshlib run: rank {rank} was killed by {failure.signal_name()}", file=sys.stderr)
    else:
        print(f"meshlib run: rank {rank} exited with status {failure.exitcode}", file=sys.stderr)
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def _when(failure) -> float:
    """When the failure happened: the worker's own time (`meshlib.cli.fail` writes it to the
    microsecond, where torch's timestamps keep whole seconds), else the agent's."""
    stamp = failure.error_file_data.get("time") if os.path.isfile(failure.error_file) else None
    return float(stamp) if isinstance(stamp, (int, float)) else float(failure.timestamp)


@contextlib.contextmanager
def _quiet():
    """The elastic agent's log lines, off (unless LOGLEVEL asks for them)."""
    loggers = [] if "LOGLEVEL" in os.environ else [logging.getLogger(name) for name in _LOGGERS]
    null, propagate = logging.NullHandler(), [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(null)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, before in zip(loggers, propagate):
            logger.removeHandler(null)
            logger.propagate = before


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """`values` in os.environ (which the workers inherit) while the block runs."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
