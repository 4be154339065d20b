"""The command line: its parser (fast, no torch), `meshlib plan` with no processes, the run under
torchrun and under its own launcher, and what each says when the input is bad.

Method: run the README's commands (shortened) in subprocesses and check what they print
against the plan's closed forms (bytes per rank of llama-7b's shards), against the
single-process reference (the job's own comparison), and, on bad input, that the message
is said once, by one process, with no traceback and a non-zero exit status. Whether torch
was imported is read from `sys.modules` in the process that parsed the options.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from meshlib import P, Plan

ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "FORCE_COLOR", "TTY_COMPATIBLE")}
ENV["COLUMNS"] = "200"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MESHLIB = [sys.executable, "-m", "meshlib"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _proc(args: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**ENV, **env})


def _run(args: list[str], timeout: int = 300, **env) -> str:
    proc = _proc(args, timeout, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _diffs(out: str, steps: int) -> dict:
    return dict(re.findall(rf"(loss \(every step\)|parameters after {steps} steps) +│? *([0-9.e+-]+)", out))


# -- the parser: fast, and strict ------------------------------------------------------------------
_PARSE_ONLY = """
import contextlib, io, json, sys
from meshlib.cli import main
out = {}
for argv in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out[" ".join(argv)] = [code, text.getvalue()]
out["torch imported"] = "torch" in sys.modules
print(json.dumps(out))
"""


def _parse_only(*argvs: list[str]) -> dict:
    return json.loads(_run([sys.executable, "-c", _PARSE_ONLY, json.dumps(argvs)]))


def test_version_and_help_answer_without_torch():
    """--version and every command's --help come from the parser alone: torch is never imported."""
    out = _parse_only(["--version"], ["--help"], ["plan", "--help"], ["run", "--help"], [])
    assert out.pop("torch imported") is False
    assert out["--version"] == [0, f"meshlib {version('meshlib')}\n"]
    assert all(code == 0 for code, _ in out.values())
    top, plan, run = out["--help"][1], out["plan --help"][1], out["run --help"][1]
    assert "meshlib plan" in top and "meshlib run --nproc-per-node 4" in top and out[""][1] == top
    for option, default in (("--steps", "20"), ("--lr", "0.003"), ("--seed", "0"), ("--zero", "0"), ("--uneven", "error")):
        assert re.search(rf"{option} .*?\(default: {re.escape(default)}\)", " ".join(run.split()), re.S), option
    assert "package.module:factory" in plan and "example_inputs" in plan and "--nproc-per-node" not in plan
    for flag in ("--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--master-addr", "--master-port", "--max-restarts"):
        assert flag in run


def test_the_core_tour_needs_no_torch():
    code = "import runpy, sys; sys.argv = ['meshlib']; runpy.run_module('meshlib', run_name='__main__'); print('torch' in sys.modules)"
    out = _run([sys.executable, "-c", code])
    assert "meshlib demo on Mesh(dp=2, tp=2, pp=2)" in out and out.rstrip().endswith("False")


BAD = [
    (["plan", "--zero", "4"], "argument --zero: invalid choice: '4'"),
    (["plan", "--precision", "fp8"], "argument --precision: precision 'fp8'"),
    (["plan", "--schedule", "zigzag"], "argument --schedule: unknown pipeline schedule 'zigzag'"),
    (["plan", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["plan", "--recompute", "all"], "argument --recompute: invalid choice: 'all'"),
    (["plan", "--balance", "time"], "argument --balance: invalid choice: 'time'"),
    (["plan", "--uneven", "pad"], "argument --uneven: invalid choice: 'pad'"),
    (["plan", "--mesh", "dp:2"], "'dp:2' is not axis=size"),
    (["plan", "--model", "llama-3b"], "unknown model 'llama-3b'; bundled models: gpt-tiny"),
    (["plan", "--split-points", "x"], "give layer indices separated by commas"),
    (["plan", "--batch", "0"], "argument --batch: 0 is not positive"),
    (["run", "--lr", "-1"], "argument --lr: -1 is not positive"),
    (["run", "--max-norm", "0"], "argument --max-norm: 0 is not positive"),
    (["plan", "--capacity-factor", "inf"], "argument --capacity-factor: inf is not positive"),
    (["plan", "--expert-load", "0.5"], "argument --expert-load: 0.5 is not a finite number of at least 1"),
    (["run", "--model", "mypkg.net:build"], "`meshlib run` trains the bundled models"),
    (["run", "--nnodes", "1:2"], "a mesh has a fixed number of ranks"),
]


def test_bad_choices_are_refused_while_parsing():
    """Exit status 2, argparse's usage line and one error naming the option, and still no torch."""
    out = _parse_only(*(argv for argv, _ in BAD))
    assert out.pop("torch imported") is False
    for argv, said in BAD:
        code, text = out[" ".join(argv)]
        lines = text.splitlines()
        assert code == 2 and len(lines) == 2 and lines[0] == f"usage: meshlib {argv[0]} [options]", (argv, text)
        assert lines[1].startswith(f"meshlib {argv[0]}: error: ") and said in lines[1], (argv, text)


def test_the_parser_reads_the_bundled_models_without_torch():
    from meshlib.cli import bundled_models
    from meshlib_torch.models import CONFIGS

    assert bundled_models() == tuple(CONFIGS)


# -- plan ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_7b_piped(tmp_path_factory) -> tuple[str, dict]:
    """`meshlib plan --model llama-7b --mesh dp=8,tp=4 --json p.json` piped, COLUMNS=80: (stdout, p.json).
    Two tests read it; the plan compiles once."""
    path = tmp_path_factory.mktemp("llama-7b") / "p.json"
    out = _run(MESHLIB + ["plan", "--model", "llama-7b", "--mesh", "dp=8,tp=4", "--json", str(path)], COLUMNS="80")
    return out, json.loads(path.read_text())


def test_meshlib_plan_llama_7b(llama_7b_piped):
    out, plan = llama_7b_piped
    for piece in ("parameter layouts", "layers.*.attention.wq.weight", "collectives per step", "memory per rank", "llama.py:"):
        assert piece in out
    # 6.74e9 fp32 parameters; every matrix except the norms is split 4 ways over tp
    params = plan["memory"]["params"]
    assert 6.7e9 * 4 / 4 < params < 6.8e9 * 4 / 4 + 2e7
    assert plan["memory"]["optimizer"] == 2 * params


@pytest.mark.parametrize("where", ["pipe", "terminal"])
def test_plan_tables_keep_names_whole_at_80_columns(where, request):
    """Piped, the tables are plain text at full width; in an 80-column terminal (rich), a table too wide
    is drawn row by row. Either way no name or source line is cut, and nothing is elided with `…`."""
    if where == "pipe":  # the same command as test_meshlib_plan_llama_7b's, which also writes the json
        raw = request.getfixturevalue("llama_7b_piped")[0]
    else:
        raw = _run(MESHLIB + ["plan", "--model", "llama-7b", "--mesh", "dp=8,tp=4"], COLUMNS="80", FORCE_COLOR="1")
    out = ANSI.sub("", raw)
    assert ("\x1b[" in raw) == (where == "terminal")
    for name in ("layers.*.attention.wq.weight", "layers.*.feed_forward.w2.weight", "tok_embeddings.weight"):
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", out, re.M), name
    assert re.search(r"(^|\s)llama\.py:\d+(\s|$)", out, re.M) and "…" not in out
    if where == "terminal":
        assert max(map(len, out.splitlines())) <= 80


def test_tables_in_a_narrow_terminal():
    """The three ways rich draws a table: natural widths, columns narrowed to their longest word
    (prose wraps at spaces), and records once even that is too wide."""
    import io

    from rich.console import Console

    from meshlib._table import Table

    long_name = "layers.*.feed_forward.w1.weight"
    table = Table("t", ("tensor", "spec", "why"), [(long_name, "P('tp', None)", "a b c d e f g h i j k l m n o p q r s")])
    shown = {}
    for width in (120, 70, 40):
        buf = io.StringIO()
        Console(file=buf, width=width, force_terminal=True, color_system=None).print(table)
        shown[width] = buf.getvalue()
        assert long_name in shown[width] and "…" not in shown[width]
        assert max(map(len, shown[width].splitlines())) <= width
    assert "a b c d e f g h i j k l m n o p q r s" in shown[120]
    assert "┃ tensor" in shown[70] and "a b c d e f" in shown[70] and "a b c d e f g h i j k l m n o p q r s" not in shown[70]
    assert shown[40].splitlines()[2:4] == [long_name, "    spec: P('tp', None)"]


def test_meshlib_plan_pipeline_with_split_points_and_zero(tmp_path):
    """A pp mesh with user split points: the plan's stages hold exactly those layers, and the
    interleaved schedule's 4 stages are placed round-robin."""
    out = _run(
        MESHLIB + ["plan", "--model", "llama-small", "--mesh", "dp=2,pp=2", "--batch", "8", "--microbatches", "4",
                   "--schedule", "ScheduleInterleaved1F1B", "--chunks", "2", "--split-points", "1,2,3", "--zero", "1",
                   "--json", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert "pipeline stages" in out and "balanced by user split points" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert [s["modules"] for s in plan["stages"]] == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    assert [s["rank"] for s in plan["stages"]] == [0, 1, 0, 1]
    assert plan["schedule"] == "interleaved-1f1b" and plan["microbatches"] == 4 and plan["zero"] == 1
    bad = _proc(MESHLIB + ["plan", "--model", "llama-small", "--mesh", "pp=2", "--microbatches", "2", "--split-points", "9"])
    assert bad.returncode == 2 and "split points [9] must be 1 distinct layer indices in 1..3" in bad.stderr
    assert bad.stderr.count("\n") == 1 and not bad.stdout


def test_uneven_chunk_plans_and_trains_on_three_ranks():
    """Without the flag, tp=3 over a width-32 model is refused and the error names `--uneven chunk`'s
    policy; with it, the plan lays out torch.chunk's pieces (MLP 128 rows: 43 on the first rank) and
    the run through the launcher matches the single process."""
    even = _proc(MESHLIB + ["plan", "--model", "gpt-tiny", "--mesh", "tp=3"])
    assert even.returncode == 2 and "is not a multiple of 3" in even.stderr and "uneven='chunk'" in even.stderr
    plan = _proc(MESHLIB + ["plan", "--model", "gpt-tiny", "--mesh", "tp=3", "--uneven", "chunk"])
    assert plan.returncode == 0, plan.stderr
    assert re.search(r"uneven\s+chunk", plan.stdout) and re.search(r"h\.\*\.mlp\.c_fc\.weight .*43x32", plan.stdout)
    run = _proc(MESHLIB + ["run", "--nproc-per-node", "3", "--model", "gpt-tiny", "--mesh", "tp=3", "--uneven", "chunk",
                           "--steps", "2", "--dtype", "float64"])  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "within rtol 1e-12" in run.stdout


USER_MODEL = Path(__file__).with_name("user_model.py")


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(USER_MODEL.read_text().splitlines(), 1) if text in line)


def test_meshlib_plan_of_your_own_model(tmp_path):
    """`--model package.module:factory` plans a model from the user's own module: its `rules(mesh)`
    (Megatron's column/row split of the MLP over tp, so one all-reduce forward and one backward over
    tp, at the MLP's line), or rules from a file, or none (all replicated)."""
    (tmp_path / "tinypkg").mkdir()
    (tmp_path / "tinypkg" / "__init__.py").write_text("")
    shutil.copy(USER_MODEL, tmp_path / "tinypkg" / "net.py")
    (tmp_path / "replicated.py").write_text("from meshlib import P\nrules = {'**': P()}\n")
    plan = [sys.executable, "-m", "meshlib", "plan", "--model", "tinypkg.net:build", "--batch", "4", "--seq", "8"]
    env = {"PYTHONPATH": str(tmp_path)}
    out = _run(plan + ["--mesh", "dp=2,tp=2", "--json", str(tmp_path / "p.json")], **env)
    assert "up.weight" in out and "tinypkg.net:rules" in out
    saved = Plan.from_json((tmp_path / "p.json").read_text())
    specs = dict(saved.specs)
    assert specs["up.weight"] == P("tp", None) and specs["down.weight"] == P(None, "tp") and specs["emb.weight"] == P()
    tp = [c for c in saved.collectives if c.axes == ("tp",)]
    assert sorted(c.phase for c in tp) == ["backward", "forward"] and all(c.source == f"net.py:{_line_of('self.down(')}" for c in tp)
    out = _run(plan + ["--mesh", "dp=2", "--rules", str(tmp_path / "replicated.py")], **env)
    assert "replicated.py" in out and "P('tp'" not in out and "up.weight" in out
    missing = _proc(plan + ["--rules", "tinypkg.net:nope"], **env)
    assert missing.returncode == 2 and missing.stderr == "meshlib plan: error: --rules tinypkg.net:nope: module tinypkg.net has no 'nope'\n"


# -- run -------------------------------------------------------------------------------------------
def test_run_without_a_launcher_says_how_to_launch():
    """Not under torchrun and no --nproc-per-node, or workers the mesh does not fit: said before torch loads."""
    out = _parse_only(["run", "--model", "gpt-tiny", "--mesh", "dp=2,tp=2", "--steps", "5"], ["run", "--nproc-per-node", "2", "--mesh", "dp=4"])
    assert out.pop("torch imported") is False
    code, text = out["run --model gpt-tiny --mesh dp=2,tp=2 --steps 5"]
    assert code == 2 and text == (
        "meshlib run: error: meshlib run trains on 4 processes; give their number:\n"
        "  meshlib run --nproc-per-node 4 --model gpt-tiny --mesh dp=2,tp=2 --steps 5\n"
        "or launch it with torchrun:\n"
        "  torchrun --nproc-per-node 4 -m meshlib_torch run --model gpt-tiny --mesh dp=2,tp=2 --steps 5\n"
    )
    code, text = out["run --nproc-per-node 2 --mesh dp=4"]
    assert code == 2 and text == "meshlib run: error: --mesh dp=4 has 4 ranks but --nproc-per-node 2 x --nnodes 1 start 2. Fix: --nproc-per-node 4\n"


def test_reference_table_states_the_tolerance_it_uses():
    """A bf16 run is compared with a bf16 reference within bf16's tolerance, and never told to try fp64."""
    from meshlib_torch.cli import _reference_table
    from meshlib_torch.testing.parity import RunConfig

    diffs = {"loss": 0.06, "grad_norm": 0.008, "param": 0.03, "ok": False}
    bf16 = _reference_table(diffs, RunConfig(dtype="float32", precision="bf16", steps=20))
    assert bf16.title == "parallel run vs single-process bf16 reference: max |difference|"
    assert "beyond rtol 0.02, atol 0.02" in bf16.caption and "bf16 compute" in bf16.caption and "float64" not in bf16.caption
    fp32 = _reference_table(diffs, RunConfig(dtype="float32", steps=20))
    assert "rtol 1e-05" in fp32.caption and "try --dtype float64" in fp32.caption


@pytest.mark.ranks
def test_main_job_under_torchrun():
    out = _run(
        TORCHRUN + ["--nproc-per-node", "4", "-m", "meshlib_torch", "run", "--model", "gpt-tiny", "--mesh", "dp=2,tp=2",
                    "--steps", "3", "--dtype", "float64"]
    )  # fmt: skip
    assert re.search(r"step +2 +loss", out)
    assert "parallel run vs single-process reference" in out
    diffs = _diffs(out, 3)
    assert diffs and all(float(v) < 1e-12 for v in diffs.values()), out


@pytest.mark.ranks
@pytest.mark.parametrize(
    "bad, said",
    [
        (["--batch", "3"], "meshlib run: error: input 'idx': dim 0 of shape (3, 64) has size 3"),
        (["--zero", "9"], "meshlib run: error: argument --zero: invalid choice: '9'"),
    ],
    ids=["compiling", "parsing"],
)
def test_bad_input_under_torchrun_is_said_once_by_rank_0(bad, said):
    """Every rank fails (non-zero exit); rank 0 alone prints the message, before torchrun's own report
    of the failure (which quotes it from the error file), and no traceback comes from meshlib."""
    job = TORCHRUN + ["--nproc-per-node", "2", "-m", "meshlib_torch", "run", "--model", "gpt-tiny", "--mesh", "dp=2"]
    proc = _proc(job + ["--steps", "1"] + bad)
    assert proc.returncode != 0 and said not in proc.stdout
    ours, _, report = proc.stderr.partition("Traceback (most recent call last)")
    assert ours.count(said) == 1, proc.stderr
    assert "ChildFailedError" in report and not re.search(r'File ".*meshlib', proc.stderr), proc.stderr


@pytest.mark.ranks
def test_launcher_runs_the_job_and_says_only_what_rank_0_says():
    """`meshlib run --nproc-per-node 2`: the workers' output once (rank 0's), nothing from the agent."""
    proc = _proc(MESHLIB + ["run", "--nproc-per-node", "2", "--model", "gpt-tiny", "--mesh", "dp=2", "--steps", "2", "--dtype", "float64"])
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.count("parallel run vs single-process reference") == 1 and proc.stdout.count("step   1  loss") == 1
    diffs = _diffs(proc.stdout, 2)
    assert len(diffs) == 2 and all(float(v) < 1e-12 for v in diffs.values()), proc.stdout


@pytest.mark.ranks
def test_launcher_says_a_bad_input_once(tmp_path):
    """Found before any worker starts (the plan compiled on meta), or by the workers themselves (a
    directory with no weights in it): either way one line, and exit status 2."""
    job = MESHLIB + ["run", "--nproc-per-node", "2", "--model", "gpt-tiny", "--steps", "1"]
    cases = [
        (["--mesh", "dp=2", "--batch", "3"], "meshlib run: error: input 'idx': dim 0 of shape (3, 64) has size 3"),
        (["--mesh", "dp=2", "--weights", str(tmp_path)], f"meshlib run: error: weights={str(tmp_path)!r} holds no safetensors"),
    ]
    for args, said in cases:
        proc = _proc(job + args)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2 and text.count("\n") == 1 and text.startswith(said), text


@pytest.mark.ranks
def test_launcher_compares_bf16_with_a_bf16_reference():
    proc = _proc(MESHLIB + ["run", "--nproc-per-node", "2", "--model", "gpt-tiny", "--mesh", "dp=2", "--steps", "3", "--precision", "bf16"])
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "parallel run vs single-process bf16 reference" in out and "within rtol 0.02, atol 0.02" in out, proc.stdout


@pytest.mark.ranks
def test_main_job_exports_and_starts_from_weights(tmp_path):
    """`--export` writes the trained model; `--weights` starts another mesh's run from it, and the
    single-process reference, reading the same file, takes the same steps (fp64, 1e-12)."""
    out = str(tmp_path / "trained")
    job = TORCHRUN + ["--nproc-per-node", "2", "-m", "meshlib_torch", "run", "--model", "gpt-tiny", "--steps", "2", "--dtype", "float64"]
    first = _run(job + ["--mesh", "dp=2", "--export", out, "--no-reference"])
    assert f"exported the trained model to {out}" in first
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    again = _run(job + ["--mesh", "pp=2", "--microbatches", "2", "--weights", out])
    diffs = _diffs(again, 2)
    assert len(diffs) == 2 and all(float(v) < 1e-12 for v in diffs.values()), again
    start = [float(re.search(r"losses: first ([0-9.]+)", text).group(1)) for text in (first, again)]
    assert start[1] < start[0]  # the second run begins where the first one's training left the model



def test_a_mesh_that_cannot_be_meant_is_refused():
    """A typo (`tq`) splits nothing: refused with the nearest axis name, one message, exit 2; a
    duplicated axis too; `--idle-axes` asks for the replication on purpose."""
    typo = _proc(MESHLIB + ["plan", "--model", "gpt-tiny", "--mesh", "dp=2,tq=2"])
    assert typo.returncode == 2 and len(typo.stderr.splitlines()) == 1, typo.stderr
    assert "mesh axis 'tq' (did you mean 'tp'?) splits nothing" in typo.stderr and "--idle-axes tq" in typo.stderr
    twice = _proc(MESHLIB + ["plan", "--model", "gpt-tiny", "--mesh", "dp=2,dp=2"])
    assert twice.returncode == 2 and "axis 'dp' is given twice" in twice.stderr
    assert "memory per rank" in _run(MESHLIB + ["plan", "--model", "gpt-tiny", "--mesh", "dp=2,tq=2", "--idle-axes", "tq"])
