"""The HTTP API reference, generated from the status API's OpenAPI schema.

``infra.api.server.create_app`` builds the FastAPI app without connecting to anything (Redis and S3
are opened by its lifespan, which never runs here); ``app.openapi()`` is the same schema the API
serves at ``/openapi.json``. The page lists every route with its summary, parameters, request
body and responses; the whole schema is published beside it as ``openapi.json``.
"""

from __future__ import annotations

import json
from typing import Any

from mdtable import cell, code, table

_METHODS = ("get", "post", "put", "patch", "delete")


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI document of the status API with the default settings."""
    from infra.api.server import create_app
    from infra.settings import Settings

    return create_app(Settings()).openapi()


def openapi_json() -> str:
    """The OpenAPI document as indented JSON (the file published as ``reference/openapi.json``)."""
    return json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n"


def _ref_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_ref_name(s) for s in schema[key])
    if schema.get("type") == "array":
        return f"list of {_ref_name(schema.get('items', {}))}"
    return str(schema.get("type", "object"))


def _body(op: dict[str, Any]) -> str:
    content = op.get("requestBody", {}).get("content", {})
    return "; ".join(f"{code(_ref_name(c.get('schema', {})))} ({kind})" for kind, c in content.items())


def _summary(op: dict[str, Any]) -> str:
    """The first paragraph of the route's docstring (FastAPI's ``description``), else its summary."""
    description = op.get("description", "").strip()
    return description.split("\n\n", 1)[0] if description else op.get("summary", "")


def http_routes() -> str:
    """Markdown: one table row per route and method (summary, parameters, body, responses)."""
    schema = openapi_schema()
    rows = []
    for path, item in sorted(schema["paths"].items()):
        for method in _METHODS:
            op = item.get(method)
            if op is None:
                continue
            params = ", ".join(f"{code(p['name'])} ({p['in']})" for p in op.get("parameters", []))
            responses = ", ".join(sorted(op.get("responses", {})))
            rows.append((f"`{method.upper()} {cell(path)}`", cell(_summary(op)), params, _body(op), responses))
    return table(("route", "what it does", "parameters", "body", "responses"), rows)


def http_schemas() -> str:
    """Markdown: the fields of each request and response model of the schema."""
    out = []
    for name, model in sorted(openapi_schema().get("components", {}).get("schemas", {}).items()):
        props = model.get("properties", {})
        if not props:
            continue
        required = set(model.get("required", []))
        rows = [(code(field), code(_ref_name(spec)), "yes" if field in required else "",
                 code(spec["default"]) if "default" in spec else "", cell(spec.get("description", "")))
                for field, spec in props.items()]
        out += [f"### {name}", "", cell(model.get("description", "")), "",
                table(("field", "type", "required", "default", "meaning"), rows)]
    return "\n".join(out)
