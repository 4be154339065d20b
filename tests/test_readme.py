"""Every example in README.md runs as written, in the environment its install line builds.

Method: the README is read at collection time. Its fenced blocks are ```python
snippets and ```bash commands (a block in any other language fails
`test_readme_blocks_are_python_or_bash`, so none is skipped unseen). The main
command, between the `main-command` markers, is split at its last `pip
install`: the part up to there is the install line, and a session fixture runs
it once, exactly as written, from the repository root, with only the venv's
directory moved to a temporary one. Every example then runs with that venv
activated (its `bin` first on PATH, no PYTHONPATH, this interpreter's venv off
PATH), each in its own empty working directory:

- the rest of the main command, and every other ```bash block, as a bash
  script under `set -euo pipefail`, so a block's commands run in order in one
  directory (`--export gpt-tiny-5`, then `--weights gpt-tiny-5`); a script whose text has already
  run to success in this venv (the main command's run part is also the first `meshlib run`
  block) passes without training again;
- a ```python snippet that calls `parallelize` is a training script: it runs
  under `python -m torch.distributed.run --nproc-per-node N`, N the size of the
  `Mesh(...)` it builds (read from its syntax tree); any other snippet runs
  under `python`.

The test command (between the `test-command` markers) runs pytest, this suite
itself, so only its install part is checked: it must pin the same torch as the
main command. The fine-tuning snippet reads the checkpoint directory
`save_pretrained` wrote (`path = "gpt2-small"`): a GPT-2 of two small layers
and GPT-2's vocabulary, randomly initialized with transformers (no download),
is saved there first, and the directory its `export` wrote must load back with
transformers' `from_pretrained`, as the snippet's comment says. For the line
that plans your own model (`--model mypkg.model:build`), a small `mypkg/model.py`
with `build()` and `rules(mesh)` is written into the directory first. torchrun's
rendezvous port comes from PET_MASTER_PORT, set to a free port, so the
commands run as written without colliding with another job's default port.

MESHLIB_README_VENV=/path/to/venv runs the examples in that venv instead of
building one (for instance `MESHLIB_README_VENV=$VIRTUAL_ENV` in a dev venv
that has meshlib installed); building it takes about half a minute here, since
pip finds torch on local disk.
"""

from __future__ import annotations

import ast
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
TIMEOUT = 900  # per example; the slowest takes 30-90 s on 2 CPU cores, depending on the load


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    heading: str  # the nearest heading above it
    marker: str  # "main-command", "test-command" or ""

    @property
    def name(self) -> str:
        """`python:<heading>`, `bash:<marker>`, or `bash:<program>-<ranks>-<model>` from the first command."""
        if self.marker or self.lang != "bash":
            return f"{self.lang}:{self.marker or re.sub(r'[^a-z0-9]+', '-', self.heading.lower()).strip('-')}"
        words = shlex.split(self.code.splitlines()[0], comments=True)
        after = {flag: value for flag, value in zip(words, words[1:])}
        command = words[1] if len(words) > 1 and not words[1].startswith("-") else None  # `meshlib plan`
        picked = [words[0], command, after.get("--nproc-per-node"), after.get("--model")]
        return "bash:" + "-".join(w for w in picked if w)


def _blocks() -> list[Block]:
    blocks = []
    for match in FENCE.finditer(README):
        before = README[: match.start()]
        headings = re.findall(r"^#+ (.+)$", before, re.M)
        opened = re.findall(r"<!-- (/?)([\w-]+) -->", before)
        marker = opened[-1][1] if opened and not opened[-1][0] else ""
        blocks.append(Block(match.group(1), match.group(2), headings[-1] if headings else "", marker))
    return blocks


def _ids(blocks: list[Block]) -> list[str]:
    """Each block's name, numbered where names repeat (three snippets under one heading)."""
    names = [b.name for b in blocks]
    return [f"{n}-{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


BLOCKS = _blocks()


def _marked(marker: str) -> str:
    (block,) = [b for b in BLOCKS if b.marker == marker]
    return block.code.strip()


def _split_install(command: str) -> tuple[str, str]:
    """(install part, the rest): the install part ends with the last `pip install`."""
    steps = [step.strip() for step in command.split("&&")]
    last = max((i for i, step in enumerate(steps) if step.startswith("pip install")), default=None)
    if last is None:
        raise ValueError(f"no `pip install` in the README command {command!r}")
    return " && ".join(steps[: last + 1]), " && ".join(steps[last + 1 :])


INSTALL, MAIN_RUN = _split_install(_marked("main-command"))
EXAMPLES = [b for b in BLOCKS if b.lang in ("python", "bash") and b.marker != "test-command"]


# --- the venv -----------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    """This process's environment without its venv: a shell as a fresh machine's user has it."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    ours = {os.path.realpath(Path(sys.prefix) / "bin"), os.path.realpath(Path(sys.executable).parent)}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) not in ours]
    env["PATH"] = os.pathsep.join(path)
    env["COLUMNS"] = "120"
    return env


def _build_venv(where: Path) -> float:
    """Run the README's install line from the repository root, its venv made at `where`. Returns seconds."""
    name = re.search(r"-m venv (\S+)", INSTALL)
    if name is None:
        raise ValueError(f"the README's install line makes no venv: {INSTALL!r}")
    script = INSTALL.replace(f"-m venv {name.group(1)}", f"-m venv {shlex.quote(str(where))}")
    script = script.replace(f"{name.group(1)}/bin/", f"{shlex.quote(str(where))}/bin/")
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=_clean_env(), capture_output=True, text=True
    )
    if proc.returncode:
        pytest.fail(f"the README's install line failed ({proc.returncode}):\n$ {script}\n{_tail(proc)}")
    return time.perf_counter() - start


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Iterator[Path]:
    """The venv the README's install line builds (or MESHLIB_README_VENV's)."""
    given = os.environ.get("MESHLIB_README_VENV")
    if given:
        yield Path(given)
        return
    where = tmp_path_factory.mktemp("readme") / "venv"
    seconds = _build_venv(where)
    print(f"\nbuilt the README's venv in {seconds:.0f} s: {INSTALL}")
    yield where
    shutil.rmtree(where, ignore_errors=True)  # over a GiB with torch


def _env(venv: Path) -> dict[str, str]:
    env = _clean_env()
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env["PATH"]])
    with socket.socket() as sock:  # torchrun's default port may be another job's
        sock.bind(("127.0.0.1", 0))
        env["PET_MASTER_PORT"] = str(sock.getsockname()[1])
    return env


def _tail(proc: subprocess.CompletedProcess) -> str:
    """The first traceback (under torchrun, the first failing rank's) with what came before it (a rank
    killed by a signal prints no traceback: torchrun's own comes first), and the output's last lines."""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not re.match(r"[WIE]\d{4} ", line)]
    first = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
    if first is None:
        return "\n".join(lines[-40:])
    head, rest = lines[max(0, first - 30) : first + 40], lines[first + 40 :]
    return "\n".join([*head, *(["...", *rest[-25:]] if rest else [])])


def _run(args: list[str], cwd: Path, venv: Path, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=_env(venv), capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode:
        pytest.fail(f"{what} exited with {proc.returncode} in {cwd}:\n{_tail(proc)}", pytrace=False)
    return proc


# --- what a snippet needs -----------------------------------------------------------------------


def _ranks(code: str) -> int:
    """1, or for a snippet that calls `parallelize`, the size of the one `Mesh(...)` it builds."""
    tree = ast.parse(code)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    if not any(call.func.id == "parallelize" for call in calls):
        return 1
    sizes = {_mesh_size(call) for call in calls if call.func.id == "Mesh"}
    if len(sizes) != 1:
        raise ValueError(f"a training snippet should build one size of Mesh(...), not {sorted(sizes)}:\n{code}")
    return sizes.pop()


def _mesh_size(call: ast.Call) -> int:
    """`Mesh(dp=2, tp=4)` or `Mesh((2, 4), ("dp", "tp"))`: 8."""
    if call.keywords:
        return math.prod(ast.literal_eval(k.value) for k in call.keywords)
    return math.prod(ast.literal_eval(call.args[0]))


GPT2_SMALL = """
import sys
import torch, transformers
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)   # GPT-2's vocabulary and positions, two small layers
transformers.GPT2LMHeadModel(cfg).save_pretrained(sys.argv[1])
"""

RELOAD = """
import sys, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, sum(p.numel() for p in model.parameters()))
"""

# `meshlib plan --model mypkg.model:build --rules mypkg.model:rules`: a user's own small model and its rules
USER_MODEL = Path(__file__).with_name("user_model.py")


def _prepare(code: str, cwd: Path) -> list[str]:
    """Write what the example reads into `cwd`; return the directories it exports, to check after."""
    if "mypkg.model:" in code:
        (cwd / "mypkg").mkdir()
        (cwd / "mypkg" / "__init__.py").write_text("")
        shutil.copy(USER_MODEL, cwd / "mypkg" / "model.py")
    if '"gpt2-small"' not in code:
        return []
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", GPT2_SMALL, "gpt2-small"], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, _tail(proc)
    return re.findall(r'export\([^)]*?"([^"]+)"', code)


# --- the tests ----------------------------------------------------------------------------------


def test_readme_blocks_are_python_or_bash():
    assert BLOCKS, "README.md has no fenced code blocks"
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, [b.name for b in BLOCKS if b.lang not in ("python", "bash")]


def test_test_command_installs_like_the_main_command():
    install, rest = _split_install(_marked("test-command"))
    pin = re.compile(r"pip install[^&]*?\btorch==\S+")
    assert pin.search(install) and pin.search(install).group() == pin.search(INSTALL).group(), (install, INSTALL)
    assert "python -m pytest" in rest


# the bash scripts that have run to success in this session's venv: the same commands, in the same venv,
# from another empty directory are the same run
_PASSED: set[str] = set()


@pytest.mark.parametrize("block", EXAMPLES, ids=_ids(EXAMPLES))
def test_readme_example_runs(block, venv, tmp_path):
    if block.lang == "bash":
        script = MAIN_RUN if block.marker == "main-command" else block.code
        assert script.strip(), f"the README's {block.name} runs nothing after its install part"
        if script.strip() in _PASSED:
            return
        _prepare(script, tmp_path)
        _run(["bash", "-euo", "pipefail", "-c", script], tmp_path, venv, f"the README's commands\n{script}\n")
        _PASSED.add(script.strip())
        return
    exported = _prepare(block.code, tmp_path)
    (tmp_path / "snippet.py").write_text(block.code)
    python = str(venv / "bin" / "python")
    ranks = _ranks(block.code)
    launch = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks > 1 else [python]
    _run([*launch, "snippet.py"], tmp_path, venv, f"the README's snippet ({' '.join(launch[1:])} snippet.py)")
    for path in exported:  # "transformers' from_pretrained reads it"
        _run([python, "-c", RELOAD, path], tmp_path, venv, f"from_pretrained({path!r})")
