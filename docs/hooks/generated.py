"""The mkdocs hook that fills the generated parts of the site at build time.

A page holds a marker line ``<!-- generated: NAME -->`` where a generated part goes; this hook
replaces it with the output of the generator of that name (settings, CLI, HTTP API, Helm values,
benchmark results), so those parts are built from the code on every ``mkdocs build`` and cannot
drift from it. An unknown name fails the build. The OpenAPI document is published beside the
HTTP reference as ``reference/openapi.json``. mkdocs loads this file by path (``hooks:`` in
``mkdocs.yml``), so its directory goes on ``sys.path`` for the generator modules beside it, and
the repository root before the installed packages, so the pages describe the checkout being built.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from bench_tables import benchmark_results  # noqa: E402
from ref_cli import cli_reference  # noqa: E402
from ref_helm import helm_values  # noqa: E402
from ref_http import http_routes, http_schemas, openapi_json  # noqa: E402
from ref_settings import settings_table  # noqa: E402

GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "cli": cli_reference,
    "http-routes": http_routes,
    "http-schemas": http_schemas,
    "helm-values": helm_values,
    "benchmarks": benchmark_results,
}
MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z-]+) -->$", re.MULTILINE)


def fill(markdown: str, page: str) -> str:
    """``markdown`` with each marker replaced by its generator's output.

    Raises:
        KeyError: a marker names no generator (the build stops, naming the page).
    """
    def generate(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise KeyError(f"{page}: no generator named {name!r} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)


def on_page_markdown(markdown, page, config, files):  # mkdocs hook
    return fill(markdown, page.file.src_uri)


def on_files(files, config):  # mkdocs hook
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/openapi.json", content=openapi_json()))
    return files
