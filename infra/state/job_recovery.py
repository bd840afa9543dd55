"""Recovery and dead letters: what the reaper asks of the job records, and an operator's retry.

Place in the data flow: the reaper (:mod:`infra.broker.reaper`) → **here**: running jobs whose
lease expired go back to ``queued`` (or fail, their attempts or losses spent), queued jobs whose
message never arrived are found for republishing; the status API's dead-letter routes page the
failed jobs and retry one. Part of :class:`infra.state.job_store.JobStore`.
"""

from __future__ import annotations

from collections.abc import Sequence

from infra import keys
from infra.schemas import JobStatus
from infra.state import shards
from infra.state.job_records import MAX_LOSSES, JobRecords

#: Dead-letter retries of a job that killed its worker while rendering alone.
MAX_KILL_RETRIES = 1


class RetryRefused(Exception):
    """A dead-letter retry refused for a reason the caller should show (the job killed workers)."""


class JobRecovery(JobRecords):
    """The reaper's reads and transitions (expired leases, stale pending messages) and the
    dead-letter set's pages and retries."""

    def expired_leases(self, limit: int = 1000) -> list[str]:
        """Ids of running jobs whose lease ran out by the Redis server's clock (oldest first)."""
        return shards.oldest(self.r, keys.leases, self.server_time(), limit)

    def requeue_expired(self, job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """For each job, atomically: if it is still running with an expired lease, move it back
        to ``queued`` (attempt kept) or, with its attempt budget (or :data:`MAX_LOSSES`) spent, to
        ``failed`` with a ``WorkerLost`` error and into the dead-letter set. The attempt is charged
        only when the job was rendering alone; lost in a larger group, it becomes a suspect that
        its next attempts render in halves of that group (bisection across attempts).

        Returns, per job that moved, ``("queued", pool)`` (to republish) or ``("failed", "")``.
        Safe with several reapers at once: a job moves at most once per expiry.
        """
        owners = self._owners(job_ids)
        pipe = self.r.pipeline(transaction=False)
        for job_id, (batch_id, tenant) in zip(job_ids, owners):
            self._run(self._requeue, self._keys(job_id, batch_id, tenant), [job_id, self.max_attempts, MAX_LOSSES],
                      pipe)
        out = {}
        for job_id, (code, pool) in zip(job_ids, pipe.execute() if job_ids else []):
            if int(code) == 1:
                out[job_id] = ("queued", pool)
            elif int(code) == 2:
                out[job_id] = ("failed", "")
        return out

    def stale_pending(self, older_than_s: float, limit: int = 1000) -> list[str]:
        """Ids of ``queued`` jobs last (re)published more than ``older_than_s`` seconds ago."""
        cutoff = self.server_time() - older_than_s
        return shards.oldest(self.r, keys.pending, cutoff, limit)

    def mark_published(self, job_ids: Sequence[str]) -> None:
        """Note that the messages of these still-``queued`` jobs were (re)published, or seen in a
        queue, just now (jobs no longer pending are left alone)."""
        if job_ids:
            now = self.server_time()
            pipe = self.r.pipeline(transaction=False)
            for s, ids in shards.by_shard(job_ids).items():
                pipe.zadd(keys.pending(s), dict.fromkeys(ids, now), xx=True)
            pipe.execute()

    def routes(self, job_ids: Sequence[str]) -> list[tuple[str, str, str, str]]:
        """``(job_id, state, pool, priority)`` per known job, to republish its message."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), "state", "pool", "priority")
        return [(j, state, pool, priority or "normal")
                for j, (state, pool, priority) in zip(job_ids, pipe.execute()) if state and pool]

    def forget(self, job_id: str, tenant: str | None = None) -> None:
        """Drop a job id from every index (its record has expired); with ``tenant``, from that
        tenant's dead-letter index too."""
        s = keys.shard(job_id)
        pipe = self.r.pipeline(transaction=False)
        for key in (keys.leases(s), keys.pending(s), keys.dead(s), *((keys.dead_of(tenant, s),) if tenant else ())):
            pipe.zrem(key, job_id)
        pipe.execute()

    # ---- dead letters ---------------------------------------------------------------------
    def dead_letters(self, offset: int = 0, limit: int = 100,
                     tenant: str | None = None) -> tuple[bool, list[JobStatus]]:
        """One page of the dead-letter set (failed jobs, newest first): ``(more pages follow,
        statuses)``. With ``tenant``, the page is taken from that tenant's own index
        (``rf:dead:{tenant}``), so it holds only its jobs and ``offset`` counts only them.
        Expired ids are dropped from the indexes. The shards are merged by failure time: a page
        reads up to ``offset + limit + 1`` entries of each shard."""
        ids = shards.newest(self.r, keys.dead if tenant is None else lambda s: keys.dead_of(tenant, s),
                            offset, limit + 1)
        more, ids = len(ids) > limit, ids[:limit]
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        jobs = []
        for job_id, h in zip(ids, pipe.execute() if ids else []):
            if not h:
                self.forget(job_id, tenant)
            elif (job := self._parse_job(job_id, h, tenant)) is not None:
                jobs.append(job)
        return more, jobs

    def retry(self, job_id: str) -> str | None:
        """A failed job → ``queued`` with a fresh attempt budget (the attempt counter, which
        fences, keeps counting). Returns its pool, to republish its message; None when the job
        is unknown or not failed.

        Raises:
            RetryRefused: the job killed its worker while rendering alone and has had its
                :data:`MAX_KILL_RETRIES` retries: running it again would kill workers again."""
        code, pool, *kills = self._retry(keys=self._keys(job_id), args=[job_id, MAX_KILL_RETRIES])
        if not int(code) and pool == "killer":
            raise RetryRefused(f"job {job_id!r} killed its worker {kills[0]} time(s) while rendering alone and was "
                               f"retried {MAX_KILL_RETRIES} time(s) already; it is not retried again")
        return pool if int(code) else None
