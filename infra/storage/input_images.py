"""Input images (img2img init images, inpainting masks): checked, stored by content hash, read back.

Place in the data flow: producer → ``POST /v1/uploads`` or an ``https`` URL the API fetches →
**checked and stored here** as ``inputs/<sha256>.<ext>`` (write-once: the same bytes are one
object) → the request carries that key → the worker reads the bytes back **from the bucket only**
(:func:`load_input`) and decodes them for the pipeline.

The checks, each a :class:`InputRefused` with an HTTP status a client can act on:

- more than ``max_bytes`` bytes → 413;
- bytes Pillow cannot identify → 422 ``not an image``;
- a format other than PNG, JPEG or WebP → 415;
- more decoded pixels than ``max_pixels`` (the farm's own limit), or than Pillow's
  ``Image.MAX_IMAGE_PIXELS`` (Pillow's decompression-bomb guard, which raises
  ``DecompressionBombError`` at twice that value and warns above it; both are refused here) → 422;
- a file that does not decode to the end (truncated, corrupt) → 422.

The size is read from the header before any pixel is decoded, so a bomb never allocates its
pixels. The object's S3 user metadata records ``width``, ``height`` and ``sha256``, so that the
API can compare a mask's size with its image's with one HEAD each.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import NamedTuple

from botocore.exceptions import ClientError
from PIL import Image

from infra.schemas import INPUT_KEY_PREFIX
from infra.storage.s3 import Storage

#: Pillow format name → (file extension, content type) of the input formats the farm accepts.
INPUT_FORMATS: dict[str, tuple[str, str]] = {"PNG": ("png", "image/png"), "JPEG": ("jpg", "image/jpeg"),
                                             "WEBP": ("webp", "image/webp")}


class InputRefused(ValueError):
    """An input image the farm will not take: ``status`` (413, 415 or 422) and ``reason``."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class InputImage(NamedTuple):
    """A checked input image: its bucket ``key``, ``sha256`` (hex), Pillow ``format``, size in
    pixels, ``content_type`` and length in ``bytes``."""

    key: str
    sha256: str
    format: str
    width: int
    height: int
    content_type: str
    bytes: int


def inspect_image(data: bytes, *, max_bytes: int, max_pixels: int) -> InputImage:
    """Check ``data`` as an input image (see the module docstring) without storing it.

    Args:
        data: the encoded file.
        max_bytes: largest accepted file, bytes.
        max_pixels: most decoded pixels (width × height) accepted; the smaller of this and
            Pillow's ``Image.MAX_IMAGE_PIXELS`` (when set) applies.
    Raises:
        InputRefused: 413 over ``max_bytes``; 415 an unsupported format; 422 not an image,
            too many pixels, or a file that does not decode.
    """
    if len(data) > max_bytes:
        raise InputRefused(413, f"the image is {len(data):,} bytes, over the limit of {max_bytes:,} bytes")
    limit = max_pixels if Image.MAX_IMAGE_PIXELS is None else min(max_pixels, int(Image.MAX_IMAGE_PIXELS))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                fmt, (width, height) = img.format or "", img.size
                if fmt not in INPUT_FORMATS:
                    raise InputRefused(415, f"image format {fmt or 'unknown'} is not accepted; send PNG, JPEG or WebP")
                if width * height > limit:
                    raise InputRefused(422, f"the image is {width}×{height} = {width * height:,} pixels, over the "
                                            f"limit of {limit:,} pixels (decompression-bomb guard)")
                img.load()
    except InputRefused:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InputRefused(422, f"the image has too many pixels (decompression-bomb guard): {exc}") from None
    except Image.UnidentifiedImageError:
        raise InputRefused(422, "the bytes are not an image Pillow can identify (PNG, JPEG or WebP expected)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputRefused(422, f"the image does not decode ({type(exc).__name__}: {exc})") from None
    digest = hashlib.sha256(data).hexdigest()
    ext, content_type = INPUT_FORMATS[fmt]
    return InputImage(f"{INPUT_KEY_PREFIX}{digest}.{ext}", digest, fmt, width, height, content_type, len(data))


def store_input(storage: Storage, data: bytes, *, max_bytes: int, max_pixels: int) -> InputImage:
    """Check ``data`` (:func:`inspect_image`) and write it once under its content-addressed key;
    bytes already stored are not written again. Returns what was stored.

    Raises:
        InputRefused: see :func:`inspect_image`.
        obstore's errors (``PermissionDeniedError``, …): S3 refused the HEAD or the write (after
            the storage's retries).
    """
    image = inspect_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
    if not storage.exists(image.key):
        storage.put_once(image.key, data, image.content_type,
                         {"width": str(image.width), "height": str(image.height), "sha256": image.sha256})
    return image


def input_size(storage: Storage, key: str) -> tuple[int, int] | None:
    """``(width, height)`` in pixels of a stored input image, from its metadata (a HEAD), or from
    its header (a GET) for an object stored otherwise; None when there is no such object.

    Raises:
        InputRefused: 422 when the object is not an image.
    """
    try:
        head = storage.client.head_object(Bucket=storage.bucket, Key=key)
    except ClientError as exc:  # 404 and 403 both mean "not readable as an input"
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "403", "NotFound"):
            return None
        raise
    meta = head.get("Metadata") or {}
    if "width" in meta and "height" in meta:
        return int(meta["width"]), int(meta["height"])
    try:
        with Image.open(io.BytesIO(storage.get(key))) as img:
            return img.size
    except Exception:
        raise InputRefused(422, f"object {key!r} is not an image") from None


def load_input(storage: Storage, key: str, *, max_pixels: int) -> Image.Image:
    """The input image at ``key`` in the bucket, decoded (RGB, or L for a mask is the caller's
    conversion). Workers read inputs through this alone: never from a URL.

    Raises:
        ValueError: ``key`` is a URL (the API replaces URLs by keys before a job is queued),
            or the object is not an image within ``max_pixels``.
        botocore.exceptions.ClientError: the object is missing or unreadable.
    """
    if "://" in key:
        raise ValueError(f"input {key[:80]!r} is a URL; workers read inputs from the bucket only")
    data = storage.get(key)
    image = inspect_image(data, max_bytes=len(data), max_pixels=max_pixels)
    del image
    with Image.open(io.BytesIO(data)) as img:
        return img.copy()
