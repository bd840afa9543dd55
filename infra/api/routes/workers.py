"""``GET /v1/workers``: the live workers, farm-wide; each tenant sees only its own job ids in
them (an admin tenant, ``RENDERFARM_ADMIN_TENANTS``, sees every job id).

Place in the data flow: worker heartbeats → registry (:mod:`infra.state.registry`) + per-worker
throughput (:mod:`infra.api.prometheus`) → **here** → clients and the dashboard.
"""

from __future__ import annotations

from fastapi import APIRouter

from infra.api import prometheus
from infra.api.deps import FarmDep, Tenant
from infra.schemas import WorkerInfo

router = APIRouter(prefix="/v1/workers", tags=["farm"])


@router.get("", response_model=list[WorkerInfo])
def workers(farm: FarmDep, tenant: Tenant) -> list[dict]:
    """Live workers: device, recipe, model, pool, batch size, last heartbeat, the caller's own
    current and reserved jobs, and ``images_per_s`` over the last few minutes."""
    return prometheus.with_rates(farm.redis, farm.visible_workers(tenant))
