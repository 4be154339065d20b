"""Every notebook in notebooks/ runs top to bottom without a cell error.

Method: nbclient executes each `notebooks/*.ipynb` in a fresh `python3` kernel
(600 s per cell) with the notebooks directory as its working directory, and
fails on the first cell that raises. The kernel must run this interpreter's
environment: a probe notebook asks the kernel for `sys.prefix`, and when it
differs (or there is no `python3` kernelspec) ipykernel's kernelspec is
installed into `sys.prefix`, and if another spec still shadows it, into a
temporary directory put first on JUPYTER_PATH. The repository root is
put on the kernel's PYTHONPATH, so the notebooks import this checkout of
meshlib whether or not it is pip-installed. New notebooks are picked up by the
glob with no change here.

The notebooks are stored executed, so that their tables and pictures show
without running them. The test executes a copy of the stored notebook and
fails when a code cell's stored outputs lack a kind (text, or a picture) that
the fresh run produced in that cell: a notebook stored stripped, or stored
before a cell that now draws a figure was run. `python notebooks/execute.py`
stores them executed.
"""

import copy
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT = 600

pytestmark = pytest.mark.notebook


def _execute(nb, cwd: Path) -> None:
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()


def _kernel_prefix() -> str:
    """`sys.prefix` as the `python3` kernel sees it, or why the kernel did not start."""
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.prefix)")])
    try:
        _execute(probe, ROOT)
    except Exception as err:  # no such kernelspec, or one whose interpreter cannot start
        return f"<no usable kernel: {type(err).__name__}: {err}>"
    return "".join(out.get("text", "") for out in probe.cells[0].outputs).strip()


def _same_env(prefix: str) -> bool:
    return os.path.realpath(prefix) == os.path.realpath(sys.prefix)


@pytest.fixture(scope="session")
def kernel(tmp_path_factory):
    """The `python3` kernel, checked to run this interpreter's environment."""
    from ipykernel.kernelspec import install

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        prefix = _kernel_prefix()
        if not _same_env(prefix):  # missing or foreign: install ipykernel's spec into this env
            install(prefix=sys.prefix)
            prefix = _kernel_prefix()
        if not _same_env(prefix):  # still shadowed (e.g. a user-level spec): put ours first on the path
            private = tmp_path_factory.mktemp("jupyter")
            install(prefix=str(private))
            jupyter_path = [str(private / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")]
            mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, jupyter_path)))
            prefix = _kernel_prefix()
        if not _same_env(prefix):
            pytest.fail(
                f"the {KERNEL!r} kernel runs in {prefix}, not in this interpreter's environment "
                f"{sys.prefix!r}. See `{sys.executable} -m jupyter kernelspec list`"
            )
        yield KERNEL


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(kernel, path):
    stored = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(stored)
    _execute(fresh, path.parent)
    lost = {
        number: sorted(_kinds(new.outputs) - _kinds(old.outputs))
        for number, (old, new) in enumerate(zip(stored.cells, fresh.cells))
        if new.cell_type == "code" and not _kinds(new.outputs) <= _kinds(old.outputs)
    }
    if lost:
        cells = "; ".join(f"cell {number}: {', '.join(kinds)}" for number, kinds in lost.items())
        pytest.fail(
            f"{path.name} is stored without outputs that executing it produces ({cells}). "
            f"Store it executed: python notebooks/execute.py notebooks/{path.name}"
        )


def _kinds(outputs) -> set[str]:
    """What a cell's outputs show: "picture" for an image, "text" for anything else (streams, reprs, errors)."""
    return {"picture" if any(mime.startswith("image/") for mime in out.get("data", {})) else "text" for out in outputs}
