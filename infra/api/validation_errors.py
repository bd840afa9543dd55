"""Validation-error answers of the status API that are always valid, bounded JSON.

Data flow: HTTP body → FastAPI/pydantic validation → on failure, **this handler** → 422
``{"detail": [{"type", "loc", "msg", "input", …}]}``, the same shape as FastAPI's own (on the
paths of a compatible API with its own error shape, that shape: :mod:`infra.api.error_shapes`).

FastAPI's default handler echoes each error's ``input`` as given, so hostile input turned a
422 into a 500: ``1e999``, ``NaN`` and ``Infinity`` cannot be written as strict JSON, a lone
surrogate (``"\\ud800"``) cannot be encoded as UTF-8, and a 16 MiB prompt or a 1,000-deep
object came back whole (or overflowed the encoder's recursion). Here the echo is made safe:
non-finite floats become strings (``"inf"``), strings are cut to :data:`MAX_CHARS` with
unencodable characters escaped, containers are cut to :data:`MAX_ITEMS` entries and
:data:`MAX_DEPTH` levels, and exceptions in ``ctx`` become their message.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from infra.api.error_shapes import detail_body, shape_for

MAX_CHARS = 1000
MAX_ITEMS = 50
MAX_DEPTH = 12


def _text(value: str) -> str:
    if len(value) > MAX_CHARS:
        value = f"{value[:MAX_CHARS]}… ({len(value)} characters)"
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def safe_json(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data that strict JSON and UTF-8 can carry, bounded in size and depth."""
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, bytes):
        return _text(value.decode("utf-8", "backslashreplace"))
    if isinstance(value, BaseException):
        return _text(str(value))
    if depth >= MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        items = list(value.items())
        out = {_text(str(k)): safe_json(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS} more entries"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        listed = [safe_json(v, depth + 1) for v in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            listed.append(f"… {len(items) - MAX_ITEMS} more items")
        return listed
    return _text(str(value))


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with FastAPI's error list, made safe by :func:`safe_json`; on the path of an API family
    with its own error shape (:mod:`infra.api.error_shapes`), that family's 400 naming the first
    error's field and rule."""
    errors = list(exc.errors())
    shape = shape_for(request.url.path)
    if shape is detail_body:
        return JSONResponse({"detail": safe_json(errors)}, status_code=422)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    message = _text(f"{param}: {first['msg']}" if param else str(first["msg"]))
    return JSONResponse(shape(400, message, param, "invalid_value"), status_code=400)
