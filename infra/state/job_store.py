"""The job-state store: :class:`JobStore`, the one object every process holds on the job records.

Place in the data flow: submission creates jobs through it (``queued``), workers move them
``running`` → ``succeeded`` | ``failed``, the reaper (:mod:`infra.broker.reaper`) moves a dead
worker's jobs back to ``queued``, and the status API reads them. It is made of four parts, one
module each: the records and their creation (:mod:`infra.state.job_records`, which also
documents the keys), a worker's transitions (:mod:`infra.state.job_transitions`), recovery and
dead letters (:mod:`infra.state.job_recovery`) and the statuses (:mod:`infra.state.job_reads`).
The names callers use are importable from here.
"""

from __future__ import annotations

import redis

from infra.state.job_reads import PUBLIC_TENANT
from infra.state.job_records import CREATE_CHUNK, MAX_LOSSES, RECENT_BATCHES_MAX, NewJob, StartedJob
from infra.state.job_recovery import MAX_KILL_RETRIES, JobRecovery, RetryRefused
from infra.state.job_transitions import CANCELED, HELD, STALE, JobTransitions

__all__ = ["CANCELED", "CREATE_CHUNK", "HELD", "MAX_KILL_RETRIES", "MAX_LOSSES", "PUBLIC_TENANT", "RECENT_BATCHES_MAX",
           "STALE", "JobStore", "NewJob", "RetryRefused", "StartedJob"]


class JobStore(JobTransitions, JobRecovery):
    """Job and batch records in Redis, with atomic, fenced transitions (the reads the status API
    makes are :class:`infra.state.job_reads.JobReads`').

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True``.
        job_ttl_s: seconds a job's record is kept after it ended (succeeded, failed, canceled),
            counted afresh at each such transition; the batch's records, after its last job
            ended. Queued and running jobs (and their batch) never expire.
        lease_s: seconds a running job's lease lasts without renewal (progress and the
            worker's heartbeat renew it); the reaper requeues a job whose lease ran out.
        max_attempts: attempts a job may spend (worker lost, or a retryable error) before it
            fails for good and is listed in the dead-letter set.
    """

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "JobStore":
        """A store on the Redis at ``url`` (``redis://`` or ``rediss://``, password allowed)."""
        return cls(redis.Redis.from_url(url, decode_responses=True), **kwargs)
