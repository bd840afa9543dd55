"""The import graph of the farm's packages (and its benchmarks) has no circle, TYPE_CHECKING imports included.

A circle between two modules means neither can be read, tested or replaced alone; a type both
need belongs in a module both import (``pipeline.pool_options``), or one dependency turns around.
The graph is grimp's (the library under import-linter's contracts).
"""

from __future__ import annotations

import grimp

PACKAGES = ("bench", "pipeline", "infra", "producer", "worker")


def circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:  # iterative, so a deep graph cannot hit the recursion limit
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_the_circle_finder_sees_a_circle():
    graph = grimp.ImportGraph()
    for a, b in (("x.a", "x.b"), ("x.b", "x.c"), ("x.c", "x.a"), ("x.c", "x.d")):
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["x.a", "x.b", "x.c"]]


def test_no_module_of_the_farm_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in found)
