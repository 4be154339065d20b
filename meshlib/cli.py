"""The `meshlib` command. Its options are parsed here, with no torch; `plan`, `run` and `calibrate` are
then carried out by the installed backend (torch: `meshlib_torch.cli`).

    meshlib plan --model llama-7b --mesh dp=8,tp=4
    meshlib run --nproc-per-node 4 --model gpt-tiny --mesh dp=2,tp=2 --steps 20
    meshlib calibrate --ranks 2,4,8

So `meshlib --help`, `meshlib plan --help` and `meshlib --version` answer at once, and a
mistyped choice is refused (exit status 2) before torch is imported. `python -m meshlib`
with no arguments is a tour of the core alone.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import re
import sys
import time
from importlib.metadata import entry_points

from .mesh import Mesh
from .options import BALANCE, CP_LAYOUTS, CP_METHODS, RECOMPUTE, Parallelism, Pipelining
from .plan import Precision
from .schedules import SCHEDULE_NAMES, resolve_schedule
from .sharding import UNEVEN_POLICIES

ZERO_CHOICES = ("0", "1", "2", "3", "no_shard", "shard_grad_op", "full")
LAUNCHED_ENV = "MESHLIB_LAUNCHER"  # set for the workers `meshlib run --nproc-per-node` starts
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_GRACE = 2.0  # seconds another rank waits before exiting on an error, so that rank 0 can say it...
_GRACE_MAX = 15.0  # ...or, under torch's elastic agent, until rank 0's error file is written (at most this)

EXAMPLES = """\
examples:
  meshlib plan --model llama-7b --mesh dp=8,tp=4 --sp
  meshlib plan --model mypkg.model:build --rules mypkg.model:rules --mesh dp=2,tp=2
  meshlib run --nproc-per-node 4 --model gpt-tiny --mesh dp=2,tp=2 --steps 20
  meshlib calibrate --quick --ranks 2
  torchrun --nproc-per-node 4 -m meshlib_torch run --model gpt-tiny --mesh dp=2,tp=2

`python -m meshlib` with no arguments shows the core alone, with no torch."""

USER_MODEL_HELP = """\
your own model (meshlib plan --model package.module:factory):
  factory()                 returns the torch.nn.Module; it is called under torch.device("meta"),
                            so its parameters take no memory (a model it puts elsewhere is moved)
  --rules                   the rules: `module:name` or a file.py defining `rules`. Either a
                            function of the mesh, rules(mesh), that returns them, or the rules
                            themselves: a rule (path, leaf) -> P, or a {pattern: P} dict.
                            Default: `rules` in the factory's module; without one every
                            parameter is replicated
  --inputs                  module:function, called as function(batch, seq), returning the
                            forward's example inputs: a tuple (positional) or a dict (keywords).
                            Default: `example_inputs` in the factory's module; without one the
                            token ids (batch, seq), also passed as targets=/labels= when the
                            forward takes one
  The forward returns the loss (or a dict or ModelOutput with "loss"), as compile_model says."""

PAR, PIPE = Parallelism(), Pipelining()  # the options' defaults, defined once (`meshlib.options`)


def version() -> str:
    """The installed distribution's version, else the package's own `__version__`."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("meshlib")
    except PackageNotFoundError:
        from . import __version__

        return __version__


@functools.cache
def bundled_models() -> tuple[str, ...]:
    """The names of the torch backend's bundled models (the keys of `meshlib_torch.models.CONFIGS`),
    read from its source without importing it, so that the parser needs no torch. Empty when it
    cannot be read; the backend then checks the name."""
    found = {ep.name: ep.value for ep in entry_points(group="meshlib.backends")}
    spec = importlib.util.find_spec(found.get("torch", "meshlib_torch"))  # finds the package, runs nothing
    if spec is None or not spec.submodule_search_locations:
        return ()
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "models", "__init__.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return ()
    for node in tree.body:
        names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        if "CONFIGS" in names and isinstance(node.value, ast.Dict):
            return tuple(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return ()


class Parser(argparse.ArgumentParser):
    """argparse's parser; under torchrun only rank 0 prints a usage error (every rank exits 2)."""

    def error(self, message: str):
        fail(f"{self.format_usage()}{self.prog}: error: {message}", status=2)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (when it has one worth saying)."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        unsaid = default is None or default is False or default == "" or default == argparse.SUPPRESS
        if "%(default)" in text or unsaid or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def _float(text: str, least: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > least if strict else value >= least) or value == float("inf"):
        side = "above" if strict else "of at least"
        bound = "positive" if strict and least == 0 else f"a finite number {side} {least:g}"
        raise argparse.ArgumentTypeError(f"{text} is not {bound}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, 0, strict=True)


def _load(text: str) -> float:
    return _float(text, 1, strict=False)  # 1: an even share; the busiest rank draws more


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def _bytes(text: str) -> float:
    """`80GiB`, `24e9`, `40 GB`: a positive number of bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or not float(m.group(1)) > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes: give e.g. 80GiB, 40GB or 24e9")
    return float(m.group(1)) * _UNITS[unit]


def _checked(check, what: str):
    """An argparse type that keeps the text once `check(text)` accepts it (its ValueError is the message)."""

    def convert(text: str) -> str:
        try:
            check(text)
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    convert.__name__ = what
    return convert


def _model(own: bool):
    def model(text: str) -> str:
        known = bundled_models()
        if text in known or (own and _FACTORY.match(text)) or (not known and not _FACTORY.match(text)):
            return text
        extra = "; or package.module:factory for your own model" if own else ""
        if _FACTORY.match(text):
            extra = ". `meshlib run` trains the bundled models; `meshlib plan --model module:factory` plans yours"
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; bundled models: {', '.join(known)}{extra}")

    return model


def _split_points(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer indices separated by commas, e.g. 4,9,14") from None


def _nnodes(text: str) -> int:
    low, _, high = text.partition(":")
    if high and high != low:
        raise argparse.ArgumentTypeError(f"{text}: a mesh has a fixed number of ranks; give one node count")
    return _positive(low)


def _schedule(text: str) -> None:
    resolve_schedule(text, None)


def _common(p: argparse.ArgumentParser, *, own_models: bool) -> None:
    models = ", ".join(bundled_models()) or "see meshlib_torch.models"
    p.add_argument(
        "--model", default="gpt-tiny", type=_model(own_models),
        metavar="NAME" + ("|MODULE:FACTORY" if own_models else ""),
        help=f"bundled model ({models})" + ("; or your own, see below" if own_models else ""),
    )  # fmt: skip
    p.add_argument("--mesh", default="dp=2,tp=2", type=_checked(Mesh.parse, "mesh"), help="mesh axes, e.g. dp=2,tp=2")
    p.add_argument("--batch", type=_positive, default=8, help="global batch size")
    p.add_argument(
        "--seq", type=_positive, default=None,
        help="sequence length (default: the model's; at most 64 for run; 64 for your own model)",
    )  # fmt: skip
    p.add_argument("--sp", action="store_true", help="sequence parallel: norm regions sharded on the sequence over tp")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="master (full-precision) dtype")
    p.add_argument("--layers", type=_positive, default=None, help="override a bundled model's layer count")
    p.add_argument(
        "--zero", default=str(PAR.zero), choices=ZERO_CHOICES, metavar="{0,1,2,3,no_shard,shard_grad_op,full}",
        help="what is sharded over dp: 1 optimizer state, 2 and gradients, 3 and parameters",
    )  # fmt: skip
    p.add_argument(
        "--precision", default=None, type=_checked(Precision.parse, "precision"), metavar="PRECISION",
        help="compute dtype: fp32, bf16, fp16, or param=..,reduce=..,output=.. (default: the master dtype)",
    )  # fmt: skip
    p.add_argument("--recompute", default=PAR.recompute, choices=RECOMPUTE, help="activation recompute")
    p.add_argument(
        "--microbatches", type=_positive, default=PIPE.microbatches,
        help="microbatches per step (pipeline, or accumulation)",
    )  # fmt: skip
    p.add_argument(
        "--schedule", default=PIPE.schedule, type=_checked(_schedule, "schedule"), metavar="SCHEDULE",
        help=f"pipeline schedule: {', '.join(SCHEDULE_NAMES)} (any case; torch's class names too)",
    )  # fmt: skip
    p.add_argument("--chunks", type=_positive, default=None, help="pipeline stages per rank (interleaved schedules)")
    p.add_argument(
        "--split-points", type=_split_points, default=None, metavar="I,J,..",
        help="layers where pipeline stages 2, 3, ... begin, e.g. 4,9,14 (default: balanced by --balance)",
    )  # fmt: skip
    p.add_argument(
        "--balance", default=PIPE.balance, choices=BALANCE,
        help="what pipeline stages share evenly: FLOPs, parameters, or layers (Megatron's even split)",
    )  # fmt: skip
    p.add_argument(
        "--uneven", default=PAR.uneven, choices=UNEVEN_POLICIES,
        help="a dim its axes do not divide: an error (JAX's rule), or torch.chunk's block sizes",
    )  # fmt: skip
    p.add_argument(
        "--cp-method", default=PAR.cp_method, choices=CP_METHODS,
        help="attention across the cp ranks: keys and values around a ring, gathered once, or all-to-all (Ulysses)",
    )  # fmt: skip
    p.add_argument(
        "--cp-layout", default=PAR.cp_layout, choices=CP_LAYOUTS,
        help="the tokens each cp rank holds: head-tail chunks (causal work balanced) or one contiguous piece",
    )  # fmt: skip
    p.add_argument(
        "--capacity-factor", type=_positive_float, default=None, metavar="C",
        help="MoE experts take at most ceil(C*T*k/E) of each rank's pairs, dropping the rest (default: dropless)",
    )  # fmt: skip
    p.add_argument(
        "--expert-load", type=_load, default=PAR.expert_load, metavar="R",
        help="plans give each ep rank's dropless experts R times an even share of the tokens (default 1: even)",
    )  # fmt: skip
    p.add_argument(
        "--idle-axes", default="", metavar="AXIS,...",
        help="mesh axes nothing is split over, replicated on purpose (else such an axis is refused as a likely typo)",
    )  # fmt: skip


def _launcher(run: argparse.ArgumentParser) -> None:
    g = run.add_argument_group(
        "launcher",
        "Without torchrun, `meshlib run --nproc-per-node N` checks the options against the mesh, then starts\n"
        "the N workers itself with torch.distributed's elastic agent (the one torchrun uses). Several\n"
        "nodes: run it on each, with torchrun's rendezvous options.",
    )
    g.add_argument(
        "--nproc-per-node", type=_positive, default=None, metavar="N",
        help="workers on this node (default: none; then run under torchrun)",
    )  # fmt: skip
    g.add_argument("--nnodes", type=_nnodes, default="1", help="number of nodes")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    g.add_argument("--rdzv-backend", default="static", help="rendezvous backend (one node: a local c10d store)")
    g.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT", help="rendezvous endpoint")
    g.add_argument("--rdzv-id", default="none", help="rendezvous job id")
    g.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (static rendezvous)")
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rank 0's port (static rendezvous; default: 29500, or a free port)",
    )
    g.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group after a failure")


def _world_sizes(text: str) -> tuple[int, ...]:
    """`--ranks 2,4,8`: distinct world sizes of at least 2, ascending."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in words if not w.isdigit() or int(w) < 2]
    if not words or bad:
        what = f"{', '.join(map(repr, bad))} {'is not a world size' if len(bad) == 1 else 'are not world sizes'}"
        raise argparse.ArgumentTypeError(
            f"{text!r}: {what if bad else 'no world size given'}; give numbers of ranks of 2 or more (a collective "
            "needs two), separated by commas, e.g. 2,4,8"
        )
    return tuple(sorted({int(w) for w in words}))


def _calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure this machine's gloo CPU ranks and write their device profile",
        formatter_class=_Formatter, usage="%(prog)s [options]",
        description="Run micro-benchmarks on real gloo ranks (one torch thread each, as meshlib runs them):\n"
        "matrix products by size and dtype, memory bandwidth, host time per op, ranks sharing the cores,\n"
        "and collectives from 1 KiB to 64 MiB. Write the fitted device profile as JSON and print the figures.\n"
        "`meshlib plan --profile cpu` (and meshlib.device_profile('cpu')) then reads it.",
    )  # fmt: skip
    cal.add_argument(
        "--out", default=None, metavar="PATH",
        help="where to write the profile (default: $MESHLIB_PROFILE_DIR/cpu.json, else "
        "~/.cache/meshlib/profiles/cpu.json); the raw measurements go beside it, *.measurements.json",
    )  # fmt: skip
    cal.add_argument(
        "--ranks", type=_world_sizes, default="2,4,8", metavar="N,N,..",
        help="world sizes to measure collectives and shared cores on",
    )  # fmt: skip
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (under a minute on 2 ranks)")


def parser() -> argparse.ArgumentParser:
    """The parser of `meshlib {plan,run,calibrate}`; building it imports no torch."""
    top = Parser(
        prog="meshlib",
        description="Plan and run meshlib-parallel training.",
        epilog=EXAMPLES,
        formatter_class=_Formatter,
    )
    top.add_argument("--version", action="version", version=f"meshlib {version()}")
    sub = top.add_subparsers(dest="command", metavar="{plan,run,calibrate}", parser_class=Parser)
    plan = sub.add_parser(
        "plan", help="compile on the meta device and print the plan (no processes)", formatter_class=_Formatter,
        usage="%(prog)s [options]",
        description="Compile a model for a mesh on the meta device (no processes, no memory) and print the plan.",
        epilog=USER_MODEL_HELP,
    )  # fmt: skip
    _common(plan, own_models=True)
    plan.add_argument("--rules", default=None, metavar="MODULE:NAME|FILE.py", help="your model's rules (see below)")
    plan.add_argument(
        "--inputs", default=None, metavar="MODULE:FUNCTION", help="your model's example inputs (see below)"
    )
    plan.add_argument("--all", action="store_true", help="list every collective instead of grouping them")
    plan.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON to this file")
    auto = plan.add_argument_group(
        "the planner",
        "With --auto the search chooses the mesh (dp, tp, pp, ep, cp), ZeRO, recompute, microbatches, schedule,\n"
        "chunks and the cp method for --devices devices of --profile, --batch and --seq; it prints the best plans,\n"
        "why each axis is there, the full per-rank plan of the fastest of them by their dry runs (--refine) and\n"
        "the `meshlib run` line that trains it.",
    )
    auto.add_argument("--auto", action="store_true", help="search for the fastest plan that fits (needs --profile)")
    auto.add_argument("--devices", type=_positive, default=None, help="devices to plan for (default: the mesh's)")
    auto.add_argument(
        "--device-memory", type=_bytes, default=None, metavar="SIZE",
        help="memory per device, e.g. 80GiB or 24e9 (default: the profile's)",
    )  # fmt: skip
    auto.add_argument("--top", type=_positive, default=5, help="plans to list")
    auto.add_argument(
        "--refine", type=_positive, default=3, metavar="N",
        help="compile the search's best N that fit into full plans and run the fastest by them (default 3; 1: the "
        "search's first that fits)",
    )  # fmt: skip
    plan.add_argument(
        "--profile", default=None, metavar="a100|h100|cpu|FILE.json",
        help="predict the step on these devices: time, tokens/s, MFU, and the shares of compute, exposed "
        "communication and bubble (cpu: this machine's calibrated gloo ranks, `meshlib calibrate`)",
    )  # fmt: skip
    run = sub.add_parser(
        "run", help="train on several processes and compare with the single-process reference",
        formatter_class=_Formatter, usage="%(prog)s [options]",
        description="Train a bundled model on the mesh, then compare with the same steps in one process.\n"
        "Give --nproc-per-node to start the workers, or launch under torchrun.",
    )  # fmt: skip
    _common(run, own_models=False)
    run.add_argument("--steps", type=_positive, default=20, help="optimizer steps")
    run.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW learning rate")
    run.add_argument(
        "--max-norm", type=_positive_float, default=None, metavar="NORM",
        help="clip the gradients to this global norm before each update (the whole model's, on every layout)",
    )  # fmt: skip
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data")
    run.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    run.add_argument(
        "--weights", default=None, metavar="PATH",
        help="start from these weights: a .safetensors file, a directory saved by save_pretrained or --export, "
        "or a DCP checkpoint (each rank reads its own shards)",
    )  # fmt: skip
    run.add_argument(
        "--export", default=None, metavar="PATH",
        help="after training, write the model there as Hugging Face safetensors (sharded files with the index)",
    )  # fmt: skip
    _launcher(run)
    _calibrate(sub)
    return top


def fail(message: str, *, status: int = 2):
    """Exit with `message` said once, however many ranks run this.

    Alone, or on rank 0 under torchrun, print it to stderr; other ranks stay quiet and wait a
    moment first, so that torchrun does not stop rank 0 before it has spoken. Under torch's
    elastic agent the message also goes into the rank's error file, where torchrun's report and
    `meshlib run --nproc-per-node` (whose workers print nothing) read it."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            now = time.time()  # torch's format; "time" to the microsecond besides its whole seconds
            info = {"py_callstack": message, "timestamp": str(int(now))}
            json.dump({"message": {"message": message, "extraInfo": info}, "time": now}, f)
    if os.environ.get(LAUNCHED_ENV) != "1":
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        else:
            _wait_for_rank0(error_file)
    raise SystemExit(status)


def _wait_for_rank0(error_file: str | None) -> None:
    """Another rank's exit ends the run (torchrun stops the rest): wait until rank 0 has written its error
    file, which it does just before printing, when it runs on this node (torch's elastic agent keeps one
    directory per local rank, `.../attempt_N/<local rank>/error.json`); at most `_GRACE_MAX` seconds. Without
    one here, `_GRACE`. A loaded machine can put rank 0 seconds behind the others."""
    same_node = os.environ.get("LOCAL_RANK", "0") == os.environ.get("RANK", "0")  # local rank 0 is rank 0
    if not error_file or not same_node:
        time.sleep(_GRACE)
        return
    path = os.path.join(os.path.dirname(os.path.dirname(error_file)), "0", os.path.basename(error_file))
    deadline = time.monotonic() + _GRACE_MAX
    while time.monotonic() < deadline and not os.path.exists(path):
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 prints right after writing its file


def check_launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Raise ValueError unless `meshlib run` (with no RANK set: not under torchrun) has workers to
    start, as many as the mesh has ranks. `argv` is the command's, to quote in the message."""
    mesh = Mesh.parse(args.mesh)
    rest = " ".join(argv[argv.index("run") + 1 :] if "run" in argv else argv)
    if args.nproc_per_node is None:
        raise ValueError(
            f"meshlib run trains on {mesh.size} processes; give their number:\n"
            f"  meshlib run --nproc-per-node {mesh.size} {rest}\n"
            f"or launch it with torchrun:\n  torchrun --nproc-per-node {mesh.size} -m meshlib_torch run {rest}"
        )
    world = args.nproc_per_node * args.nnodes
    if mesh.size != world:
        fits = mesh.size % args.nnodes == 0
        fix = f"--nproc-per-node {mesh.size // args.nnodes}" if fits else f"a node count that divides {mesh.size}"
        raise ValueError(
            f"--mesh {args.mesh} has {mesh.size} ranks but --nproc-per-node {args.nproc_per_node} x --nnodes "
            f"{args.nnodes} start {world}. Fix: {fix}"
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return
    if args.command == "run" and "RANK" not in os.environ:
        try:
            check_launch(args, argv)  # answered before torch is imported
        except ValueError as err:
            fail(f"meshlib run: error: {err}")
    from ._backend import backend

    backend("torch").cli.main(argv)


__all__ = ["LAUNCHED_ENV", "bundled_models", "check_launch", "fail", "main", "parser", "version"]
