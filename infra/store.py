"""The job-state store: Redis hashes that are the farm's source of truth for every job.

Data flow: the producer side creates jobs here (``queued``) before their Celery messages are
published; workers move them ``running`` → ``succeeded`` | ``failed``; the status API reads them.

Every transition is one Lua script, so it is atomic and monotonic: a terminal state never
changes. Each start of a job increments its ``attempts``; a worker's later writes carry the
attempt number it was given, and a write from a stale attempt is discarded (fencing).

Keys (prefix ``rf:``):
    job:{id}          hash: batch_id, tenant, pool, state, progress, attempts, worker, created_at,
                      started_at, finished_at (epoch seconds), request/result/error (JSON)
    batch:{id}        hash: created_at, total, priority, pool, tenant
    batch:{id}:jobs   list of job ids in submission order
    batch:{id}:counts hash: one counter per state, and ``done`` = Σ progress (terminal = 1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import redis

from infra.schemas import JOB_STATES, BatchStatus, JobError, JobResult, JobStatus, RenderRequest

PREFIX = "rf:"
#: The tenant of anonymous requests when auth is off, and of records written before tenants.
PUBLIC_TENANT = "public"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def batch_key(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


# Shared preamble: KEYS[1] job hash, KEYS[2] batch counts hash. Moves the per-state counters.
_MOVE = """
local function move(old, new)
  redis.call('HINCRBY', KEYS[2], old, -1)
  redis.call('HINCRBY', KEYS[2], new, 1)
end
local function terminal(s) return s == 'succeeded' or s == 'failed' or s == 'canceled' end
"""

# start: queued|running → running, attempts += 1. Returns {attempt, request} or {0, state}.
# A running job is taken over only when its lease (ARGV[3]) has expired or it is forced (ARGV[4]).
_START = _MOVE + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {0, 'missing'} end
if terminal(state) then return {0, state} end
if state == 'running' then
  local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
  if ARGV[4] ~= '1' and lease > tonumber(ARGV[2]) then return {0, 'running'} end
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local old_progress = tonumber(redis.call('HGET', KEYS[1], 'progress') or '0')
if state ~= 'running' then move(state, 'running') end
redis.call('HINCRBYFLOAT', KEYS[2], 'done', -old_progress)
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_at', ARGV[2],
           'progress', '0', 'lease_until', ARGV[3])
return {attempt, redis.call('HGET', KEYS[1], 'request')}
"""

# progress: only for the current attempt of a running job. ARGV: attempt, progress, lease_until.
_PROGRESS = _MOVE + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'running' or redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
local old = tonumber(redis.call('HGET', KEYS[1], 'progress') or '0')
local new = tonumber(ARGV[2])
if new < old then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'lease_until', ARGV[3])
redis.call('HINCRBYFLOAT', KEYS[2], 'done', new - old)
return 1
"""

# renew: extend the lease of the current attempt of a running job. ARGV: attempt, lease_until.
_RENEW = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', ARGV[2])
return 1
"""

# finish: running (current attempt) → succeeded|failed. ARGV: attempt, state, now, field, json.
# attempt '*' finishes regardless of attempt (cancel, or an operator's fail).
_FINISH = _MOVE + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or terminal(state) then return 0 end
if ARGV[1] ~= '*' then
  if state ~= 'running' or redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
end
local old = tonumber(redis.call('HGET', KEYS[1], 'progress') or '0')
move(state, ARGV[2])
redis.call('HINCRBYFLOAT', KEYS[2], 'done', 1 - old)
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'finished_at', ARGV[3], 'progress',
           ARGV[2] == 'succeeded' and '1' or tostring(old), 'lease_until', '0')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], ARGV[4], ARGV[5]) end
return 1
"""


@dataclass(frozen=True)
class StartedJob:
    """A job a worker now holds: its ``attempt`` number fences every later write."""

    job_id: str
    batch_id: str
    attempt: int
    request: RenderRequest


@dataclass(frozen=True)
class NewJob:
    """A validated request with its ids, ready to be recorded as ``queued``."""

    job_id: str
    request: RenderRequest
    pool: str


def _ts(value: str | None) -> datetime | None:
    if not value or value == "0":
        return None
    return datetime.fromtimestamp(float(value), tz=timezone.utc)


class JobStore:
    """Job and batch records in Redis, with atomic, fenced transitions.

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True``.
        job_ttl_s: seconds after creation that job and batch records expire.
        lease_s: seconds a running job's lease lasts without renewal (progress renews it).
    """

    def __init__(self, client: redis.Redis, *, job_ttl_s: int = 7 * 24 * 3600, lease_s: float = 30.0):
        self.r = client
        self.job_ttl_s = job_ttl_s
        self.lease_s = lease_s
        self._start = client.register_script(_START)
        self._progress = client.register_script(_PROGRESS)
        self._finish = client.register_script(_FINISH)
        self._renew = client.register_script(_RENEW)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "JobStore":
        """A store on the Redis at ``url`` (``redis://`` or ``rediss://``, password allowed)."""
        return cls(redis.Redis.from_url(url, decode_responses=True), **kwargs)

    # ---- creation -------------------------------------------------------------------------
    def create_batch(self, batch_id: str, jobs: Sequence[NewJob], *, priority: str = "normal",
                     extra: dict[str, str] | None = None, tenant: str = PUBLIC_TENANT) -> None:
        """Record a batch and all its jobs as ``queued``, owned by ``tenant``, in one pipelined round trip."""
        now = repr(time.time())
        pipe = self.r.pipeline(transaction=False)
        bkey = batch_key(batch_id)
        pipe.hset(bkey, mapping={"created_at": now, "total": len(jobs), "priority": priority, "tenant": tenant,
                                 **(extra or {})})
        pipe.hset(f"{bkey}:counts", mapping={"queued": len(jobs), "done": 0})
        pipe.rpush(f"{bkey}:jobs", *[j.job_id for j in jobs])
        for job in jobs:
            pipe.hset(job_key(job.job_id), mapping={
                "batch_id": batch_id, "tenant": tenant, "pool": job.pool, "state": "queued", "progress": 0,
                "attempts": 0, "created_at": now, "request": job.request.model_dump_json(),
            })
            pipe.expire(job_key(job.job_id), self.job_ttl_s)
        for key in (bkey, f"{bkey}:counts", f"{bkey}:jobs"):
            pipe.expire(key, self.job_ttl_s)
        pipe.execute()

    # ---- worker transitions (pipelined over a batch) --------------------------------------
    def _keys(self, job_id: str, batch_id: str | None = None) -> list[str]:
        if batch_id is None:
            batch_id = self.r.hget(job_key(job_id), "batch_id") or "_"
        return [job_key(job_id), f"{batch_key(batch_id)}:counts"]

    def _batch_ids(self, job_ids: Sequence[str]) -> list[str]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(job_key(job_id), "batch_id")
        return [b or "_" for b in pipe.execute()]

    def start_many(self, job_ids: Sequence[str], worker: str, *, force: bool = False) -> dict[str, StartedJob | str]:
        """Move each job to ``running`` for ``worker``; one round trip per call, plus one lookup.

        Returns, per job id, a :class:`StartedJob`, or the reason it must not run:
        ``missing``, a terminal state, or ``running`` (another live attempt holds the lease).
        """
        now = time.time()
        batch_ids = self._batch_ids(job_ids)
        pipe = self.r.pipeline(transaction=False)
        for job_id, batch_id in zip(job_ids, batch_ids):
            self._start(keys=self._keys(job_id, batch_id),
                        args=[worker, repr(now), repr(now + self.lease_s), "1" if force else "0"], client=pipe)
        out: dict[str, StartedJob | str] = {}
        for job_id, batch_id, (attempt, payload) in zip(job_ids, batch_ids, pipe.execute()):
            if int(attempt) == 0:
                out[job_id] = payload
            else:
                out[job_id] = StartedJob(job_id, batch_id, int(attempt), RenderRequest.model_validate_json(payload))
        return out

    def progress_many(self, updates: Iterable[tuple[StartedJob, float]]) -> None:
        """Record progress 0…1 for running jobs and renew their leases, in one round trip."""
        lease_until = repr(time.time() + self.lease_s)
        pipe = self.r.pipeline(transaction=False)
        n = 0
        for job, progress in updates:
            self._progress(keys=self._keys(job.job_id, job.batch_id), args=[job.attempt, repr(progress), lease_until],
                           client=pipe)
            n += 1
        if n:
            pipe.execute()

    def renew_leases(self, jobs: Iterable[StartedJob]) -> None:
        """Extend the leases of running jobs by ``lease_s`` from now, in one round trip."""
        lease_until = repr(time.time() + self.lease_s)
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            self._renew(keys=[job_key(job.job_id)], args=[job.attempt, lease_until], client=pipe)
        if pipe.command_stack:
            pipe.execute()

    def succeed(self, job: StartedJob, result: JobResult) -> bool:
        """``running`` → ``succeeded`` for this attempt. False when the attempt is stale."""
        return self._finish_one(job.job_id, str(job.attempt), "succeeded", "result", result.model_dump_json(),
                                batch_id=job.batch_id)

    def fail(self, job: StartedJob, error: JobError) -> bool:
        """``running`` → ``failed`` for this attempt. False when the attempt is stale."""
        return self._finish_one(job.job_id, str(job.attempt), "failed", "error", error.model_dump_json(),
                                batch_id=job.batch_id)

    def cancel(self, job_id: str) -> bool:
        """Any non-terminal state → ``canceled``. False when the job is unknown or already ended."""
        return self._finish_one(job_id, "*", "canceled", "", "")

    def _finish_one(self, job_id: str, attempt: str, state: str, field: str, payload: str,
                    batch_id: str | None = None) -> bool:
        return bool(self._finish(keys=self._keys(job_id, batch_id),
                                 args=[attempt, state, repr(time.time()), field, payload]))

    # ---- reads ----------------------------------------------------------------------------
    def get_job(self, job_id: str, tenant: str | None = None) -> JobStatus | None:
        """The job's status, or None when the id is unknown (never a made-up ``queued``) or,
        with ``tenant``, belongs to another tenant."""
        return self._parse_job(job_id, self.r.hgetall(job_key(job_id)), tenant)

    def get_jobs(self, job_ids: Sequence[str]) -> list[JobStatus | None]:
        """Statuses for many ids in one round trip, in the given order."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(job_key(job_id))
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
        return self.r.lrange(f"{batch_key(batch_id)}:jobs", offset, end)

    def get_batch(self, batch_id: str, offset: int = 0, limit: int = 100,
                  tenant: str | None = None) -> BatchStatus | None:
        """Counts by state, progress 0…1 and one page of jobs; None when the id is unknown or,
        with ``tenant``, belongs to another tenant."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(batch_key(batch_id))
        pipe.hgetall(f"{batch_key(batch_id)}:counts")
        pipe.lrange(f"{batch_key(batch_id)}:jobs", offset, offset + limit - 1)
        meta, counts, ids = pipe.execute()
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
        return self.r.hgetall(batch_key(batch_id))
