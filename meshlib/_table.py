"""One small table type, shown as plain text, with rich in a terminal, or as HTML.

rich is optional (the `rich` extra); without it tables print as aligned text.
"""

from __future__ import annotations

import html
import itertools
import textwrap
from collections.abc import Sequence


class Table:
    __slots__ = ("title", "columns", "rows", "caption")

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], caption: str = ""):
        self.title = title
        self.columns = tuple(columns)
        self.rows = [tuple("" if v is None else str(v) for v in row) for row in rows]
        self.caption = caption

    def __repr__(self) -> str:
        return f"Table({self.title!r}, {len(self.rows)} rows)"

    def to_text(self, max_width: int = 100) -> str:
        """Aligned columns. A cell with several lines, or one longer than `max_width`, continues on
        the following lines of its own column."""
        cells = [[_wrap(v, max_width) for v in row] for row in self.rows]
        widths = [len(c) for c in self.columns]
        for row in cells:
            widths = [max(w, *map(len, v)) for w, v in zip(widths, row)]
        line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
        out = [self.title] if self.title else []
        out += [line(self.columns), line(["-" * w for w in widths])]
        for row in cells:
            out += [line(vals) for vals in itertools.zip_longest(*row, fillvalue="")]
        if self.caption:
            out.append(self.caption)
        return "\n".join(out)

    def __rich__(self):
        from rich.table import Table as RichTable

        table = RichTable(title=self.title or None, caption=self.caption or None)
        for col in self.columns:
            table.add_column(col)
        for row in self.rows:
            table.add_row(*row)
        return table

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{esc(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in self.rows)
        title = f"<caption>{esc(self.title)}</caption>" if self.title else ""
        foot = f"<p>{esc(self.caption)}</p>" if self.caption else ""
        return f"<table>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{foot}"

    def __str__(self) -> str:
        return self.to_text()


def _wrap(value: str, width: int) -> list[str]:
    """The lines of a cell: its own line breaks, and lines longer than `width` broken at spaces."""
    return [piece for text in value.split("\n") for piece in (textwrap.wrap(text, width) or [""])]


def show(*items: object) -> None:
    """Print with rich when it is installed, else as plain text."""
    try:
        from rich.console import Console
    except ImportError:
        for item in items:
            print(item)
        return
    Console().print(*items)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
