"""The job-state writes for an attempt that did not succeed: a failure (requeued, or failed for
good) and a release; each write retried while Redis is away.

Place in the data flow: the render stage (:mod:`worker.render_stage`) and the post stage
(:mod:`worker.post_stage`) → **here** → job-state store (:class:`infra.state.job_store.JobStore`).
Every write carries the attempt number, so a stale attempt changes nothing. What an error means
for its job is :mod:`worker.errors`' verdict: a request's error fails the job for good, a
transient one spends an attempt, S3 credentials release the job without spending one, a broken
device spends one; either infrastructure error names itself in the batch's outcome, so that the
worker's breaker opens at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from infra.schemas import JobError
from infra.state.job_store import JobStore, StartedJob
from worker.batch import BatchOutcome
from worker.errors import CREDENTIALS, DEVICE, REQUEST, classify

log = logging.getLogger("renderfarm.worker")


class AttemptRecorder:
    """Records failed and released attempts in ``store``; counts the jobs failed for good.

    Args:
        store: the job-state store.
        redis_retry_s: how long a write rides out a Redis outage, seconds.
    """

    def __init__(self, store: JobStore, *, redis_retry_s: float = 30.0):
        self.store = store
        self.redis_retry_s = redis_retry_s
        self.jobs_failed = 0
        self._lock = threading.Lock()

    def redis(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried with backoff while Redis is unreachable or loading,
        for up to ``redis_retry_s`` seconds; then the last error is raised."""
        deadline = time.monotonic() + self.redis_retry_s
        delay = 0.2
        while True:
            try:
                return fn(*args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def fail(self, job: StartedJob, exc: BaseException, outcome: BatchOutcome, *, retry: bool | None = None) -> None:
        """Record ``exc`` as the end of ``job``'s attempt, in ``outcome`` too: requeued (any error
        but the request's, while attempts are left), failed for good, or released unspent (S3
        credentials). ``retry`` overrides :mod:`worker.errors`' verdict (False: fail for good)."""
        kind = classify(exc)
        if kind in (CREDENTIALS, DEVICE) and not outcome.infrastructure:  # logged by the breaker as it opens
            outcome.infrastructure = f"{type(exc).__name__}: {exc}"[:500]
        if kind == CREDENTIALS and retry is None:  # nothing of the request was at fault: no attempt spent
            self.release([job], outcome)
            return
        retry = kind != REQUEST if retry is None else retry
        error = JobError(type=type(exc).__name__, message=str(exc)[:2000])
        state = self.redis(self.store.fail, job, error, retry=retry)
        if state == "queued":
            log.warning("job %s attempt %d failed (%s: %s); requeued", job.job_id, job.attempt, error.type, exc)
            outcome.requeued.append(job.job_id)
        elif state == "failed":
            log.error("job %s failed: %s: %s", job.job_id, error.type, exc)
            with self._lock:
                self.jobs_failed += 1
            outcome.failed += 1
        else:
            log.warning("job %s attempt %d is stale; its failure was not recorded", job.job_id, job.attempt)
            outcome.dropped += 1

    def release(self, jobs: list[StartedJob], outcome: BatchOutcome) -> None:
        """Give ``jobs`` back to ``queued`` without spending an attempt (their ids go to
        ``outcome.requeued``, republished at the batch's end)."""
        try:
            released = self.redis(self.store.release, jobs)
        except Exception as exc:  # Redis away: their leases expire and the reaper requeues them
            log.warning("could not release %d job(s): %s", len(jobs), exc)
            return
        outcome.requeued.extend(job_id for job_id, _ in released)  # the others were taken over or canceled
        log.warning("released %d job(s) unharmed to other workers", len(released))
