"""``/v1/videos``: OpenAI's Videos API (OpenAI API reference, Videos), so the official ``openai``
SDK's ``client.videos`` (``create``, ``retrieve``, ``poll``, ``create_and_poll``, ``list``,
``delete``, ``download_content``) renders video on the farm by pointing ``base_url`` at it.

Place in the data flow: an OpenAI client → **here**: the multipart form of ``POST /v1/videos`` is
validated, ``seconds`` mapped to frames for the serving pool's video family
(:func:`infra.api.compat.openai_video_shapes.frames_for`), an ``input_reference`` image stored as
an input image (as ``POST /v1/uploads`` does) and used as ``init_image`` (image-to-video) → one
``kind: video`` render request through the farm's submission path (a batch of one) → answered at
once with the :class:`~infra.api.compat.openai_video_shapes.Video` (``queued``); the client polls
``GET /v1/videos/{id}`` (``openai-poll-after-ms`` says how often) and downloads the MP4.

Routes and what they do on the farm:

- ``POST /v1/videos``: multipart ``prompt`` (1…2,000 characters), ``model`` (a model the farm
  serves; default its default model), ``seconds`` (whole seconds 1…60 as a string; default
  ``"4"``), ``size`` (``"WIDTHxHEIGHT"`` pixels, any size the pool renders: multiples of 8 and of
  the family's size multiple, within the pool's ``max_pixels``; default ``"720x1280"``, OpenAI's),
  optional ``input_reference`` file (PNG, JPEG or WebP; families with image-to-video only), and the
  farm's knobs ``negative_prompt``, ``seed``, ``steps``, ``guidance_scale``.
- ``GET /v1/videos/{id}``: the video's state; ``id`` is ``video_<job id>`` (any video job of the
  caller's tenant, also one submitted as ``POST /v1/jobs``).
- ``GET /v1/videos?after=&limit=&order=``: the caller's videos, newest first (``order=asc``:
  oldest first), ``limit`` 1…100 (default 20), ``after`` a video id (the previous page's
  ``last_id``; an id not in the list gives an empty page). An honest subset: the video jobs of
  batches of one job (each ``POST /v1/videos`` is one; so is ``POST /v1/jobs``) among the
  tenant's :data:`LIST_SCAN_BATCHES` newest batches, as long as their records live
  (``RENDERFARM_JOB_TTL_S``); a video in a larger batch is retrieved by id, not listed.
- ``DELETE /v1/videos/{id}``: an unfinished video is canceled; a finished one's stored files
  (MP4, poster, preview) are deleted from the bucket. Its record stays until it expires, so
  ``retrieve`` still answers; ``content`` then answers 404.
- ``GET /v1/videos/{id}/content?variant=video|thumbnail|spritesheet``: the MP4
  (``video/mp4``), the poster frame (its first frame, in the request's ``output_format``), or the
  animated WebP preview (``image/webp``; the farm's spritesheet is that preview, not a grid of frames).

Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (registered for
``/v1/videos`` in :mod:`infra.api.error_shapes`): 400 naming the ``param`` (unknown field, bad
value, a size or frame count the pool cannot render, an input image refused; the SDK raises
``openai.BadRequestError``), 401, 404 ``model_not_found`` or an unknown video, 409 a video not
ready for download, 413/415 an input image over the byte limit or of an unsupported format, 429.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from infra.api import error_shapes
from infra.api.compat import sync
from infra.api.compat.openai_images import openai_error
from infra.api.compat.openai_video_shapes import (
    API_TAG,
    MAX_SECONDS,
    MIN_SECONDS,
    Video,
    VideoDeleted,
    VideoList,
    frames_for,
    job_id_of,
    video_of,
)
from infra.api.deps import Farm, FarmDep, Tenant
from infra.routing import NoPoolError
from infra.schemas import MAX_SEED, JobStatus, RenderRequest, is_farm_id
from infra.storage.input_images import InputRefused, store_input

PREFIX = "/v1/videos"
router = APIRouter(prefix=PREFIX, tags=["openai"])
error_shapes.register(PREFIX, openai_error)
#: How long the SDK's ``poll`` waits between retrieves (the ``openai-poll-after-ms`` header).
POLL_AFTER_MS = 500
#: How many of the tenant's newest batches ``GET /v1/videos`` looks through.
LIST_SCAN_BATCHES = 200
#: RenderRequest field → the form field that fills it (for ``param`` in errors).
PARAM_OF = {"width": "size", "height": "size", "num_inference_steps": "steps", "num_frames": "seconds",
            "fps": "seconds", "init_image": "input_reference"}
CONTENT_TYPES = {"png": "image/png", "webp": "image/webp", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                 "mp4": "video/mp4"}


def _error(status: int, message: str, param: str | None = None, code: str | None = "invalid_value",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return error_shapes.error_response(PREFIX, status, message, param=param, code=code, headers=headers)


class VideoCreate(BaseModel):
    """The form fields of ``POST /v1/videos`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=2000)
    model: str | None = Field(None, min_length=1, max_length=200)
    seconds: int = Field(4, ge=MIN_SECONDS, le=MAX_SECONDS)
    size: str = "720x1280"
    negative_prompt: str = Field("", max_length=2000)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    steps: int | None = Field(None, ge=1, le=150)
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        width, sep, height = v.partition("x")
        if not (sep and width.isdigit() and height.isdigit()):
            raise ValueError(f"size must be 'WIDTHxHEIGHT' in pixels, got {v!r}")
        return v

    @property
    def width_height(self) -> tuple[int, int]:
        """``size`` as ``(width, height)`` pixels."""
        width, _, height = self.size.partition("x")
        return int(width), int(height)


def _bad_request(exc: ValidationError) -> JSONResponse:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else None
    param = PARAM_OF.get(field, field) if field else None
    if err["type"] == "extra_forbidden":
        return _error(400, f"Unrecognized request argument supplied: {field}", param=field, code="unknown_parameter")
    return _error(400, f"Invalid value for '{param}': {err['msg']}", param=param)


def _family_of(farm: Farm, model: str, width: int, height: int) -> tuple[str | None, int | None]:
    """The video family and frame limit of the pool that renders ``model`` at ``width × height``.

    Raises:
        NoPoolError: no declared pool serves the model at that size.
    """
    router_ = farm.submitter.router
    pool = router_.pool_for(model, width, height)
    spec = router_.spec(pool)
    return router_.family(pool, model), spec.max_frames if spec is not None else None


async def _store_reference(farm: Farm, upload: UploadFile) -> str | JSONResponse:
    """Store the ``input_reference`` file as an input image; its key, or the error answer."""
    limit = farm.settings.input_max_bytes
    data = await upload.read(limit + 1)
    try:
        image = await run_in_threadpool(store_input, farm.storage, data, max_bytes=limit,
                                        max_pixels=farm.settings.input_max_pixels)
    except InputRefused as exc:
        return _error(400 if exc.status == 422 else exc.status, f"input_reference: {exc.reason}",
                      param="input_reference")
    except (ValueError, OSError) as exc:
        return _error(400, f"input_reference: {exc}", param="input_reference")
    return image.key


def _render_request(asked: VideoCreate, model: str, family: str | None, max_frames: int | None,
                    init_image: str | None) -> RenderRequest:
    """The one video render request of a create call. Raises ``pydantic.ValidationError``."""
    width, height = asked.width_height
    frames, fps = frames_for(asked.seconds, family, max_frames)
    fields: dict[str, Any] = {"prompt": asked.prompt, "negative_prompt": asked.negative_prompt, "model": model,
                              "width": width, "height": height, "kind": "video", "num_frames": frames, "fps": fps,
                              "init_image": init_image, "seed": asked.seed,
                              "metadata": {"api": API_TAG, "seconds": str(asked.seconds)}}
    if asked.steps is not None:
        fields["num_inference_steps"] = asked.steps
    if asked.guidance_scale is not None:
        fields["guidance_scale"] = asked.guidance_scale
    return RenderRequest(**fields)


async def _submit(farm: Farm, tenant: str, request: RenderRequest) -> JobStatus | JSONResponse:
    """Submit ``request`` as a batch of one; its recorded status, or the error answer."""
    await run_in_threadpool(farm.limiter.charge_jobs, tenant, 1)
    try:
        accepted = await run_in_threadpool(farm.submit, [request], batch=False, tenant=tenant)
    except RequestValidationError as exc:  # what the pool's family cannot do, or an input image refused
        err = exc.errors()[0]
        field = sync.requested_field(err["loc"])
        return _error(400, str(err["msg"]), param=PARAM_OF.get(field, field))
    except HTTPException as exc:  # quota, idempotency, durability, an input image's bytes or format
        return _error(exc.status_code, str(exc.detail), code=None, headers=dict(exc.headers or {}))
    status = await run_in_threadpool(farm.store.get_job, accepted.job_ids[0], tenant)
    if status is None:  # expired or deleted between the write and this read
        return _error(500, "the video was accepted but its record is gone", code="server_error")
    return status


def _video_answer(status: JobStatus) -> JSONResponse:
    video = video_of(status)
    headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)} if video.status in ("queued", "in_progress") else None
    return JSONResponse(video.model_dump(mode="json"), headers=headers)


@router.post("", response_model=Video, responses={
    400: {"description": "OpenAI error: invalid or unsupported parameter, or a video the pool cannot render"},
    404: {"description": "OpenAI error: model_not_found"}, 413: {"description": "input_reference over the limit"},
    415: {"description": "input_reference of an unsupported format"}, 429: {"description": "rate or quota limit"}},
    openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}, "model": {"type": "string"},
                       "seconds": {"type": "string", "description": "whole seconds 1…60, e.g. \"4\", \"8\", \"12\""},
                       "size": {"type": "string", "description": "WIDTHxHEIGHT pixels, e.g. 720x1280"},
                       "input_reference": {"type": "string", "format": "binary"},
                       "negative_prompt": {"type": "string"}, "seed": {"type": "integer"},
                       "steps": {"type": "integer"}, "guidance_scale": {"type": "number"}}}}}}})
async def create_video(request: Request, farm: FarmDep, tenant: Tenant):
    """Queue one video (``kind: video``; ``seconds`` → frames by the pool's family; an
    ``input_reference`` image is its first frame) and answer its ``Video`` at once (``queued``)."""
    try:
        form = await request.form(max_files=1, max_fields=20)
    except Exception as exc:  # not multipart, or malformed
        return _error(400, f"the body must be multipart/form-data ({type(exc).__name__})", code="invalid_request")
    files = {k: v for k, v in form.multi_items() if isinstance(v, UploadFile)}
    fields = {k: v for k, v in form.multi_items() if not isinstance(v, UploadFile)}
    if other := sorted(set(files) - {"input_reference"}):
        return _error(400, "the only file field is 'input_reference'", param=other[0])
    if "input_reference" in fields:
        return _error(400, "input_reference must be an uploaded image file (a file_id or image_url reference "
                           "is not supported by this farm)", param="input_reference", code="unsupported_parameter")
    try:
        asked = VideoCreate.model_validate(fields)
    except ValidationError as exc:
        return _bad_request(exc)
    known = await run_in_threadpool(farm.known_models)
    if asked.model is not None and asked.model not in known:
        return _error(404, f"The model '{asked.model}' does not exist on this farm; available: {', '.join(known)}",
                      param="model", code="model_not_found")
    model = asked.model or farm.settings.default_model
    try:
        family, max_frames = _family_of(farm, model, *asked.width_height)
    except NoPoolError as exc:
        return _error(400, exc.errors[0]["msg"], param="model" if exc.errors[0]["field"] == "model" else "size")
    init_image = None
    if "input_reference" in files:
        stored = await _store_reference(farm, files["input_reference"])
        if isinstance(stored, JSONResponse):
            return stored
        init_image = stored
    try:
        render = _render_request(asked, model, family, max_frames, init_image)
    except ValidationError as exc:
        return _bad_request(exc)
    status = await _submit(farm, tenant, render)
    return status if isinstance(status, JSONResponse) else _video_answer(status)


def _video_job(farm: Farm, tenant: str, video: str) -> JobStatus | None:
    """The tenant's video job a video id names; None for an unknown, malformed or other tenant's id, or an image."""
    job_id = job_id_of(video)
    if not is_farm_id(job_id):
        return None
    status = farm.store.get_job(job_id, tenant)
    return status if status is not None and status.request is not None and status.request.is_video else None


def _not_found(video: str) -> JSONResponse:
    return _error(404, f"No video found with id '{video[:80]}'", param="video_id", code="not_found")


@router.get("/{video_id}", response_model=Video, responses={404: {"description": "OpenAI error: unknown video"}})
def retrieve_video(video_id: str, farm: FarmDep, tenant: Tenant):
    """The video's state; ``openai-poll-after-ms`` while it is queued or in progress."""
    status = _video_job(farm, tenant, video_id)
    return _not_found(video_id) if status is None else _video_answer(status)


@router.get("", response_model=VideoList)
def list_videos(farm: FarmDep, tenant: Tenant, after: Annotated[str | None, Query(max_length=100)] = None,
                limit: Annotated[int, Query(ge=1, le=100)] = 20,
                order: Annotated[Literal["asc", "desc"], Query()] = "desc") -> VideoList:
    """The caller's videos among its newest batches (see the module docstring), one page."""
    ids = [job for batch in farm.store.recent_batches(tenant, limit=LIST_SCAN_BATCHES) if batch.total == 1
           for job in farm.store.batch_job_ids(batch.batch_id, 0, 1)]
    statuses = [s for s in farm.store.get_jobs(ids) if s is not None and s.request is not None and s.request.is_video]
    statuses.sort(key=lambda s: s.created_at, reverse=order == "desc")
    videos = [video_of(s) for s in statuses]
    if after is not None:
        position = next((i for i, v in enumerate(videos) if v.id == after), None)
        videos = [] if position is None else videos[position + 1:]
    page = videos[:limit]
    return VideoList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=len(videos) > limit)


def _stored_keys(status: JobStatus) -> list[str]:
    result = status.result
    return [] if result is None else [k for k in (result.key, result.poster, result.preview) if k]


@router.delete("/{video_id}", response_model=VideoDeleted,
               responses={404: {"description": "OpenAI error: unknown video"}})
def delete_video(video_id: str, farm: FarmDep, tenant: Tenant):
    """Cancel an unfinished video, or delete a finished one's files from the bucket."""
    status = _video_job(farm, tenant, video_id)
    if status is None:
        return _not_found(video_id)
    if status.state in ("queued", "running"):
        farm.store.cancel(status.job_id)
    for key in _stored_keys(status):
        farm.storage.delete(key)
    return VideoDeleted(id=video_id, deleted=True)


@router.get("/{video_id}/content", response_class=Response, responses={
    200: {"content": {"video/mp4": {}, "image/png": {}, "image/webp": {}},
          "description": "The MP4, the poster frame or the animated WebP preview"},
    400: {"description": "OpenAI error: unknown variant"}, 404: {"description": "OpenAI error: unknown video or "
                                                                               "variant, or its files deleted"},
    409: {"description": "OpenAI error: the video is not completed"}})
def download_content(video_id: str, farm: FarmDep, tenant: Tenant,
                     variant: Annotated[str, Query(max_length=20)] = "video"):
    """The MP4 (``variant=video``), poster (``thumbnail``) or animated WebP preview (``spritesheet``)."""
    if variant not in ("video", "thumbnail", "spritesheet"):
        return _error(400, f"variant must be video, thumbnail or spritesheet, got {variant[:20]!r}", param="variant")
    status = _video_job(farm, tenant, video_id)
    if status is None:
        return _not_found(video_id)
    if status.state != "succeeded" or status.result is None:
        return _error(409, f"video {video_id} is {video_of(status).status}, not completed", code="video_not_ready")
    result = status.result
    key = {"video": result.key, "thumbnail": result.poster, "spritesheet": result.preview}[variant]
    if key is None:
        return _error(404, f"video {video_id} has no {variant}", param="variant", code="not_found")
    if not farm.storage.exists(key):
        return _error(404, f"the {variant} of video {video_id} was deleted", code="not_found")
    ext = key.rsplit(".", 1)[-1]
    media = result.content_type if key == result.key else CONTENT_TYPES.get(ext, "application/octet-stream")
    return Response(farm.storage.get(key), media_type=media)
