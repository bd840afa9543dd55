"""``POST /v1/images/generations``: the OpenAI Images API, so that the official ``openai`` SDK
(and everything built on it) renders on the farm by pointing ``base_url`` at it.

Place in the data flow: an OpenAI client → **here**: the body is validated with OpenAI's field
names, mapped onto ``n`` render requests → the farm's submission path, then waiting for the batch
(:mod:`infra.api.compat.sync`, ``RENDERFARM_SYNC_TIMEOUT_S``) → each image as ``b64_json`` (read from the
bucket) or ``url`` (a presigned GET, valid ``RENDERFARM_PRESIGN_EXPIRES_S`` seconds).

The request: ``prompt``, ``model`` (a model the farm serves; default: its default model), ``n``
(1…10), ``size`` ``"WxH"`` (multiples of 8, 64…2048) or ``auto``, ``response_format`` (``url``,
the Images API's default, or ``b64_json``), ``output_format`` (png, webp, jpeg), ``user`` and
``safety_identifier`` (kept in the jobs' metadata). ``quality`` ``auto``/``standard``,
``background`` ``auto``/``opaque``, ``moderation`` and ``stream: false`` are accepted as no-ops.
The farm's own knobs ride in the same body (the SDK's ``extra_body``): ``negative_prompt``,
``seed``, ``steps``, ``guidance_scale``, ``scheduler``. Anything else is refused.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (registered for
``/v1/images/`` in :mod:`infra.api.error_shapes`, so the API-key check and the rate limits answer
in it too): 400 ``invalid_request_error`` naming the ``param`` (unknown or unsupported field, bad
value), 401 ``invalid_api_key``, 404 ``model_not_found``, 429 ``rate_limit_exceeded`` with
``Retry-After``, 500 ``server_error`` when a job fails and 504 on timeout; the last two carry
``x-should-retry: false``, so the SDK does not render the same images again. The key is the
farm's own API key, sent as the SDK's ``api_key`` (``Authorization: Bearer``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool

from infra.api import error_shapes
from infra.api.compat import sync
from infra.api.deps import FarmDep, Tenant
from infra.schemas import MAX_SEED, RenderRequest, SchedulerName

PREFIX = "/v1/images"
router = APIRouter(prefix=PREFIX, tags=["openai"])
NO_RETRY = {"x-should-retry": "false"}
#: Images API fields the farm knows but cannot honour (refused as unsupported, not unknown).
UNSUPPORTED = frozenset({"style", "partial_images", "output_compression", "complexity", "frame_count",
                         "frame_duration_ms", "svg", "mask", "image", "input_fidelity"})
#: RenderRequest field → the request field that fills it (for ``param`` in errors).
PARAM_OF = {"width": "size", "height": "size", "num_inference_steps": "steps", "output_format": "output_format"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body; ``type`` follows the status as OpenAI's API sets it."""
    kind = {429: "requests", 500: "server_error", 503: "server_error", 504: "server_error"}.get(
        status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


error_shapes.register(PREFIX + "/", openai_error)


class ImagesRequest(BaseModel):
    """Body of ``POST /v1/images/generations`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=2000)
    model: str | None = Field(None, min_length=1, max_length=200)
    n: int = Field(1, ge=1, le=10)
    size: str | None = None
    response_format: Literal["url", "b64_json"] | None = None
    output_format: Literal["png", "webp", "jpeg"] | None = None
    quality: Literal["auto", "standard"] | None = None
    background: Literal["auto", "opaque"] | None = None
    moderation: Literal["auto", "low"] | None = None
    stream: Literal[False] | None = None
    user: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=1024)
    # the farm's own knobs (the SDK's extra_body)
    negative_prompt: str = Field("", max_length=2000)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    steps: int | None = Field(None, ge=1, le=150)
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)
    scheduler: SchedulerName | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        width, sep, height = v.partition("x")
        if not (sep and width.isdigit() and height.isdigit()):
            raise ValueError(f"size must be 'WIDTHxHEIGHT' in pixels or 'auto', got {v!r}")
        return v

    def render_requests(self, model: str | None) -> list[RenderRequest]:
        """``n`` render requests, seeds ``seed`` + i when a seed is given (else each drawn by
        the farm). Raises ``pydantic.ValidationError`` for values the farm refuses."""
        fields: dict[str, Any] = {"prompt": self.prompt, "negative_prompt": self.negative_prompt, "model": model,
                                  "output_format": self.output_format or "png", "metadata": {"api": "openai"},
                                  "kind": "image"}  # a video model is refused here (its endpoint: /v1/videos)
        if self.size and self.size != "auto":
            fields["width"], fields["height"] = (int(x) for x in self.size.split("x"))
        for name, value in (("num_inference_steps", self.steps), ("guidance_scale", self.guidance_scale),
                            ("scheduler", self.scheduler)):
            if value is not None:
                fields[name] = value
        user = self.safety_identifier or self.user
        if user:
            fields["metadata"]["user"] = user
        seeds = [None if self.seed is None else (self.seed + i) % (MAX_SEED + 1) for i in range(self.n)]
        return [RenderRequest(**fields, seed=seed) for seed in seeds]


class ImageData(BaseModel):
    """One generated image: base64 PNG/WebP/JPEG, or a presigned URL."""

    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    """Answer of ``POST /v1/images/generations`` (OpenAI's ``ImagesResponse``)."""

    created: int
    data: list[ImageData]
    output_format: str
    size: str


def _bad_request(exc: ValidationError) -> JSONResponse:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else None
    param = PARAM_OF.get(field, field) if field else None
    if err["type"] == "extra_forbidden" and field in UNSUPPORTED:
        message, code = f"'{field}' is not supported by this farm", "unsupported_parameter"
    elif err["type"] == "extra_forbidden":
        message, code = f"Unrecognized request argument supplied: {field}", "unknown_parameter"
    else:
        message, code = f"Invalid value for '{param}': {err['msg']}", "invalid_value"
    return error_shapes.error_response(PREFIX + "/", 400, message, param=param, code=code)


@router.post("/generations", response_model=ImagesResponse, responses={
    400: {"description": "OpenAI error: invalid or unsupported parameter"},
    404: {"description": "OpenAI error: model_not_found"}, 500: {"description": "a job failed"},
    504: {"description": "timeout"}})
async def generations(request: Request, farm: FarmDep, tenant: Tenant, body: Annotated[Any, Body()]):
    """Render ``n`` images for a prompt and answer once they are done (see the module docstring)."""
    if not isinstance(body, dict):
        return error_shapes.error_response(PREFIX + "/", 400, "the request body must be a JSON object")
    try:
        asked = ImagesRequest.model_validate(body)
    except ValidationError as exc:
        return _bad_request(exc)
    if (missing := await model_not_found(farm, asked)) is not None:
        return missing
    try:
        requests = asked.render_requests(asked.model)
    except ValidationError as exc:
        return _bad_request(exc)
    return await render_and_answer(request, farm, tenant, asked, requests)


async def model_not_found(farm, asked: ImagesRequest):
    """OpenAI's 404 ``model_not_found`` (naming the models served) when ``asked.model`` is not
    served by this farm; None when it is, or when the request names none (the default model)."""
    known = await run_in_threadpool(farm.known_models)
    if asked.model is None or asked.model in known:
        return None
    return error_shapes.error_response(
        PREFIX + "/", 404, f"The model '{asked.model}' does not exist on this farm; available: {', '.join(known)}",
        param="model", code="model_not_found")


async def render_and_answer(request: Request, farm, tenant: str, asked: ImagesRequest, requests: list[RenderRequest]):
    """Render ``requests`` over the queue and answer with OpenAI's ``ImagesResponse`` (or its error shape)."""
    try:
        jobs = await sync.render(farm, requests, tenant=tenant, timeout_s=farm.settings.sync_timeout_s,
                                 disconnected=request.is_disconnected)
    except RequestValidationError as exc:  # no pool serves this model or size
        err = exc.errors()[0]
        field = sync.requested_field(err["loc"])
        return error_shapes.error_response(PREFIX + "/", 400, str(err["msg"]), param=PARAM_OF.get(field, field),
                                           code="invalid_value")
    except sync.SyncTimeout as exc:
        return error_shapes.error_response(PREFIX + "/", 504, str(exc), code="timeout", headers=NO_RETRY)
    except (sync.RenderFailed, sync.ClientGone) as exc:
        return error_shapes.error_response(PREFIX + "/", 500, f"image generation failed: {exc}",
                                           code="generation_failed", headers=NO_RETRY)
    if (asked.response_format or "url") == "b64_json":
        data = [ImageData(b64_json=sync.b64(raw)) for raw in await sync.image_bytes(farm, jobs)]
    else:
        data = [ImageData(url=farm.storage.presigned_url(j.result.key)) for j in jobs if j.result is not None]
    first = requests[0]
    return ImagesResponse(created=int(time.time()), data=data, output_format=first.output_format,
                          size=f"{first.width}x{first.height}")
