"""One small table type, shown as plain text, with rich in a terminal, or as HTML.

rich is optional (the `rich` extra). `show` draws tables with rich only in a terminal (or a
notebook); piped to a file or another program they print as plain aligned text at their full
width. Nothing is ever cut: a cell wraps at its spaces, never inside a word, so a parameter
name or a `file.py:NN` source line stays whole. A table too wide for the terminal even then
is drawn row by row as records (`Table.to_records`).
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
        the following lines of its own column (broken at spaces only: words stay whole)."""
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

    def to_records(self, width: int = 80) -> str:
        """Row by row, for a screen narrower than the table: each row's first cell on a line of its
        own, then `column: value` pairs flowing within `width`, words whole."""
        return "\n".join(line for line, _ in self._record_lines(width))

    def _record_lines(self, width: int) -> list[tuple[str, str]]:
        """(line, what it is: "title", "head", "body" or "caption") of `to_records`."""
        out = [(self.title, "title")] if self.title else []
        for row in self.rows:
            out += [("", "body")] + [(line, "head") for line in _wrap(row[0], width)]
            pairs = [f"{c}: {v}" for c, v in zip(self.columns[1:], row[1:]) if v]
            out += [(line, "body") for line in _flow(pairs, width, indent=4)]
        if self.caption:
            out += [("", "body")] + [(line, "caption") for line in _wrap(self.caption, width)]
        return out

    def __rich__(self):
        return _Fitted(self)

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{esc(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in self.rows)
        title = f"<caption>{esc(self.title)}</caption>" if self.title else ""
        foot = f"<p>{esc(self.caption)}</p>" if self.caption else ""
        return f"<table>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{foot}"

    def __str__(self) -> str:
        return self.to_text()


class _Fitted:
    """A `Table` drawn by rich at the width it is given: natural widths when they fit; else columns
    narrowed no further than their longest word; else, if even that is too wide, as records."""

    def __init__(self, table: Table):
        self.table = table

    def _bounds(self) -> tuple[list[int], list[int]]:
        """Per column, (the widest line, the longest word), headers included."""
        cols = list(zip(self.table.columns, *self.table.rows))
        widest = [max(len(line) for v in col for line in v.split("\n")) for col in cols]
        word = [max((len(w) for v in col for w in v.split()), default=1) for col in cols]
        return widest, word

    def _chrome(self) -> int:
        return 3 * len(self.table.columns) + 1  # rich's box: a rule between columns and one space either side

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        widest, _ = self._bounds()
        return Measurement(min(options.max_width, 20), sum(widest) + self._chrome())

    def __rich_console__(self, console, options):
        from rich.table import Table as RichTable
        from rich.text import Text

        t, room = self.table, options.max_width
        widest, word = self._bounds()
        if sum(word) + self._chrome() > room:
            styles = {"title": "bold", "head": "bold", "body": "", "caption": "dim"}
            yield Text("\n").join(Text(line, style=styles[kind]) for line, kind in t._record_lines(room))
            return
        widths = widest if sum(widest) + self._chrome() <= room else _share(widest, word, room - self._chrome())
        table = RichTable(title=t.title or None, caption=t.caption or None)
        for col, w in zip(t.columns, widths):
            table.add_column(col, width=w, overflow="fold")
        for row in t.rows:
            table.add_row(*row)
        yield table


def _share(widest: list[int], word: list[int], room: int) -> list[int]:
    """Column widths that sum to `room`: each at least its longest word, the space left over
    given in proportion to how much more each column would take."""
    widths = list(word)
    want = [m - w for m, w in zip(widest, word)]
    spare, total = room - sum(widths), sum(want)
    if total:
        widths = [w + spare * x // total for w, x in zip(widths, want)]
    return widths


def _wrap(value: str, width: int) -> list[str]:
    """The lines of a cell: its own line breaks, and lines longer than `width` broken at spaces
    (a word longer than `width` stays whole on a line of its own)."""
    return [
        piece
        for text in value.split("\n")
        for piece in (textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""])
    ]


def _flow(pieces: list[str], width: int, *, indent: int) -> list[str]:
    """`pieces` placed side by side, three spaces apart, in lines of at most `width` (a piece
    wider than a line wraps at its spaces)."""
    pad, lines, line = " " * indent, [], ""
    for piece in pieces:
        if line and len(line) + 3 + len(piece) <= width:
            line += "   " + piece
            continue
        if line:
            lines.append(line)
        parts = _wrap(piece, max(width - indent, 20))
        lines += [pad + p for p in parts[:-1]]
        line = pad + parts[-1]
    return lines + ([line] if line else [])


def show(*items: object) -> None:
    """Print with rich in a terminal or a notebook; anywhere else (a pipe, a file, no rich) as
    plain text at full width."""
    try:
        from rich.console import Console
    except ImportError:
        console = None
    else:
        console = Console()
    if console is None or not (console.is_terminal or console.is_jupyter):
        print("\n\n".join(map(str, items)))
        return
    console.print(*items)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
