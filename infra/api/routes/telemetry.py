"""``GET /metrics`` (Prometheus text) and ``GET /v1/throughput`` (images per minute).

Place in the data flow: workers' per-batch sums in Redis → the read side
(:mod:`infra.api.prometheus`) → **here** → Prometheus, Grafana and the dashboard.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response

from infra.api import prometheus as read_side
from infra.api.auth import current_tenant, presented_keys
from infra.api.deps import Farm, FarmDep
from infra.api.models import Throughput
from infra.api.probes import Cached

router = APIRouter(tags=["farm"])


def may_scrape(request: Request, farm: Farm) -> bool:
    """Whether a request may read ``/metrics``: it carries ``Authorization: Bearer <metrics_token>``
    or an admin tenant's key (``RENDERFARM_ADMIN_TENANTS``); or no token is set and auth is off
    (the local stack)."""
    token = farm.settings.metrics_token.get_secret_value()
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    keys = presented_keys(request.headers.raw, required=True)
    if len(keys) == 1 and farm.settings.admin_tenant_set:
        principal = farm.keys.authenticate(keys[0])
        if principal is not None and principal.tenant in farm.settings.admin_tenant_set:
            return True
    return not token and not farm.settings.auth_required


def _exposition(request: Request, farm: Farm) -> Cached:
    cached = getattr(request.app.state, "metrics_exposition", None)
    if cached is None:
        cached = request.app.state.metrics_exposition = Cached(
            lambda: read_side.exposition(farm.redis, farm.settings.heartbeat_ttl_s, farm.brokers.clients()),
            farm.settings.metrics_cache_s)
    return cached


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                       401: {"description": "no scrape token (RENDERFARM_METRICS_TOKEN) and no admin key"}})
def prometheus(request: Request, farm: FarmDep) -> Response:
    """Prometheus text format: queue wait, render seconds per image, batch size and batch seconds
    (histograms), images by pool and state, outstanding jobs and live workers per pool. Needs
    ``Authorization: Bearer <RENDERFARM_METRICS_TOKEN>`` or an admin tenant's key, unless no token
    is set and auth is off. One answer serves every scrape for ``RENDERFARM_METRICS_CACHE_S``."""
    if not may_scrape(request, farm):
        raise HTTPException(401, "/metrics needs Authorization: Bearer <scrape token> or an admin key",
                            headers={"WWW-Authenticate": "Bearer"})
    body, content_type = _exposition(request, farm).get()
    return Response(body, media_type=content_type)


@router.get("/v1/throughput", response_model=Throughput, dependencies=[Depends(current_tenant)])
def throughput(farm: FarmDep, minutes: int = Query(60, ge=1, le=120)) -> dict:
    """Images succeeded per minute and pool over the last ``minutes`` (farm-wide; the current,
    partial minute last): ``{start, minute_s, now, pools: {pool: [count, …]}}``."""
    return read_side.throughput(farm.redis, minutes)
