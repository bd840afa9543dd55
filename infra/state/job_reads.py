"""The read side of the job-state store: job and batch statuses, parsed from their records.

Place in the data flow: :class:`infra.state.job_store.JobStore` writes the records (every transition
one Lua script) and inherits these reads; the status API, the dashboard and the clients' polling
reach them through it. Reads never change a state; :meth:`JobReads.recent_batches` only drops
ids whose records expired from the recent-batches index. The record layout is in
:mod:`infra.state.job_records`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import redis

from infra import keys
from infra.schemas import JOB_STATES, BatchStatus, JobError, JobResult, JobStatus, RenderRequest
from infra.state import shards

__all__ = ["PUBLIC_TENANT", "JobReads"]

#: The tenant of anonymous requests when auth is off, and of records written before tenants.
PUBLIC_TENANT = "public"


def _ts(value: str | None) -> datetime | None:
    """An epoch-seconds field as a UTC datetime; None for unset (``""`` or ``"0"``)."""
    if not value or value == "0":
        return None
    return datetime.fromtimestamp(float(value), tz=timezone.utc)


class JobReads:
    """Statuses of jobs and batches from the store's Redis (``self.r``, ``decode_responses=True``).
    Unknown ids, and with ``tenant`` another tenant's ids, read as None, never as a made-up state."""

    r: redis.Redis

    def get_job(self, job_id: str, tenant: str | None = None) -> JobStatus | None:
        """The job's status, or None when the id is unknown (never a made-up ``queued``) or,
        with ``tenant``, belongs to another tenant."""
        return self._parse_job(job_id, self.r.hgetall(keys.job(job_id)), tenant)

    def tenants_of(self, job_ids: Sequence[str]) -> list[str | None]:
        """Each job's tenant in the given order (:data:`PUBLIC_TENANT` for records written before
        tenants; None for an unknown id), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), "state", "tenant")
        return [(tenant or PUBLIC_TENANT) if state else None for state, tenant in pipe.execute()]

    def get_jobs(self, job_ids: Sequence[str]) -> list[JobStatus | None]:
        """Statuses for many ids in one round trip, in the given order."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return [self._parse_job(j, h) for j, h in zip(job_ids, pipe.execute())]

    @staticmethod
    def _parse_job(job_id: str, h: dict[str, str], tenant: str | None = None) -> JobStatus | None:
        if not h or "state" not in h:
            return None
        if tenant is not None and h.get("tenant", PUBLIC_TENANT) != tenant:
            return None
        return JobStatus(
            job_id=job_id, batch_id=h["batch_id"], state=h["state"], pool=h.get("pool"),
            progress=min(1.0, max(0.0, float(h.get("progress", 0)))), attempts=int(h.get("attempts", 0)),
            worker=h.get("worker"), created_at=_ts(h["created_at"]), started_at=_ts(h.get("started_at")),
            finished_at=_ts(h.get("finished_at")),
            result=JobResult.model_validate_json(h["result"]) if h.get("result") else None,
            error=JobError.model_validate_json(h["error"]) if h.get("error") else None,
            request=RenderRequest.model_validate_json(h["request"]) if h.get("request") else None,
        )

    def batch_job_ids(self, batch_id: str, offset: int = 0, limit: int | None = None) -> list[str]:
        """Job ids of a batch in submission order; ``limit`` None means all."""
        end = -1 if limit is None else offset + limit - 1
        return self.r.lrange(keys.batch_jobs(batch_id), offset, end)

    def get_batch(self, batch_id: str, offset: int = 0, limit: int = 100,
                  tenant: str | None = None) -> BatchStatus | None:
        """Counts by state, progress 0…1 and one page of jobs; None when the id is unknown or,
        with ``tenant``, belongs to another tenant."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.batch(batch_id))
        pipe.hgetall(keys.batch_counts(batch_id))
        if limit:  # LRANGE 0 -1 would be every job
            pipe.lrange(keys.batch_jobs(batch_id), offset, offset + limit - 1)
        meta, counts, *page = pipe.execute()
        ids = page[0] if page else []
        if not meta or (tenant is not None and meta.get("tenant", PUBLIC_TENANT) != tenant):
            return None
        total = int(meta["total"])
        state_counts = {s: int(counts.get(s, 0)) for s in JOB_STATES}
        done = sum(state_counts[s] for s in ("succeeded", "failed", "canceled"))
        jobs = [j for j in self.get_jobs(ids) if j is not None]
        progress = min(1.0, max(0.0, float(counts.get("done", 0)) / total)) if total else 1.0
        return BatchStatus(
            batch_id=batch_id, created_at=_ts(meta["created_at"]), total=total, counts=state_counts,
            progress=1.0 if done == total else progress, done=done == total, jobs=jobs, offset=offset,
            limit=limit, next_offset=offset + limit if offset + limit < total else None,
        )

    def batch_meta(self, batch_id: str) -> dict[str, str]:
        """The batch's own hash (created_at, total, priority, …); empty when unknown."""
        return self.r.hgetall(keys.batch(batch_id))

    def recent_batches(self, tenant: str, limit: int = 20) -> list[BatchStatus]:
        """The tenant's newest batches first (at most ``limit``), as :meth:`get_batch` answers
        without jobs; ids whose records expired are dropped from the index."""
        out = []
        for batch_id in shards.newest(self.r, lambda s: keys.recent_batches(tenant, s), 0, limit):
            status = self.get_batch(batch_id, limit=0, tenant=tenant)
            if status is None:
                self.r.zrem(keys.recent_batches(tenant, keys.shard(batch_id)), batch_id)
            else:
                out.append(status)
        return out
