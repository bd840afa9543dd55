"""Error bodies in the shape each API family's clients parse, by path prefix.

Place in the data flow: whatever answers an error before or instead of a route (the API-key
middleware's 401, the rate limits' 429/413, the 422 of a body that is not JSON) → **here** → the
body the client of that path expects. The farm's own routes (and the AUTOMATIC1111-compatible
ones, which share FastAPI's shape) answer ``{"detail": …}``; a compatible API whose clients expect
another shape registers it here (the OpenAI Images routes: ``{"error": {"message", "type",
"param", "code"}}``, :mod:`infra.api.compat.openai_images`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from starlette.responses import JSONResponse

#: ``(status, message, param, code) → body`` for one API family.
ErrorBody = Callable[[int, str, str | None, str | None], dict]

_SHAPES: dict[str, ErrorBody] = {}


def register(prefix: str, body: ErrorBody) -> None:
    """Answer errors on paths starting with ``prefix`` with ``body(status, message, param, code)``."""
    _SHAPES[prefix] = body


def detail_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The farm's (and FastAPI's) shape: ``{"detail": message}``."""
    return {"detail": message}


def shape_for(path: str) -> ErrorBody:
    """The error body builder of the longest registered prefix of ``path``, else :func:`detail_body`."""
    matches = [prefix for prefix in _SHAPES if path.startswith(prefix)]
    return _SHAPES[max(matches, key=len)] if matches else detail_body


def error_response(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSON error answer for ``path`` in its API family's shape."""
    return JSONResponse(shape_for(path)(status, message, param, code), status_code=status, headers=headers)
