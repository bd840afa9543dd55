"""The dashboard: the page at ``GET /``.

Data flow: job-state store, worker registry, queue depths and the farm metrics → status API
(``/v1/queues``, ``/v1/workers``, ``/v1/batches``, ``/v1/dead-letter``, ``/v1/throughput``,
``/v1/gallery``) → **the page**, which polls them and redraws itself; its retry buttons POST
``/v1/dead-letter/{job_id}/retry``; its gallery loads the images from the bucket through
presigned URLs.

The page is ``infra/api/static/dashboard.html`` with ``dashboard.js`` inlined at serve time: ``/``
is the one open path (:data:`infra.api.auth.OPEN_PATHS`), so a separate script URL would need a key
when auth is on. No build step and nothing from the internet. The script's SHA-256 goes into
a Content-Security-Policy that allows no other script, so even if some text were ever
rendered as HTML it could not run (the script itself only ever sets ``textContent``). Images
may come from the page itself, ``data:`` URLs and the bucket's origin (the origin of its presigned
URLs), nothing else.
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from infra.api.deps import FarmDep

STATIC_DIR = Path(__file__).parent.parent / "static"
SCRIPT_TAG = '<script src="dashboard.js"></script>'
#: The page's scripts, inlined in this order as one script (gallery.js defines what dashboard.js calls).
SCRIPTS = ("gallery.js", "dashboard.js")

router = APIRouter(tags=["dashboard"])


@lru_cache(maxsize=8)
def page(image_origin: str = "") -> tuple[str, str]:
    """``(html, content security policy)`` of the dashboard: the HTML with its script inlined;
    ``image_origin`` (the bucket's ``scheme://host[:port]``) is allowed in ``img-src`` and, for
    videos, ``media-src``."""
    html = (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8")
    script = "\n".join((STATIC_DIR / name).read_text(encoding="utf-8") for name in SCRIPTS)
    if SCRIPT_TAG not in html:
        raise RuntimeError(f"static/dashboard.html lacks {SCRIPT_TAG}")
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    images = f"'self' data: {image_origin}".strip()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
           f"connect-src 'self'; img-src {images}; media-src {images}; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return html.replace(SCRIPT_TAG, f"<script>{script}</script>"), csp


def bucket_origin(presigned_url: str) -> str:
    """The origin (``scheme://host[:port]``) of a presigned URL: where the gallery's images come from."""
    parts = urlsplit(presigned_url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme in ("http", "https") and parts.netloc else ""


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard(farm: FarmDep) -> HTMLResponse:
    """The live dashboard page."""
    html, csp = page(bucket_origin(farm.storage.presigned_url("gallery")))
    return HTMLResponse(html, headers={"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                                       "Cache-Control": "no-cache"})
