"""The `meshlib` command: `plan` and `run` come from the installed backend (torch by default)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: meshlib {plan,run} ...\n\n"
            "  meshlib plan --model llama-7b --mesh dp=8,tp=4    compile on the meta device, print the plan\n"
            "  torchrun --nproc-per-node 4 -m meshlib_torch run --model gpt-tiny --mesh dp=2,tp=2\n\n"
            "`python -m meshlib` shows the core alone, with no torch."
        )
        return
    from ._backend import backend

    backend("torch").cli.main(argv)
