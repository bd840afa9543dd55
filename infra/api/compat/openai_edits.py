"""``POST /v1/images/edits``: OpenAI's ``images.edit``, so the official ``openai`` SDK edits images on the farm.

Place in the data flow: an OpenAI client → **here**: the multipart body's ``image`` (one file; the
SDK's ``image[]`` with one file too) and optional ``mask`` are checked and stored like uploads
(:mod:`infra.storage.input_images`), the other fields validated as for generations
(:class:`infra.api.compat.openai_images.ImagesRequest`: ``prompt``, ``model``, ``n``, ``size``,
``response_format``, ``output_format``, ``user``, and the farm's knobs) → ``n`` img2img or
inpainting render requests → the generations route's wait and answer.

The mask is OpenAI's: a PNG with an alpha channel whose transparent pixels (alpha 0) mark the area
to repaint, the image's size. It becomes the farm's mask (white = repaint, diffusers' convention).
Without a mask the call is img2img over the whole image. ``size`` defaults to the image's own
size (rounded down to a multiple of 8 within 64…2048). The farm's ``strength`` knob (0 < s ≤ 1) may
ride along; without it, diffusers' defaults apply (1.0 with a mask, 0.8 without).

The farm's ControlNet unit may ride along too, as multipart fields: a ``control_image`` file
(checked and stored like the image), ``control_type`` (a ControlNet the pool declares) and optional
``control_weight``, ``control_preprocess`` (``none`` or ``canny``), ``control_guidance_start`` and
``control_guidance_end`` (:class:`infra.controls.ControlUnit`'s fields), one unit per call.

Errors are OpenAI's shape (400 naming the ``param``; 413 over the byte limit; 415 an unsupported
image format), as for generations.
"""

from __future__ import annotations

import io
from typing import Any

from fastapi import APIRouter, Request
from PIL import Image
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from infra.api import error_shapes
from infra.api.compat.openai_images import (
    PREFIX,
    ImagesRequest,
    ImagesResponse,
    _bad_request,
    model_not_found,
    render_and_answer,
)
from infra.api.deps import FarmDep, Tenant
from infra.storage.input_images import InputRefused, inspect_image, store_input

router = APIRouter(prefix=PREFIX, tags=["openai"])
FILE_FIELDS = ("image", "image[]", "mask", "control_image")
#: The farm's multipart fields of one ControlNet unit (beside the ``control_image`` file) → its fields.
CONTROL_FIELDS = {"control_type": "type", "control_weight": "weight", "control_preprocess": "preprocess",
                  "control_guidance_start": "guidance_start", "control_guidance_end": "guidance_end"}


def _error(status: int, message: str, param: str | None = None, code: str | None = "invalid_value"):
    return error_shapes.error_response(PREFIX + "/", status, message, param=param, code=code)


def openai_mask(data: bytes) -> bytes:
    """An OpenAI mask (PNG, alpha 0 = repaint) as the farm's: a grayscale PNG, white = repaint.

    Raises:
        ValueError: not an image, or no alpha channel.
    """
    with Image.open(io.BytesIO(data)) as img:
        if "A" not in img.getbands() and "transparency" not in img.info:
            raise ValueError("the mask must be a PNG with an alpha channel (transparent = the area to edit)")
        alpha = img.convert("RGBA").getchannel("A")
    buf = io.BytesIO()
    alpha.point(lambda a: 255 if a == 0 else 0).save(buf, "PNG")  # Pillow only: the API image has no numpy
    return buf.getvalue()


def _default_size(width: int, height: int) -> str:
    side = [min(2048, max(64, v // 8 * 8)) for v in (width, height)]
    return f"{side[0]}x{side[1]}"


@router.post("/edits", response_model=ImagesResponse, responses={
    400: {"description": "OpenAI error: invalid or unsupported parameter"},
    413: {"description": "an image over the byte limit"}, 415: {"description": "an unsupported image format"},
    500: {"description": "a job failed"}, 504: {"description": "timeout"}},
    openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["image", "prompt"],
        "properties": {"image": {"type": "string", "format": "binary"}, "mask": {"type": "string", "format": "binary"},
                       "prompt": {"type": "string"}, "n": {"type": "integer"}, "size": {"type": "string"},
                       "response_format": {"type": "string", "enum": ["url", "b64_json"]},
                       "model": {"type": "string"}, "strength": {"type": "number"},
                       "control_image": {"type": "string", "format": "binary"}, "control_type": {"type": "string"},
                       "control_weight": {"type": "number"}, "control_preprocess": {"type": "string"},
                       "control_guidance_start": {"type": "number"},
                       "control_guidance_end": {"type": "number"}}}}}}})
async def edits(request: Request, farm: FarmDep, tenant: Tenant):
    """Edit one image: ``n`` images of ``prompt`` from ``image`` (img2img), repainting where
    ``mask`` is transparent (inpainting); answered as generations are."""
    try:
        form = await request.form(max_files=4, max_fields=40)
    except Exception as exc:  # not multipart, or malformed
        return _error(400, f"the body must be multipart/form-data ({type(exc).__name__})", code="invalid_request")
    files = {k: v for k, v in form.multi_items() if isinstance(v, UploadFile)}
    fields: dict[str, Any] = {k: v for k, v in form.multi_items() if not isinstance(v, UploadFile)}
    if set(files) - set(FILE_FIELDS) or len(form.getlist("image") + form.getlist("image[]")) != 1:
        return _error(400, "send exactly one 'image' file (and at most one 'mask')", param="image")
    strength = fields.pop("strength", None)
    unit = {target: fields.pop(name) for name, target in CONTROL_FIELDS.items() if name in fields}
    for field in FILE_FIELDS:
        fields.pop(field, None)
    if (unit or "control_image" in files) and ("control_image" not in files or "type" not in unit):
        missing = "control_image" if "control_image" not in files else "control_type"
        return _error(400, f"a ControlNet unit needs a 'control_image' file and a 'control_type'; {missing!r} is "
                           "missing", param=missing)
    limit, pixels = farm.settings.input_max_bytes, farm.settings.input_max_pixels
    stored: dict[str, Any] = {}
    for param, upload in files.items():
        data = await upload.read(limit + 1)
        param = "image" if param == "image[]" else param
        try:
            if param == "mask":
                inspect_image(data, max_bytes=limit, max_pixels=pixels)  # the bomb checks before decoding
                data = openai_mask(data)
            stored[param] = await run_in_threadpool(store_input, farm.storage, data, max_bytes=limit,
                                                    max_pixels=pixels)
        except InputRefused as exc:
            return _error(400 if exc.status == 422 else exc.status, f"{param}: {exc.reason}", param=param)
        except (ValueError, OSError) as exc:
            return _error(400, f"{param}: {exc}", param=param)
    image, mask = stored["image"], stored.get("mask")
    fields.setdefault("size", _default_size(image.width, image.height))
    try:
        asked = ImagesRequest.model_validate(fields)
    except ValidationError as exc:
        return _bad_request(exc)
    if (missing := await model_not_found(farm, asked)) is not None:
        return missing
    update: dict[str, Any] = {"init_image": image.key, "mask_image": mask.key if mask else None, "strength": strength}
    if "control_image" in stored:
        update["controls"] = [{**unit, "image": stored["control_image"].key}]
    try:
        requests = [type(r).model_validate({**r.model_dump(), **update}) for r in asked.render_requests(asked.model)]
    except ValidationError as exc:
        return _bad_request(exc)
    return await render_and_answer(request, farm, tenant, asked, requests)
