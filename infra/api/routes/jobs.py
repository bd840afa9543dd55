"""``/v1/jobs``: submit one render, read one job's status, cancel it.

Place in the data flow: client → **here** → submission (records + wait lanes) or the job-state
store; another tenant's job id answers 404 exactly like an unknown one.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from infra.api.deps import FarmDep, Tenant, not_found, require_id
from infra.api.models import JobCanceled
from infra.schemas import JobAccepted, JobStatus, RenderRequest
from infra.state import metrics

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=202, response_model=JobAccepted)
async def submit_job(body: RenderRequest, farm: FarmDep, tenant: Tenant) -> JobAccepted:
    """Submit one render; it becomes a batch of one."""
    await run_in_threadpool(farm.limiter.charge_jobs, tenant, 1)
    accepted = await run_in_threadpool(farm.submit, [body], batch=False, tenant=tenant)
    return JobAccepted(job_id=accepted.job_ids[0], batch_id=accepted.batch_id)


@router.get("/{job_id}", response_model=JobStatus)
def get_job(job_id: str, farm: FarmDep, tenant: Tenant) -> JobStatus:
    """One job's status, with a presigned URL once it succeeded. 404 for an unknown id."""
    status = farm.store.get_job(require_id(job_id, "job"), tenant)
    if status is None:
        raise not_found("job")
    farm.waiting_for([status])
    return farm.with_url(status)


@router.delete("/{job_id}", response_model=JobCanceled)
def cancel_job(job_id: str, farm: FarmDep, tenant: Tenant) -> JobCanceled:
    """Cancel a job that has not finished. 404 for an unknown id."""
    status = farm.store.get_job(require_id(job_id, "job"), tenant)
    if status is None:
        raise not_found("job")
    canceled = farm.store.cancel(job_id)
    if canceled:
        metrics.count_images(farm.redis, [status.pool or ""], "canceled")
    now = farm.store.get_job(job_id)
    return JobCanceled(job_id=job_id, canceled=canceled, state=now.state if now else status.state)
