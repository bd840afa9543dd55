"""Request bodies parsed as JSON by pydantic-core's parser (Rust) instead of the standard library's.

Place in the data flow: HTTP → auth and limits (middleware) → **here** (the route's body) →
FastAPI's validation of the body model → the route. A 10,000-job ``POST /v1/batches`` body is
about 2.5 MB: ``json.loads`` takes about twice as long as :func:`pydantic_core.from_json` on it.

When the route's body is one pydantic model, the body is validated as that model straight from
its bytes (``model_validate_json``: one pass, no Python objects in between) and FastAPI gets the
model itself, which it does not validate again; a body that fails that validation is parsed as
below and FastAPI validates it as before, so every 422 keeps FastAPI's own shape.

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

from fastapi import params
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
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


def body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of ``route``'s request body when it is one model taken whole (one body
    parameter, not embedded, not a form); else None."""
    fields = route.dependant.body_params
    if len(fields) != 1 or route.body_field is None:
        return None
    info = fields[0].field_info
    annotation = info.annotation
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    if getattr(info, "embed", False) or isinstance(info, params.Form):
        return None
    return annotation


class FastJSONRequest(Request):
    """A Starlette request whose :meth:`json` uses :func:`parse_json`, or validates the body as
    ``model`` first when one is set (see the module docstring)."""

    model: type[BaseModel] | None = None

    async def json(self) -> Any:
        """The body as ``model`` when it validates as one, else parsed by :func:`parse_json`
        (once; later calls return the same object)."""
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = parse_json(body) if self.model is None else self._as_model(self.model, body)
        return self._json

    @staticmethod
    def _as_model(model: type[BaseModel], body: bytes) -> Any:
        """``body`` validated as ``model``; when it is not one, :func:`parse_json`'s value, which
        FastAPI then validates itself (and answers its own 422)."""
        try:
            return model.model_validate_json(body)
        except ValidationError:
            return parse_json(body)


class FastJSONRoute(APIRoute):
    """An ``APIRoute`` whose endpoint receives a :class:`FastJSONRequest` (with the route's body
    model, :func:`body_model`): pass it as an ``APIRouter``'s ``route_class`` for routes that take
    large JSON bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, called with the request rewrapped as a :class:`FastJSONRequest`."""
        handler = super().get_route_handler()
        model = body_model(self)

        async def route(request: Request) -> Response:
            fast = FastJSONRequest(request.scope, request.receive)
            fast.model = model
            return await handler(fast)

        return route
