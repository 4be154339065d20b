"""Layout pictures: which rank holds which block of a tensor.

The last two dims form a grid of blocks; each leading dim that is split adds
panels, one per block of that dim, so an N-D tensor on a 1-, 2- or 3-D mesh
reads as a row of 2-D grids. Each cell lists the ranks that hold the block
(replicas share a cell). Shown as plain text, with rich in a terminal, and as
HTML in a notebook.

Example:
    >>> print(layout(NamedSharding(Mesh(dp=2, tp=2), P("dp", "tp")), (4, 4)))
    NamedSharding(Mesh(dp=2, tp=2), P('dp', 'tp')) on shape (4, 4)
                 dim 1 [0:2]  dim 1 [2:4]
    dim 0 [0:2]  0            1
    dim 0 [2:4]  2            3
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence

from .mesh import Mesh
from .sharding import NamedSharding, block_index
from .spec import P

__all__ = ["layout", "Layout"]

_PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)  # fmt: skip


def _ranks_text(ranks: Sequence[int]) -> str:
    """`0-3,8` for (0, 1, 2, 3, 8)."""
    parts, run = [], [ranks[0]]
    for r in ranks[1:]:
        if r == run[-1] + 1:
            run.append(r)
        else:
            parts.append(run)
            run = [r]
    parts.append(run)
    return ",".join(f"{p[0]}-{p[-1]}" if len(p) > 2 else ",".join(map(str, p)) for p in parts)


def _span(s: slice, size: int) -> str:
    start, stop, _ = s.indices(size)
    return f"[{start}:{stop}]"


class Layout:
    """The picture of one tensor's layout; print it, or show it in a notebook."""

    def __init__(self, sharding: NamedSharding, shape: Sequence[int]):
        self.sharding = sharding
        self.shape = tuple(shape)
        rank_slices = sharding.rank_indices(self.shape)
        # A block is (start, stop, block number) per dim: under uneven="chunk" several
        # empty blocks share (n, n) but are different blocks, held by different ranks.
        index = [block_index(sharding.mesh, sharding.spec.dim_axes(d)) for d in range(len(self.shape))]
        self.blocks: dict[tuple, list[int]] = {}
        for rank, slices in enumerate(rank_slices):
            key = tuple(s.indices(n)[:2] + (ix[rank],) for s, n, ix in zip(slices, self.shape, index))
            self.blocks.setdefault(key, []).append(rank)
        nd = len(self.shape)
        self.grid_dims = tuple(range(max(0, nd - 2), nd))
        self.panel_dims = tuple(range(0, max(0, nd - 2)))
        self._cuts = [sorted({k[d] for k in self.blocks}) for d in range(nd)]

    def __repr__(self) -> str:
        return f"layout({self.sharding!r}, {self.shape})"

    @property
    def title(self) -> str:
        return f"{self.sharding!r} on shape {self.shape}"

    def _label(self, dim: int, cut: tuple[int, int, int]) -> str:
        return f"dim {dim} [{cut[0]}:{cut[1]}]"

    def panels(self):
        """`(panel title, row labels, column labels, cells)`; cells are rank lists."""
        rows_dim = self.grid_dims[0] if len(self.grid_dims) == 2 else None
        cols_dim = self.grid_dims[-1] if self.grid_dims else None
        row_cuts = self._cuts[rows_dim] if rows_dim is not None else [None]
        col_cuts = self._cuts[cols_dim] if cols_dim is not None else [None]
        for lead in itertools.product(*(self._cuts[d] for d in self.panel_dims)):
            title = ", ".join(self._label(d, c) for d, c in zip(self.panel_dims, lead))
            cells = []
            for rc in row_cuts:
                row = []
                for cc in col_cuts:
                    key = lead + tuple(c for c in (rc, cc) if c is not None)
                    row.append(self.blocks.get(key, []))
                cells.append(row)
            rlabels = [self._label(rows_dim, c) if c else "" for c in row_cuts]
            clabels = [self._label(cols_dim, c) if c else "" for c in col_cuts]
            yield title, rlabels, clabels, cells

    def _color(self, ranks: Sequence[int]) -> str:
        keys = list(self.blocks)
        for i, key in enumerate(keys):
            if self.blocks[key] == list(ranks):
                return _PALETTE[i % len(_PALETTE)]
        return "#ffffff"

    def _empty_note(self) -> str:
        empty = sorted(r for k, rs in self.blocks.items() if any(a == b for a, b, _ in k) for r in rs)
        if not empty:
            return ""
        return (
            f"rank {empty[0]} holds an empty block"
            if len(empty) == 1
            else f"ranks {_ranks_text(empty)} hold empty blocks"
        )

    def __str__(self) -> str:
        out = [self.title]
        for title, rlabels, clabels, cells in self.panels():
            if title:
                out.append(f"-- {title}")
            table = [[""] + clabels] + [
                [rl] + [_ranks_text(c) if c else "-" for c in row] for rl, row in zip(rlabels, cells)
            ]
            widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
            out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
        note = self._empty_note()
        return "\n".join(out + ([note] if note else []))

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts = [Text(self.title, style="bold")]
        for title, rlabels, clabels, cells in self.panels():
            table = Table(title=title or None, show_lines=True)
            table.add_column("")
            for label in clabels:
                table.add_column(label, justify="center")
            for label, row in zip(rlabels, cells):
                styled = [Text(_ranks_text(c), style=f"black on {self._color(c)}") if c else Text("-") for c in row]
                table.add_row(label, *styled)
            parts.append(table)
        note = self._empty_note()
        if note:
            parts.append(Text(note))
        return Group(*parts)

    def _repr_html_(self) -> str:
        esc = html.escape
        out = [f"<div><b>{esc(self.title)}</b><div style='display:flex;gap:1em;flex-wrap:wrap'>"]
        for title, rlabels, clabels, cells in self.panels():
            head = "".join(f"<th>{esc(c)}</th>" for c in clabels)
            body = ""
            for label, row in zip(rlabels, cells):
                tds = "".join(
                    f"<td style='background:{self._color(c)};color:black;text-align:center;padding:4px 10px'>"
                    f"{esc(_ranks_text(c)) if c else '-'}</td>"
                    for c in row
                )
                body += f"<tr><th>{esc(label)}</th>{tds}</tr>"
            cap = f"<caption>{esc(title)}</caption>" if title else ""
            out.append(f"<table style='border-collapse:collapse'>{cap}<tr><th></th>{head}</tr>{body}</table>")
        note = self._empty_note()
        out.append("</div>" + (f"<p>{esc(note)}</p>" if note else "") + "</div>")
        return "".join(out)


def layout(
    sharding: NamedSharding | Mesh,
    shape_or_spec: Sequence[int] | P,
    shape: Sequence[int] | None = None,
    /,
    *,
    uneven: str = "error",
) -> Layout:
    """`layout(sharding, shape)` or `layout(mesh, spec, shape, uneven=...)`: the picture of a layout."""
    if isinstance(sharding, Mesh):
        if shape is None:
            raise TypeError("layout(mesh, spec, shape) needs the shape")
        return Layout(NamedSharding(sharding, shape_or_spec, uneven=uneven), shape)
    return Layout(sharding, shape_or_spec)
