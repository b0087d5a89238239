"""Tables a person reads (``trajbus stats``, ``trajbus topics``, the demo's summary, the benchmarks).

Drawn by rich, so each column is as wide as its widest cell and two titles never run
together (hand-padded ``f"{title:>11}"`` columns did: ``policygw in flight``). On a
terminal a table takes the terminal's width and wraps a cell before it squeezes a
column; piped or captured, it takes the width it needs, so a log or a test sees whole lines.
"""

from __future__ import annotations

import io
import re
import sys
from typing import IO, Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["render", "print_table"]

UNBOUNDED = 10_000
"""The width given to a console that is not a terminal: the table's own width decides."""


NUMBER = re.compile(r"[+-]?(\d[\d,]*(\.\d*)?|\.\d+)(e[+-]?\d+)?( ?[x%]| ms| s| MB)?|n/a|-", re.I)
"""A cell read as a number: 1,234  -0.5  +1.2e-03  0.98x  12%  3.1 s (and the placeholders n/a, -)."""


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and NUMBER.fullmatch(value) is not None)


def build(columns: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> Table:
    """A rich ``Table``: numeric columns (every cell a number, or a number formatted by the caller to
    the precision a reader needs) right-aligned."""
    rows = [list(row) for row in rows]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  header_style="bold", title_style="bold")
    for index, name in enumerate(columns):
        cells = [row[index] for row in rows if index < len(row) and row[index] not in (None, "")]
        numeric = bool(cells) and all(_is_number(cell) for cell in cells)
        table.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    return table


def _console(file: IO[str]) -> Console:
    terminal = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, width=None if terminal else UNBOUNDED, highlight=False, soft_wrap=False,
                   no_color=not terminal)


def render(columns: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> str:
    """The table as text, lines without trailing blanks (for a report that is written, not printed)."""
    buffer = io.StringIO()
    _console(buffer).print(build(columns, rows, title))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def print_table(columns: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None,
                file: IO[str] | None = None) -> None:
    """Print the table to ``file`` (stdout), at the terminal's width when it is one."""
    file = file or sys.stdout
    if hasattr(file, "isatty") and file.isatty():
        _console(file).print(build(columns, rows, title))
    else:
        print(render(columns, rows, title), file=file)
