"""The dashboard: the page at ``GET /``.

Data flow: job-state store, worker registry, queue depths and the farm metrics → status API
(``/v1/queues``, ``/v1/workers``, ``/v1/batches``, ``/v1/dead-letter``, ``/v1/throughput``) →
**the page**, which polls them and redraws itself.

The page is ``infra/api/static/dashboard.html`` with ``dashboard.js`` inlined at serve time: ``/``
is the one open path (:data:`infra.api.auth.OPEN_PATHS`), so a separate script URL would need a key
when auth is on. No build step and nothing from the internet. The script's SHA-256 goes into
a Content-Security-Policy that allows no other script, so even if some text were ever
rendered as HTML it could not run (the script itself only ever sets ``textContent``).
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

STATIC_DIR = Path(__file__).parent.parent / "static"
SCRIPT_TAG = '<script src="dashboard.js"></script>'

router = APIRouter(tags=["dashboard"])


@lru_cache(maxsize=1)
def page() -> tuple[str, str]:
    """``(html, content security policy)`` of the dashboard: the HTML with its script inlined."""
    html = (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8")
    script = (STATIC_DIR / "dashboard.js").read_text(encoding="utf-8")
    if SCRIPT_TAG not in html:
        raise RuntimeError(f"static/dashboard.html lacks {SCRIPT_TAG}")
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.replace(SCRIPT_TAG, f"<script>{script}</script>"), csp


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    """The live dashboard page."""
    html, csp = page()
    return HTMLResponse(html, headers={"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                                       "Cache-Control": "no-cache"})
