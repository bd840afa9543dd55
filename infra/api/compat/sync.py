"""Synchronous rendering over the farm's queue, for the compatible APIs whose clients block on
one request until the images come back (AUTOMATIC1111's ``txt2img``, OpenAI's
``images/generations``).

Place in the data flow: a compatible route (:mod:`infra.api.compat.a1111`,
:mod:`infra.api.compat.openai_images`) → **here**: the requests go through the farm's one
submission path (:meth:`infra.api.deps.Farm.submit`: pools, job records, wait lanes, the
tenant's job rate limit) as one batch → dispatcher → workers → this coroutine polls the
job-state store until every job has ended → reads the images from the bucket → the route
answers in its API's shape.

Nothing waits in a worker: the request only polls Redis (every 0.1 s, backing off to 0.5 s),
so an API process holds thousands of such requests. When ``timeout_s`` passes, or the client
hangs up, the batch's unfinished jobs are canceled (a synchronous client can never collect
them) and :class:`SyncTimeout` or :class:`ClientGone` is raised.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Sequence

from starlette.concurrency import run_in_threadpool

from infra.api.deps import Farm
from infra.schemas import JobStatus, RenderRequest

POLL_S = 0.1
MAX_POLL_S = 0.5


class SyncTimeout(TimeoutError):
    """The batch had not ended after ``timeout_s`` seconds; its unfinished jobs were canceled."""

    def __init__(self, batch_id: str, timeout_s: float, counts: dict[str, int]):
        done = {state: n for state, n in counts.items() if n}
        super().__init__(f"batch {batch_id} not finished after {timeout_s:g} s ({done}); its unfinished jobs "
                         "were canceled")
        self.batch_id, self.timeout_s, self.counts = batch_id, timeout_s, counts


class ClientGone(ConnectionError):
    """The client disconnected while waiting; the batch's unfinished jobs were canceled."""


class RenderFailed(RuntimeError):
    """A job of the batch did not succeed; ``job`` is the first such, with its error."""

    def __init__(self, job: JobStatus):
        reason = f"{job.error.type}: {job.error.message}" if job.error else f"job {job.state}"
        super().__init__(f"job {job.job_id} of batch {job.batch_id} {job.state}: {reason}")
        self.job = job


async def render(farm: Farm, requests: Sequence[RenderRequest], *, tenant: str, timeout_s: float,
                 disconnected: Callable[[], Awaitable[bool]] | None = None,
                 idempotency_key: str | None = None) -> list[JobStatus]:
    """Submit ``requests`` as one batch of ``tenant`` and wait until every job has ended.

    Returns:
        the jobs in submission order, every one succeeded (``result.key`` set).
    Raises:
        RateLimited: the tenant's job bucket refused the batch (the route answers 429/413).
        fastapi.exceptions.RequestValidationError: no pool can serve a request (``loc`` names
            ``body.jobs.<index>.<field>``).
        SyncTimeout: not finished within ``timeout_s`` seconds (unfinished jobs canceled).
        ClientGone: ``disconnected()`` turned true first (unfinished jobs canceled).
        RenderFailed: a job failed or was canceled.
    """
    await run_in_threadpool(farm.limiter.charge_jobs, tenant, len(requests))
    accepted = await run_in_threadpool(farm.submit, list(requests), batch=True, tenant=tenant,
                                       idempotency_key=idempotency_key)
    batch_id = accepted.batch_id
    deadline = time.monotonic() + timeout_s
    poll_s = POLL_S
    while True:
        status = await run_in_threadpool(farm.store.get_batch, batch_id, limit=0)
        if status is not None and status.done:
            break
        if time.monotonic() >= deadline:
            await run_in_threadpool(farm.cancel_batch, batch_id)
            raise SyncTimeout(batch_id, timeout_s, status.counts if status else {})
        if disconnected is not None and await disconnected():
            await run_in_threadpool(farm.cancel_batch, batch_id)
            raise ClientGone(f"client disconnected; batch {batch_id} canceled")
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        poll_s = min(MAX_POLL_S, poll_s * 1.5)
    page = await run_in_threadpool(farm.store.get_batch, batch_id, limit=len(accepted.job_ids))
    jobs = page.jobs if page is not None else []
    failed = next((j for j in jobs if j.state != "succeeded" or j.result is None), None)
    if failed is not None or len(jobs) != len(accepted.job_ids):
        raise RenderFailed(failed or JobStatus(job_id="?", batch_id=batch_id, state="failed",
                                               created_at=status.created_at))
    return jobs


async def image_bytes(farm: Farm, jobs: Sequence[JobStatus]) -> list[bytes]:
    """The stored image of each succeeded job (``result`` set), read from the bucket concurrently, in order."""
    keys = [j.result.key for j in jobs if j.result is not None]
    return list(await asyncio.gather(*(run_in_threadpool(farm.storage.get, key) for key in keys)))


def b64(data: bytes) -> str:
    """``data`` as base64 text (what both compatible APIs put in their JSON)."""
    return base64.b64encode(data).decode("ascii")


def requested_field(loc: Sequence[object]) -> str:
    """The request field a submission error's ``loc`` names (``body.jobs.3.width`` → ``width``);
    ``model`` when it names none (no pool serves the job's model)."""
    return next((str(x) for x in reversed(loc) if isinstance(x, str) and x not in ("body", "jobs")), "model")
