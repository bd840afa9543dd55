"""Response bodies of the status API that are not part of the shared schemas.

Place in the data flow: status API → **these models** → clients, the dashboard and
``/openapi.json``. The public types (RenderRequest, JobStatus, BatchStatus, QueueDepth,
WorkerInfo, …) are in :mod:`infra.schemas`; these are the answers of single routes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from infra.schemas import JobState, JobStatus


class JobCanceled(BaseModel):
    """Answer of ``DELETE /v1/jobs/{job_id}``: whether this call canceled it, and its state now."""

    job_id: str
    canceled: bool
    state: JobState


class BatchCanceled(BaseModel):
    """Answer of ``DELETE /v1/batches/{batch_id}``: how many of its jobs this call canceled."""

    batch_id: str
    canceled: int


class DeadLetterPage(BaseModel):
    """One page of the tenant's failed jobs, newest first; ``next_offset`` is None on the last."""

    jobs: list[JobStatus]
    offset: int
    limit: int
    next_offset: int | None = None


class RetryAccepted(BaseModel):
    """Answer of ``POST /v1/dead-letter/{job_id}/retry``: the job is queued again."""

    job_id: str
    state: Literal["queued"] = "queued"


class Health(BaseModel):
    """``GET /healthz`` (readiness): ``ok`` when Redis and S3 answer; ``degraded`` (still HTTP 200)
    when only S3 fails or a service of ``renderfarm up`` is down, since the API still accepts and
    reports jobs; ``unavailable`` (503) when
    Redis fails. Only for a caller that may read ``/metrics`` (scrape token or admin key):
    ``checks`` holds each check's ``ok`` or error, and ``unhealthy_workers`` lists workers whose
    circuit breaker is open (present only when there are some)."""

    status: Literal["ok", "degraded", "unavailable"]
    checks: dict[str, str] | None = None
    unhealthy_workers: list[str] | None = None
    #: newest first: ``renderfarm up``'s supervisor lines (what restarted, when, why), UTC
    stack_events: list[str] | None = None


class Throughput(BaseModel):
    """Images succeeded per minute and pool over the last minutes, oldest first, the current
    (partial) minute last. ``start`` and ``now`` are epoch seconds (Redis server clock)."""

    start: int
    minute_s: int = 60
    now: float
    pools: dict[str, list[int]] = Field(default_factory=dict)
