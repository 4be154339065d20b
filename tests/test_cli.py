"""The command line: `meshlib plan` with no processes, and the torchrun main job end to end.

Method: run the README's commands (shortened) in subprocesses and check what
they print against the plan's closed forms (bytes per rank of llama-7b's
shards) and against the single-process reference (the job's own comparison).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ENV = {**os.environ, "COLUMNS": "200"}


def _run(args: list[str], timeout: int = 300) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_meshlib_plan_llama_7b(tmp_path):
    out = _run([sys.executable, "-m", "meshlib", "plan", "--model", "llama-7b", "--mesh", "dp=8,tp=4", "--json", str(tmp_path / "p.json")])
    for piece in ("parameter layouts", "layers.*.attention.wq.weight", "collectives per step", "memory per rank", "llama.py:"):
        assert piece in out
    plan = json.loads((tmp_path / "p.json").read_text())
    # 6.74e9 fp32 parameters; every matrix except the norms is split 4 ways over tp
    params = plan["memory"]["params"]
    assert 6.7e9 * 4 / 4 < params < 6.8e9 * 4 / 4 + 2e7
    assert plan["memory"]["optimizer"] == 2 * params


def test_cli_help_and_bad_mesh():
    assert "meshlib plan" in _run([sys.executable, "-m", "meshlib", "--help"])
    proc = subprocess.run(
        [sys.executable, "-m", "meshlib", "plan", "--model", "gpt-tiny", "--mesh", "dp:2"], capture_output=True, text=True, env=ENV
    )
    assert proc.returncode != 0 and "not axis=size" in proc.stderr


@pytest.mark.ranks
def test_main_job_under_torchrun():
    out = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "meshlib_torch", "run",
         "--model", "gpt-tiny", "--mesh", "dp=2,tp=2", "--steps", "3", "--dtype", "float64"]
    )  # fmt: skip
    assert re.search(r"step +2 +loss", out)
    assert "parallel run vs single-process reference" in out
    diffs = dict(re.findall(r"(loss \(every step\)|parameters after 3 steps) +│? *([0-9.e+-]+)", out))
    assert diffs and all(float(v) < 1e-12 for v in diffs.values()), out


def test_meshlib_plan_pipeline_with_split_points_and_zero(tmp_path):
    """A pp mesh with user split points: the plan's stages hold exactly those layers, and the
    interleaved schedule's 4 stages are placed round-robin."""
    out = _run(
        [sys.executable, "-m", "meshlib", "plan", "--model", "llama-small", "--mesh", "dp=2,pp=2", "--batch", "8",
         "--microbatches", "4", "--schedule", "ScheduleInterleaved1F1B", "--chunks", "2", "--split-points", "1,2,3",
         "--zero", "1", "--json", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert "pipeline stages" in out and "balanced by user split points" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert [s["modules"] for s in plan["stages"]] == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    assert [s["rank"] for s in plan["stages"]] == [0, 1, 0, 1]
    assert plan["schedule"] == "interleaved-1f1b" and plan["microbatches"] == 4 and plan["zero"] == 1
    bad = subprocess.run(
        [sys.executable, "-m", "meshlib", "plan", "--model", "llama-small", "--mesh", "pp=2", "--microbatches", "2", "--split-points", "9"],
        capture_output=True, text=True, env=ENV,
    )  # fmt: skip
    assert bad.returncode == 2 and "split points [9] must be 1 distinct layer indices in 1..3" in bad.stderr


@pytest.mark.ranks
def test_main_job_exports_and_starts_from_weights(tmp_path):
    """`--export` writes the trained model; `--weights` starts another mesh's run from it, and the
    single-process reference, reading the same file, takes the same steps (fp64, 1e-12)."""
    out = str(tmp_path / "trained")
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "meshlib_torch", "run",
           "--model", "gpt-tiny", "--steps", "2", "--dtype", "float64"]  # fmt: skip
    first = _run(job + ["--mesh", "dp=2", "--export", out, "--no-reference"])
    assert f"exported the trained model to {out}" in first
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    again = _run(job + ["--mesh", "pp=2", "--microbatches", "2", "--weights", out])
    diffs = dict(re.findall(r"(loss \(every step\)|parameters after 2 steps) +│? *([0-9.e+-]+)", again))
    assert len(diffs) == 2 and all(float(v) < 1e-12 for v in diffs.values()), again
    start = [float(re.search(r"losses: first ([0-9.]+)", text).group(1)) for text in (first, again)]
    assert start[1] < start[0]  # the second run begins where the first one's training left the model
