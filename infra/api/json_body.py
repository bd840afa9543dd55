"""Request bodies parsed as JSON by pydantic-core's parser (Rust) instead of the standard library's.

Place in the data flow: HTTP → auth and limits (middleware) → **here** (the route's body) →
FastAPI's validation of the body model → the route. A 10,000-job ``POST /v1/batches`` body is
about 2.5 MB: ``json.loads`` takes about twice as long as :func:`pydantic_core.from_json` on it.

Anything the fast parser refuses (invalid JSON, lone surrogate escapes, UTF-16 or BOM-prefixed
bodies, nesting deeper than its limit) is parsed again by ``json.loads``, exactly as Starlette
would, so every such body keeps the answer it had: the same value, or the same
``json.JSONDecodeError`` that FastAPI turns into its 422. Both parsers read duplicate keys as
the last one, and accept ``NaN``, ``Infinity`` and integers of any size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from pydantic_core import from_json
from starlette.requests import Request
from starlette.responses import Response


def parse_json(body: bytes) -> Any:
    """``body`` parsed as JSON: :func:`pydantic_core.from_json`, else ``json.loads`` (whose
    value or exception is then the answer).

    Raises:
        json.JSONDecodeError, UnicodeDecodeError, RecursionError: as ``json.loads(body)`` does.
    """
    try:
        return from_json(body)
    except ValueError:
        return json.loads(body)


class FastJSONRequest(Request):
    """A Starlette request whose :meth:`json` uses :func:`parse_json`."""

    async def json(self) -> Any:
        """The body parsed by :func:`parse_json` (once; later calls return the same object)."""
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """An ``APIRoute`` whose endpoint receives a :class:`FastJSONRequest`: pass it as an
    ``APIRouter``'s ``route_class`` for routes that take large JSON bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, called with the request rewrapped as a :class:`FastJSONRequest`."""
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return route
