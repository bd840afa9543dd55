"""``/v1/dead-letter``: a tenant's failed jobs, and putting one back in its queue.

Place in the data flow: job-state store (the ``rf:dead`` set) → **here** → the operator; a retry
goes back through the broker (:func:`infra.broker.publish.republish`).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query

from infra.api.deps import FarmDep, Tenant, not_found, require_id
from infra.api.models import DeadLetterPage, RetryAccepted
from infra.broker.publish import republish
from infra.state.job_store import RetryRefused

router = APIRouter(prefix="/v1/dead-letter", tags=["jobs"])


@router.get("", response_model=DeadLetterPage)
def dead_letter(farm: FarmDep, tenant: Tenant, offset: int = Query(0, ge=0, le=10**9),
                limit: int = Query(100, ge=1, le=1000)) -> DeadLetterPage:
    """Failed jobs of this tenant, newest first, with their last error; page on with ``next_offset``."""
    more, jobs = farm.store.dead_letters(offset=offset, limit=limit, tenant=tenant)
    return DeadLetterPage(jobs=jobs, offset=offset, limit=limit, next_offset=offset + limit if more else None)


@router.post("/{job_id}/retry", status_code=202, response_model=RetryAccepted)
def retry_dead_letter(job_id: str, farm: FarmDep, tenant: Tenant) -> RetryAccepted:
    """Put a failed job back in its queue with a fresh attempt budget. 404 for an unknown id,
    409 when the job is not failed, or when it killed its worker while rendering alone and has
    had its retries (``infra.state.job_recovery.MAX_KILL_RETRIES``)."""
    status = farm.store.get_job(require_id(job_id, "job"), tenant)
    if status is None:
        raise not_found("job")
    try:
        pool = farm.store.retry(job_id)
    except RetryRefused as exc:
        raise HTTPException(409, str(exc)) from None
    if pool is None:
        now = farm.store.get_job(job_id)
        raise HTTPException(409, f"job {job_id!r} is {now.state if now else 'gone'}, not failed")
    republish(farm.store, farm.brokers, [job_id])
    return RetryAccepted(job_id=job_id)
