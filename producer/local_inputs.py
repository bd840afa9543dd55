"""Local input images on the producer side: a path in a request → uploaded → its bucket key.

Place in the data flow: **producer** (``RenderClient.submit``/``submit_batch``, ``renderfarm
submit --init-image`` / ``--control``, catalog runs) → ``POST /v1/uploads`` → the request carries the answered
key (``inputs/<sha256>.<ext>``) → queue → worker, which reads it from the bucket.

A reference is uploaded when it is a :class:`pathlib.Path`, or a string naming an existing local
file; ``https://`` URLs and anything else (an object key) are sent as they are. The SHA-256 of the
file is computed here too (:func:`file_sha256`), so that catalogs put input hashes in their content keys
without asking the API.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

IMAGE_FIELDS = ("init_image", "mask_image")


def is_local(ref: Any) -> bool:
    """Whether an image reference names a local file to upload (a Path, or a str naming an existing file)."""
    if isinstance(ref, Path):
        return True
    return isinstance(ref, str) and not ref.startswith("https://") and Path(ref).is_file()


def file_sha256(path: str | Path) -> str:
    """The SHA-256 (hex) of a file's bytes, read in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: Pillow format → the extension the API's content-addressed keys use (infra.storage.input_images.INPUT_FORMATS).
KEY_EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}


def local_input_key(path: str | Path) -> str:
    """The key ``POST /v1/uploads`` will answer for a local file, computed here:
    ``inputs/<sha256>.<ext>`` (the format read from the file's header by Pillow).

    Raises:
        ValueError: not a PNG, JPEG or WebP file. OSError: the file cannot be read.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            fmt = img.format or ""
    except UnidentifiedImageError:
        raise ValueError(f"{path}: not an image Pillow can identify") from None
    if fmt not in KEY_EXTENSIONS:
        raise ValueError(f"{path}: image format {fmt or 'unknown'} is not accepted; use PNG, JPEG or WebP")
    return f"inputs/{file_sha256(path)}.{KEY_EXTENSIONS[fmt]}"


def upload_local_inputs(requests: Sequence[Any], upload: Callable[[Path], str]) -> list[Any]:
    """``requests`` (RenderRequests or dicts) with each local ``init_image`` / ``mask_image`` and
    control unit ``image`` (``controls[].image``) replaced by the key ``upload(path)`` answers; each
    distinct path is uploaded once per call.
    RenderRequests (already validated: they hold keys or URLs) pass unchanged.

    Raises:
        whatever ``upload`` raises (the API's 413/415/422 as ``RenderFarmError``; OSError).
    """
    uploaded: dict[Path, str] = {}

    def key(ref: Any) -> str:
        path = Path(ref).resolve()
        if path not in uploaded:
            uploaded[path] = upload(path)
        return uploaded[path]

    out = []
    for request in requests:
        if isinstance(request, dict) and any(is_local(request.get(f)) for f in IMAGE_FIELDS):
            request = {**request, **{f: key(request[f]) for f in IMAGE_FIELDS if is_local(request.get(f))}}
        units = request.get("controls") if isinstance(request, dict) else None
        if isinstance(units, list) and any(isinstance(u, dict) and is_local(u.get("image")) for u in units):
            request = {**request, "controls": [{**u, "image": key(u["image"])} if isinstance(u, dict)
                                               and is_local(u.get("image")) else u for u in units]}
        out.append(request)
    return out


#: Most bytes a catalog's https image may have (the API's own upload limit is the next check).
MAX_URL_BYTES = 50 << 20


def fetch_url_input(url: str, folder: Path | None = None, *, timeout_s: float = 30.0) -> Path:
    """Download an ``https://`` image a catalog names into ``folder`` (default: a
    ``renderfarm-url-inputs`` folder in the temporary directory), as a file named by the SHA-256
    of its bytes; returns the file. The catalog then keys and uploads it like a local file, so an
    item's content key follows the image behind the URL, not the URL's text.

    Raises:
        ValueError: an HTTP error answer, more than :data:`MAX_URL_BYTES`, or a transport error.
    """
    import tempfile

    import httpx

    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir()) / "renderfarm-url-inputs"
    try:
        with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=True) as response:
            if response.status_code >= 400:
                raise ValueError(f"{url}: HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_URL_BYTES:
                    raise ValueError(f"{url}: more than {MAX_URL_BYTES:,} bytes")
    except httpx.HTTPError as exc:
        raise ValueError(f"{url}: {exc}") from None
    path = folder / hashlib.sha256(data).hexdigest()
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(bytes(data))
        tmp.replace(path)
    return path
