"""Rich text for the terminal: tables of name-value pairs, lists of problems, plain text.

Knows nothing of what it shows: the plan and the layout build their own views from these."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

__all__ = ["cell", "pairs", "problems_view", "to_text"]


def cell(value: Any) -> str:
    """A table cell: a dash for None, thousands separators for integers."""
    return "—" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def pairs(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    """A titled two-column table of names and values."""
    table = Table(title=title, title_justify="left", show_header=False, box=None,
                  padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows:
        table.add_row(key, cell(value))
    return table


def problems_view(title: str, problems: Iterable[tuple[str, str]]) -> Group:
    """``title: N problems`` and a line per (location, message)."""
    rows = list(problems)
    parts: list[Any] = [Text(f"{title}: {len(rows)} problem{'s' * (len(rows) != 1)}",
                             style="bold red")]
    parts += [Text.assemble(("  • ", "red"), (loc, "bold"), f": {msg}") for loc, msg in rows]
    return Group(*parts)


def to_text(renderable: Any, width: int = 100) -> str:
    """``renderable`` as plain text ``width`` columns wide."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()
