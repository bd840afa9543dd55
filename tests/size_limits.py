"""The size limits of the product's code, checked by ``make lint``: no module over 400 lines, no
class over 250, no function over 80 (tests apart).

Usage: ``python -m tests.size_limits PACKAGE…`` prints each module, class and function over its
limit, one per line (``path:line kind name lines``), and exits 1 if there is any; 0 otherwise.
Lines are counted as the file and the ``ast`` node span them (docstrings and comments included):
what a reader scrolls through.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: The most lines a module, a class and a function may have.
LIMITS = {"module": 400, "class": 250, "function": 80}


@dataclass(frozen=True)
class Oversize:
    """One module, class or function over its limit: where, what, and its lines."""

    path: Path
    line: int
    kind: str
    name: str
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.kind} {self.name} {self.lines} lines (limit {LIMITS[self.kind]})"


def oversized(path: Path) -> Iterator[Oversize]:
    """The module at ``path`` and every class and function in it that is over its limit.

    Raises:
        SyntaxError: the file is not Python.
    """
    source = path.read_text(encoding="utf-8")
    lines = len(source.splitlines())
    if lines > LIMITS["module"]:
        yield Oversize(path, 1, "module", path.stem, lines)
    for node in ast.walk(ast.parse(source, filename=str(path))):
        kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else "class" if isinstance(node, ast.ClassDef) else None)
        if kind is None:
            continue
        span = (node.end_lineno or node.lineno) - node.lineno + 1
        if span > LIMITS[kind]:
            yield Oversize(path, node.lineno, kind, node.name, span)


def check(roots: list[str]) -> list[Oversize]:
    """Every oversize thing in the ``.py`` files under ``roots`` (folders or files), sorted by path."""
    found: list[Oversize] = []
    for root in map(Path, roots):
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            found.extend(oversized(path))
    return found


def main(argv: list[str]) -> int:
    """The command line (see the module docstring); returns the exit status."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    found = check(argv)
    for item in found:
        print(item)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
