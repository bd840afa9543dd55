"""Catalog items: reading a CSV or JSON Lines catalog into :class:`Item` objects.

Place in the data flow: catalog file → **items** → templates and content keys
(:mod:`producer.catalog.plan`) → the run (:mod:`producer.catalog.run`).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.textfiles import read_text_file


class CatalogError(ValueError):
    """The catalog file or the template cannot be used at all (exit status 2); the message says why."""


@dataclass
class Item:
    """One catalog entry: its 0-based ``index``, the 1-based ``line`` it ends on, its fields, or
    the ``problem`` that made the line unreadable."""

    index: int
    line: int
    fields: dict[str, Any]
    problem: str | None = None

    @property
    def id(self) -> str:
        """The item's ``id`` field, else ``line N``."""
        value = self.fields.get("id")
        return str(value) if value not in (None, "") else f"line {self.line}"


def detect_format(path: Path, text: str) -> str:
    """``csv`` or ``jsonl``: by extension (``.csv``; ``.jsonl``, ``.ndjson``, ``.json``), else by
    content (a first non-blank character ``{`` means JSON Lines)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    return "jsonl" if text.lstrip().startswith("{") else "csv"


def read_catalog(path: str | Path, fmt: str = "auto") -> tuple[str, list[Item]]:
    """Read every item of a catalog; returns ``(format, items)``.

    CSV needs a header row; every cell is a string and an empty cell counts as absent. JSON Lines
    holds one object per non-blank line; values keep their JSON types. An unreadable line or row
    becomes an item with a ``problem`` (it fails alone).

    Raises:
        CatalogError: the file is missing, not UTF-8, empty, or a CSV header is unusable.
    """
    path = Path(path)
    text = read_text_file(path, "catalog", CatalogError)
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    items = _read_jsonl(text) if fmt == "jsonl" else _read_csv(path, text)
    if not items:
        raise CatalogError(f"catalog {path} holds no items")
    return fmt, items


def _read_csv(path: Path, text: str) -> list[Item]:
    reader = csv.DictReader(io.StringIO(text), restkey="\0extra")
    header = reader.fieldnames
    if not header:
        raise CatalogError(f"catalog {path}: a CSV catalog needs a header row")
    names = [h.strip() for h in header]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates or not all(names):
        raise CatalogError(f"catalog {path}: CSV header has " + (f"duplicate columns {duplicates}" if duplicates
                                                                   else "an empty column name"))
    reader.fieldnames = names
    items: list[Item] = []
    for row in reader:
        extra = row.pop("\0extra", None)
        fields = {k: v for k, v in row.items() if v not in (None, "")}
        problem = f"row has {len(extra)} more cell(s) than the header's {len(names)}" if extra else None
        items.append(Item(len(items), reader.line_num, fields, problem))
    return items


def _read_jsonl(text: str) -> list[Item]:
    items: list[Item] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            problem = None if isinstance(value, dict) else f"line is JSON {type(value).__name__}, not an object"
        except ValueError as exc:
            value, problem = {}, f"line is not valid JSON: {exc}"
        fields = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else {}
        items.append(Item(len(items), number, fields, problem))
    return items
