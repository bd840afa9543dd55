"""FastJSONRoute (infra/api/json_body.py): a body validated from its bytes reaches the handler
as the same model FastAPI builds, and every refused body gets FastAPI's own 422, byte for byte:
the same app routed both ways answers alike."""

from __future__ import annotations

import json

import pytest
from fastapi import APIRouter, FastAPI, Form
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from infra.api.json_body import FastJSONRoute, body_model
from infra.schemas import BatchSubmission


def _routes(route_class: type[APIRoute]) -> list[APIRoute]:
    router = APIRouter(route_class=route_class)

    @router.post("/batches")
    async def submit(body: BatchSubmission) -> dict:
        return {"type": type(body).__name__, "body": body.model_dump(mode="json")}

    @router.post("/form")
    async def form(name: str = Form(...)) -> dict:
        return {"name": name}

    return [r for r in router.routes if isinstance(r, APIRoute)]


def _app(route_class: type[APIRoute]) -> FastAPI:
    app = FastAPI()
    app.router.routes.extend(_routes(route_class))
    return app


# without the farm's error handlers a 422 naming a NaN input cannot be written: a 500 either way
FAST = TestClient(_app(FastJSONRoute), raise_server_exceptions=False)
PLAIN = TestClient(_app(APIRoute), raise_server_exceptions=False)

BODIES = [
    b'{"jobs": [{"prompt": "a cat", "seed": 3, "width": 512, "metadata": {"k": "v"}}], "priority": "high"}',
    b'{"jobs": [{"prompt": "a cat", "width": 100}, {"prompt": " "}]}',       # rule errors, two jobs
    b'{"jobs": [{"prompt": "a cat", "colour": "red"}]}',                     # extra field
    b'{"jobs": []}',                                                         # too few
    b'{"jobs": [{"prompt": "a cat"}',                                        # not JSON
    b'{"jobs": [{"prompt": "a cat", "guidance_scale": NaN}]}',               # NaN: json.loads reads it
    b'{"jobs": [{"prompt": "a cat", "metadata": {"k": "\\ud800"}}]}',        # a lone surrogate
    b'[1, 2]',
    b'',
]


@pytest.mark.parametrize("body", BODIES)
def test_same_answer_as_fastapi(body: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    fast, plain = FAST.post("/batches", content=body, headers=headers), PLAIN.post("/batches", content=body,
                                                                                     headers=headers)
    assert (fast.status_code, fast.content) == (plain.status_code, plain.content)


def test_valid_body_reaches_the_handler_as_the_model() -> None:
    answer = FAST.post("/batches", content=BODIES[0], headers={"Content-Type": "application/json"})
    assert answer.status_code == 200
    assert answer.json() == {"type": "BatchSubmission",
                             "body": BatchSubmission.model_validate(json.loads(BODIES[0])).model_dump(mode="json")}


def test_other_content_types_and_forms_stay_fastapis() -> None:
    text = FAST.post("/batches", content=BODIES[0], headers={"Content-Type": "text/plain"})
    assert (text.status_code, text.json()) == (
        422, PLAIN.post("/batches", content=BODIES[0], headers={"Content-Type": "text/plain"}).json())
    assert FAST.post("/form", data={"name": "x"}).json() == {"name": "x"}
    routes = {r.path: r for r in _routes(FastJSONRoute)}
    assert body_model(routes["/batches"]) is BatchSubmission
    assert body_model(routes["/form"]) is None


def test_openapi_is_unchanged() -> None:
    assert FAST.app.openapi() == PLAIN.app.openapi()  # type: ignore[attr-defined]
