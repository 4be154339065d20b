"""How many identical ops each op dispatched now stands for, in a dry run.

A dry run runs the step on meta tensors, where no value is read, to count what each rank computes
(`compiler.estimates.opcount.OpCounter`) and track its memory. Where a loop repeats the same ops on
same-shaped pieces (the query tiles of an attention block), one pass can stand for all of them: the
loop runs it once inside `standing_for(n)`, and the counter counts each op `n` times. Outside a dry
run nothing reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["standing_for", "times"]

_TIMES = [1]


@contextmanager
def standing_for(n: int) -> Iterator[None]:
    """Ops dispatched inside count `n` times each (0: not at all) in an `OpCounter`."""
    _TIMES.append(_TIMES[-1] * n)
    try:
        yield
    finally:
        _TIMES.pop()


def times() -> int:
    """How many ops each op dispatched now stands for."""
    return _TIMES[-1]
