"""The Helm values reference, generated from ``deploy/helm/renderfarm/values.yaml``.

Every key of the chart's values becomes a row with its dotted path, its default and the comment
lines written above it (or beside it) in the file, so the page says what the chart says. The
file is read as text, line by line: comments are not part of YAML's data model.
"""

from __future__ import annotations

import re
from pathlib import Path

from mdtable import cell, code, table

VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "renderfarm" / "values.yaml"
_KEY = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z0-9_.\-]+):(?P<rest>.*)$")


def _split_comment(rest: str) -> tuple[str, str]:
    quote = None
    for i, ch in enumerate(rest):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1] == " "):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def values_rows(path: Path = VALUES) -> list[tuple[str, str, str]]:
    """(dotted key, default, comment) for each key of ``path``; list items show as ``key[]``.

    Raises:
        FileNotFoundError: the chart's values file is missing.
    """
    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    block_indent: int | None = None
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        indent = len(raw) - len(raw.lstrip(" "))
        if block_indent is not None and (not stripped or indent > block_indent):
            continue  # inside a literal block scalar (| or >)
        block_indent = None
        if not stripped:
            comments = []
            continue
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(raw)
        if match is None:
            comments = []
            continue
        level = indent + (2 if match["dash"] else 0)
        while stack and stack[-1][0] >= level:
            stack.pop()
        if match["dash"] and stack:
            stack[-1] = (stack[-1][0], stack[-1][1].removesuffix("[]") + "[]")
        value, trailing = _split_comment(match["rest"])
        key = ".".join([name for _, name in stack] + [match["key"]])
        if value in ("|", ">", "|-", ">-"):
            block_indent, value = indent, "(text block)"
        note = " ".join([*comments, trailing]).strip()
        rows.append((key, value, note))
        comments = []
        if not value:
            stack.append((level, match["key"]))
    return rows


def helm_values() -> str:
    """Markdown: the chart's values as a table (key, default, comment)."""
    rows = [(code(key), code(value) if value else "", cell(note)) for key, value, note in values_rows()]
    return table(("key", "default", "meaning"), rows)
