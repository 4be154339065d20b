"""Where a node came from: the user's source line, outside torch, meshlib's compiler and its shard_map."""

from __future__ import annotations

import re
import traceback

import torch.fx as fx

TORCH_DIR = re.compile(r"[/\\](torch|meshlib_torch[/\\](compiler|spmd))[/\\]")


def source_line(node: fx.Node) -> str:
    """`file.py:LINE` of the user code that made `node` (outside torch itself)."""
    if node.op == "output":
        return "(graph output)"
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    user = [(f, ln) for f, ln in frames if not TORCH_DIR.search(f)]
    if not user:
        return ""
    path, line = user[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def reason(err: BaseException) -> str:
    """`Type: first line of the message at file.py:LINE`."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{where(err)}"


def where(err: BaseException) -> str:
    """` at file.py:LINE`: the last frame of user code in the traceback."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not TORCH_DIR.search(f.filename)]
    return f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""



__all__ = ["TORCH_DIR", "reason", "source_line", "where"]
