"""``GET /v1/queues`` and ``/v1/queues/{pool}``: per pool queued, reserved, running and
outstanding jobs, the autoscaling signal.

Place in the data flow: wait lanes + broker lists + kombu's unacked hash + registry
(:func:`infra.broker.depths.queue_depths`) → **here** → KEDA's metrics-api scaler (it reads
``outstanding`` of ``/v1/queues/{pool}``) and the dashboard.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from infra.api.auth import current_tenant
from infra.api.deps import Farm, FarmDep
from infra.broker.depths import idle_row, queue_depths
from infra.schemas import QueueDepth

router = APIRouter(prefix="/v1/queues", tags=["farm"], dependencies=[Depends(current_tenant)])


def _rows(farm: Farm) -> list[dict]:
    return queue_depths(farm.redis, farm.live_workers(), pools=[p.name for p in farm.settings.pools],
                        broker=farm.brokers.clients())


@router.get("", response_model=list[QueueDepth])
def queues(farm: FarmDep) -> list[dict]:
    """Per pool (every declared one, and any with jobs or workers): queued (waiting for dispatch
    or in the broker), reserved (prefetched), running, outstanding (the autoscaling signal),
    live workers and ``oldest_wait_s`` (seconds the longest-waiting unstarted job has waited)."""
    return _rows(farm)


@router.get("/{pool}", response_model=QueueDepth)
def queue(pool: str, farm: FarmDep) -> dict:
    """One pool's row of ``/v1/queues`` (jobs; all zeros for a pool with nothing queued and no
    worker), so that KEDA's metrics-api scaler reads a scalar at ``valueLocation: outstanding``."""
    return next((r for r in _rows(farm) if r["pool"] == pool), idle_row(pool))
