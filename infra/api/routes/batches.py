"""``/v1/batches``: submit up to 10,000 renders, page through a batch, cancel it, list recent ones.

Place in the data flow: client → **here** → submission or the job-state store; another tenant's
batch id answers 404 exactly like an unknown one.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from infra.api.deps import FarmDep, Tenant, not_found, require_id
from infra.api.json_body import FastJSONRoute
from infra.api.models import BatchCanceled
from infra.schemas import BatchAccepted, BatchStatus, BatchSubmission
from infra.state.job_store import PUBLIC_TENANT

router = APIRouter(prefix="/v1/batches", tags=["batches"], route_class=FastJSONRoute)  # bodies of 10,000 jobs


@router.post("", status_code=202, response_model=BatchAccepted)
async def submit_batch(body: BatchSubmission, farm: FarmDep, tenant: Tenant) -> BatchAccepted:
    """Submit up to 10,000 renders as one batch. A repeated ``idempotency_key`` returns the first batch.
    A ``webhook_url`` must be http(s) on a public address (422 otherwise)."""
    if body.webhook_url is not None:  # its DNS lookups run on the farm's own executor
        await asyncio.get_running_loop().run_in_executor(farm.dns_pool, farm.check_webhook, body.webhook_url)
    await run_in_threadpool(farm.limiter.charge_jobs, tenant, len(body.jobs))
    return await run_in_threadpool(farm.submit, body.jobs, batch=True, priority=body.priority,
                                   idempotency_key=body.idempotency_key, webhook_url=body.webhook_url,
                                   tenant=tenant)


@router.get("", response_model=list[BatchStatus])
def recent_batches(farm: FarmDep, tenant: Tenant, limit: int = Query(20, ge=1, le=200)) -> list[BatchStatus]:
    """This tenant's most recent batches, newest first: counts by state and progress, without
    their jobs (``GET /v1/batches/{batch_id}`` pages through those)."""
    return farm.store.recent_batches(tenant, limit=limit)


@router.get("/{batch_id}", response_model=BatchStatus)
def get_batch(batch_id: str, farm: FarmDep, tenant: Tenant, offset: int = Query(0, ge=0, le=10_000),
              limit: int = Query(100, ge=0, le=1000)) -> BatchStatus:
    """Counts by state, progress 0…1 and one page of jobs (``offset``, ``limit`` ≤ 1,000)."""
    status = farm.store.get_batch(require_id(batch_id, "batch"), offset=offset, limit=limit, tenant=tenant)
    if status is None:
        raise not_found("batch")
    status.jobs = [farm.with_url(j) for j in status.jobs]
    farm.waiting_for(status.jobs)
    return status


@router.delete("/{batch_id}", response_model=BatchCanceled)
def cancel_batch(batch_id: str, farm: FarmDep, tenant: Tenant) -> BatchCanceled:
    """Cancel every job of a batch that has not finished. 404 for an unknown id."""
    meta = farm.store.batch_meta(require_id(batch_id, "batch"))
    if not meta or meta.get("tenant", PUBLIC_TENANT) != tenant:
        raise not_found("batch")
    return BatchCanceled(batch_id=batch_id, canceled=farm.cancel_batch(batch_id))
