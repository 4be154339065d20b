"""What a per-shard function's collectives are, as data: one `Record` per collective it runs.

A dry run (`spmd.plan.region_collectives`) records them on meta tensors instead of running them;
an eager run counts the same bytes in `runtime.comm.COUNTER`. A ragged all-to-all (or an
all_to_all_v) moves as many rows as its data says, which a dry run cannot know: the caller declares
`Bound(rows)` or `Expected(rows)` (`lax.ragged_all_to_all(..., price=...)`), and the record says
which it was priced from (`priced`: "exact", "bound" or "expected").
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlib import Collective

__all__ = ["Bound", "Call", "Expected", "Record"]

PRICED = ("exact", "bound", "expected")


def _rows(cls: str, rows: object) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"{cls}(rows={rows!r}): rows is the number of rows this rank sends, a non-negative int")


@dataclass(frozen=True, slots=True)
class Bound:
    """At most `rows` rows leave this rank (a capacity): the dry run prices the worst case."""

    rows: int

    def __post_init__(self):
        _rows("Bound", self.rows)


@dataclass(frozen=True, slots=True)
class Expected:
    """About `rows` rows leave this rank on average (e.g. tokens*k*(ep-1)/ep under balanced routing)."""

    rows: int

    def __post_init__(self):
        _rows("Expected", self.rows)


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a collective in user code: its lax name, the user's line, and (ragged all-to-all,
    all_to_all_v) how a dry run prices the rows it sends. A backward pass reuses its forward's call."""

    op: str
    source: str = ""
    price: Bound | Expected | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """One collective of a per-shard function, per rank: `op` is the lax name (or "shard_map" for its
    boundary), `kind` the plan's kind, `bytes` the logical bytes it moves (as `runtime.comm.COUNTER`
    counts them), `source` the user's line that called it (in backward: the forward call it transposes)."""

    op: str
    kind: str
    axes: tuple[str, ...]
    group: int
    bytes: int
    phase: str
    source: str
    priced: str = "exact"

    def __post_init__(self):
        if self.priced not in PRICED:
            raise ValueError(f"Record priced={self.priced!r} is not one of {PRICED}")

    def __str__(self) -> str:
        price = "" if self.priced == "exact" else f" ({self.priced})"
        return f"{self.phase} {self.op} over {','.join(self.axes)}: {self.bytes} B{price} at {self.source}"

    def to_collective(self, *, node: str = "", count: int = 1, pp_rank: int = -1) -> Collective:
        """The plan's `Collective` for this record (the region's graph node as `node`)."""
        reason = f"shard_map lax.{self.op}" + ("" if self.priced == "exact" else f", priced from its {self.priced}")
        return Collective(
            self.kind, self.axes, self.bytes, node, self.op, self.source, reason, self.phase, count, self.group,
            pp_rank=pp_rank,
        )  # fmt: skip
