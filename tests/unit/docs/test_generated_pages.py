"""The documentation site's generated parts (docs/hooks/) cover what the code declares: every
settings field, every registered command, every route of the OpenAPI schema, every key of the
Helm values and every benchmark result file. ``make docs`` (mkdocs build --strict) checks the
links; these check that nothing the code adds can be missing from the pages."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

import bench_tables  # noqa: E402
import generated  # noqa: E402
import ref_cli  # noqa: E402
import ref_helm  # noqa: E402
import ref_http  # noqa: E402
import ref_settings  # noqa: E402


def test_every_settings_field_has_a_row_with_its_variable_and_description():
    from infra.settings import Settings

    page = ref_settings.settings_table()
    for name, field in Settings.model_fields.items():
        row = next((line for line in page.splitlines() if f"`RENDERFARM_{name.upper()}`" in line
                    or f"`{name.upper()}`" in line), None)
        assert row is not None, name
        assert " ".join((field.description or "").split()).replace("|", "\\|") in row


def test_every_command_subcommand_and_option_is_on_the_cli_page():
    from infra.cli import build_parser

    page = ref_cli.cli_reference()
    pending = [(["renderfarm"], build_parser())]
    seen = 0
    while pending:
        path, parser = pending.pop()
        for name, sub in ref_cli._subcommands(parser).items():
            section = page.split(f"`{' '.join([*path, name])}`\n", 1)[1]
            options = [o for a in sub._actions if a.help != argparse.SUPPRESS
                       and not isinstance(a, argparse._HelpAction) for o in a.option_strings]
            for option in options:
                assert f"`{option}`" in section.split("\n#", 1)[0], (path, name, option)
            pending.append(([*path, name], sub))
            seen += 1
    assert seen >= 12  # the entry points of pyproject.toml, and bench's and cache's subcommands


def test_every_route_of_the_openapi_schema_is_listed():
    schema = ref_http.openapi_schema()
    page = ref_http.http_routes()
    for path, item in schema["paths"].items():
        for method in item:
            if method in ref_http._METHODS:
                assert f"`{method.upper()} {path}`" in page
    assert json.loads(ref_http.openapi_json())["paths"].keys() == schema["paths"].keys()


def _leaf_paths(value: object, prefix: str = "") -> set[str]:
    if isinstance(value, dict) and value:
        return set().union(*(_leaf_paths(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in value.items()))
    return {prefix}


def test_every_helm_value_is_listed_with_the_comment_above_it():
    values = yaml.safe_load(ref_helm.VALUES.read_text())
    rows = {key: (default, note) for key, default, note in ref_helm.values_rows()}
    for path in _leaf_paths(values):
        # a leaf has its own row, or sits in a flow mapping ({cpu: "1"}) shown whole on its parent's
        parents = [path.rsplit(".", n)[0] for n in range(1, path.count(".") + 1)]
        assert path in rows or any(rows.get(p, ("",))[0].startswith("{") for p in parents), path
    assert rows["auth.required"][0] == "true"
    assert "Every /v1 route needs a tenant's API key" in rows["auth"][1]


def test_values_rows_reads_list_items_block_scalars_and_trailing_comments(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("# the pools\npools:\n  - name: cpu   # a pool's name\n    replicas: 2\n"
                      "script: |\n  echo a: b\nafter: 1\n")
    rows = {key: (default, note) for key, default, note in ref_helm.values_rows(values)}
    assert rows == {"pools": ("", "the pools"), "pools[].name": ("cpu", "a pool's name"),
                    "pools[].replicas": ("2", ""), "script": ("(text block)", ""), "after": ("1", "")}


def test_every_benchmark_file_has_a_section_that_names_its_machine():
    page = bench_tables.benchmark_results()
    for path in sorted(bench_tables.BENCHMARKS.glob("*.json")):
        section = page.split(f"## {path.stem}\n", 1)[1]
        assert section.lstrip().startswith("**Machine:**"), path.name
        assert f"Source: `docs/benchmarks/{path.name}`" in section


def test_an_unknown_marker_stops_the_build_naming_the_page():
    assert "| variable |" in generated.fill("<!-- generated: settings -->", "reference/settings.md")
    with pytest.raises(KeyError, match=re.escape("guides/x.md: no generator named 'nope'")):
        generated.fill("text\n<!-- generated: nope -->\n", "guides/x.md")
