"""``POST /v1/uploads``: an input image (img2img init image, inpainting mask) → its content-addressed key.

Place in the data flow: a client (``RenderClient``, ``renderfarm submit --init-image``, a catalog
run) → **here**: the multipart ``file`` is checked (:func:`infra.storage.input_images.inspect_image`:
bytes, format, pixels, full decode) and written once as ``inputs/<sha256>.<ext>`` → the client puts
the key in ``init_image`` / ``mask_image`` of its requests. The same bytes always answer the same
key, so a catalog re-run uploads nothing new and its content keys stay equal.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, UploadFile
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from infra.api.deps import FarmDep, Tenant
from infra.storage.input_images import InputRefused, store_input

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])


class UploadAccepted(BaseModel):
    """A stored input image: its bucket ``key`` (put it in ``init_image`` or ``mask_image``), its
    SHA-256 (hex), format, size in pixels and length in bytes."""

    key: str = Field(description="inputs/<sha256>.<ext>, an object key requests may name.")
    sha256: str
    format: str = Field(description="PNG, JPEG or WEBP.")
    width: int
    height: int
    bytes: int


@router.post("", status_code=201, response_model=UploadAccepted,
             responses={413: {"description": "Over RENDERFARM_INPUT_MAX_BYTES."},
                        415: {"description": "Not PNG, JPEG or WebP."},
                        422: {"description": "Not an image, too many pixels, or it does not decode."}})
async def upload(file: UploadFile, farm: FarmDep, tenant: Tenant) -> UploadAccepted:
    """Store one input image (multipart field ``file``) under its content hash; the same bytes
    answer the same key. 413 over the byte limit, 415 an unsupported format, 422 bytes that are
    not an image, a decompression bomb (more pixels than the farm's limit or Pillow's
    ``MAX_IMAGE_PIXELS``) or a file that does not decode."""
    limit = farm.settings.input_max_bytes
    data = await file.read(limit + 1)
    try:
        image = await run_in_threadpool(store_input, farm.storage, data, max_bytes=limit,
                                        max_pixels=farm.settings.input_max_pixels)
    except InputRefused as exc:
        raise HTTPException(exc.status, f"file: {exc.reason}") from None
    return UploadAccepted(key=image.key, sha256=image.sha256, format=image.format, width=image.width,
                          height=image.height, bytes=image.bytes)
