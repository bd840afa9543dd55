"""Markdown tables for the generated reference pages: one helper, so every page escapes alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(value: object) -> str:
    """One table cell: ``|`` escaped and line breaks folded, so no value can break its row."""
    text = "" if value is None else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def code(value: object) -> str:
    """A cell in backticks (a name, a default); empty stays empty."""
    text = cell(value)
    return f"`{text}`" if text else ""


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; cells are taken as already formatted (see :func:`cell`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
