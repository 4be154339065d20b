"""Execute the notebooks and store them in place with their outputs (pictures included).

The notebooks are stored executed so that their tables and figures show without running them.
Rerun this after a change that moves what they print (plan figures, schedules, memory):

    python notebooks/execute.py                      # every notebooks/*.ipynb
    python notebooks/execute.py notebooks/04_*.ipynb  # some of them

Each notebook runs top to bottom in a fresh `python3` kernel, with this directory as the working
directory and the repository root first on the kernel's PYTHONPATH, as `tests/test_notebooks.py`
runs them (it also checks that the stored outputs are not stripped). The kernel must belong to the
environment that has meshlib's `notebooks`, `plot` and `hf` extras; `jupyter kernelspec list` shows
which interpreter `python3` starts. Per-cell timing metadata is not recorded, so a rerun that prints
the same numbers leaves the files unchanged apart from the images' bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KERNEL = "python3"
CELL_TIMEOUT = 600


def execute(path: Path) -> None:
    """Run the notebook at `path` in a fresh kernel and write it back with its outputs."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT, record_timing=False, resources={"metadata": {"path": str(HERE)}}
    )
    client.execute()
    for cell in nb.cells:  # timings a Jupyter session or an older run left behind
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: every notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(HERE.glob("*.ipynb"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    failed = []
    for path in paths:
        start = time.perf_counter()
        try:
            execute(path.resolve())
        except Exception as err:  # a cell raised: leave this notebook as it was stored and go on
            failed.append(path.name)
            print(f"{path.name}: not stored, a cell failed:\n{err}", file=sys.stderr)
            continue
        size = path.stat().st_size / 1024
        print(f"{path.name}: {time.perf_counter() - start:.1f} s, {size:.0f} KiB", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
