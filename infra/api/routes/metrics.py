"""``GET /metrics`` (Prometheus text) and ``GET /v1/throughput`` (images per minute).

Place in the data flow: workers' per-batch sums in Redis → the read side
(:mod:`infra.api.metrics`) → **here** → Prometheus, Grafana and the dashboard.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from infra.api import metrics
from infra.api.auth import current_tenant
from infra.api.deps import FarmDep
from infra.api.models import Throughput

router = APIRouter(tags=["farm"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def prometheus(farm: FarmDep) -> Response:
    """Prometheus text format: queue wait, render seconds per image, batch size and batch seconds
    (histograms), images by pool and state, outstanding jobs and live workers per pool."""
    body, content_type = metrics.exposition(farm.redis, farm.settings.heartbeat_ttl_s)
    return Response(body, media_type=content_type)


@router.get("/v1/throughput", response_model=Throughput, dependencies=[Depends(current_tenant)])
def throughput(farm: FarmDep, minutes: int = Query(60, ge=1, le=120)) -> dict:
    """Images succeeded per minute and pool over the last ``minutes`` (farm-wide; the current,
    partial minute last): ``{start, minute_s, now, pools: {pool: [count, …]}}``."""
    return metrics.throughput(farm.redis, minutes)
