"""``GET /v1/workers``: the live workers, farm-wide (any authenticated tenant sees them all).

Place in the data flow: worker heartbeats → registry (:mod:`infra.state.registry`) + per-worker
throughput (:mod:`infra.api.metrics`) → **here** → clients and the dashboard.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from infra.api import metrics
from infra.api.auth import current_tenant
from infra.api.deps import FarmDep
from infra.schemas import WorkerInfo

router = APIRouter(prefix="/v1/workers", tags=["farm"], dependencies=[Depends(current_tenant)])


@router.get("", response_model=list[WorkerInfo])
def workers(farm: FarmDep) -> list[dict]:
    """Live workers: device, recipe, model, pool, batch size, last heartbeat, current jobs, and
    ``images_per_s`` over the last few minutes."""
    return metrics.with_rates(farm.redis, farm.live_workers())
