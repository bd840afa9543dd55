"""The dashboard: the page at ``GET /`` and the two read routes only it needed so far.

Data flow: job-state store, worker registry, queue depths and :mod:`infra.farm_metrics` →
status API (``/v1/queues``, ``/v1/workers``, ``/v1/batches``, ``/v1/dead-letter``,
``/v1/throughput``) → **the page**, which polls them and redraws itself.

The page is ``static/dashboard.html`` with ``static/dashboard.js`` inlined at serve time: ``/``
is the one open path (``infra.auth.OPEN_PATHS``), so a separate script URL would need a key
when auth is on. No build step and nothing from the internet. The script's SHA-256 goes into
a Content-Security-Policy that allows no other script, so even if some text were ever
rendered as HTML it could not run (the script itself only ever sets ``textContent``).
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse

from infra import farm_metrics
from infra.auth import current_tenant
from infra.schemas import BatchStatus

STATIC_DIR = Path(__file__).parent / "static"
SCRIPT_TAG = '<script src="dashboard.js"></script>'

router = APIRouter()


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


@router.get("/v1/batches", response_model=list[BatchStatus], tags=["batches"])
def recent_batches(request: Request, tenant: str = Depends(current_tenant),
                   limit: int = Query(20, ge=1, le=200)) -> list[BatchStatus]:
    """This tenant's most recent batches, newest first: counts by state and progress, without
    their jobs (``GET /v1/batches/{batch_id}`` pages through those)."""
    return request.app.state.farm.store.recent_batches(tenant, limit=limit)


@router.get("/v1/throughput", tags=["farm"], dependencies=[Depends(current_tenant)])
def throughput(request: Request, minutes: int = Query(60, ge=1, le=120)) -> dict:
    """Images succeeded per minute and pool over the last ``minutes`` (farm-wide; the current,
    partial minute last): ``{start, minute_s, now, pools: {pool: [count, …]}}``."""
    return farm_metrics.throughput(request.app.state.farm.redis, minutes)
