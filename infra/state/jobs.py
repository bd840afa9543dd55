"""The job-state store: Redis hashes that are the farm's source of truth for every job.

Data flow: the producer side creates jobs here (``queued``) before their Celery messages are
published; workers move them ``running`` → ``succeeded`` | ``failed``; the reaper
(:mod:`infra.broker.reaper`) moves a dead worker's jobs back to ``queued``; the status API reads
them.

Every transition is one Lua script (:mod:`infra.state.scripts`), so it is atomic and monotonic: a terminal state never
changes (only an operator's dead-letter retry takes ``failed`` back to ``queued``). Each start
of a job increments its ``attempts``; a worker's later writes carry the attempt number it was
given, with the run_id of the redis-server that started it (its epoch), and a write from a
stale attempt is discarded (fencing) — also after a rollback of Redis, when a new attempt may
reuse the number but never the epoch. Per-state counters of the batch
move in the same script as the state, so they always add up to the batch's total.

A running job holds a lease (its score in ``leases``, on the Redis server's clock), renewed by progress
writes and the worker's heartbeat. Three sorted sets index the jobs the reaper must look at, so
it never scans all jobs; the scripts keep them in step with the states.

Keys (prefix ``rf:``; every key is named in :mod:`infra.keys`):
    job:{id}          hash: batch_id, tenant, pool, priority, state, progress, attempts,
                      attempt_base (attempts before the last dead-letter retry), worker,
                      created_at, started_at, finished_at, queued_at (epoch
                      seconds), request/result/error/last_error (JSON), cost_s and
                      cost_bytes (the job's share of its tenant's quota, :mod:`infra.state.quota`)
    batch:{id}        hash: created_at, total, priority, pool, tenant
    batch:{id}:jobs   list of job ids in submission order
    batch:{id}:counts hash: one counter per state, and ``done`` = Σ progress (terminal = 1)
    leases            sorted set: running job id → lease_until
    pending           sorted set: queued job id → when its message was last (re)published
    dead              sorted set: failed job id → when it failed (the dead-letter set)
    dead:{tenant}     sorted set: the same for one tenant (its dead-letter pages are paged here,
                      so a page never holds other tenants' ids and never reveals their count)
    batches:{tenant}  sorted set: the tenant's newest batch ids → created_at (the dashboard's list)

Redis Cluster: a job's and its batch's keys carry the shard of their ids as hash tag, and every
index above is split into 256 shards (:mod:`infra.state.shards`); a job is listed in its own
shard, so each script runs in one slot. Submission gives a batch's job ids the batch's shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from infra import keys
from infra.background import server_time
from infra.schemas import JobError, JobResult, JobStatus, RenderRequest
from infra.state import group_scripts, scripts, shards
from infra.state.job_reads import PUBLIC_TENANT, JobReads

#: Answers of :meth:`JobStore.progress_many` / :meth:`JobStore.renew_leases`, per job.
STALE, HELD, CANCELED = 0, 1, 2
#: Batch ids kept per tenant in its recent-batches index (the dashboard's list).
RECENT_BATCHES_MAX = 1000
#: Workers a job may be lost with (killed, or stopped by the render watchdog) before it fails,
#: whatever its charged attempts: ends any loop of refunded losses (bisection across attempts
#: refunds the attempts of jobs lost in a group; a group of 256 isolates its killer in 8 losses).
MAX_LOSSES = 12
#: Jobs recorded per call of the creation script (bounds one call's arguments: 4 per job).
CREATE_CHUNK = 5000
#: Dead-letter retries of a job that killed its worker while rendering alone.
MAX_KILL_RETRIES = 1


class RetryRefused(Exception):
    """A dead-letter retry refused for a reason the caller should show (the job killed workers)."""


@dataclass(frozen=True)
class StartedJob:
    """A job a worker now holds: its ``attempt`` number and ``epoch`` (the run_id of the
    redis-server that started it) fence every later write (:attr:`token`)."""

    job_id: str
    batch_id: str
    attempt: int
    request: RenderRequest
    tenant: str | None = None  # None: looked up when a transition needs it
    epoch: str = ""  # "": fenced by the attempt number alone
    suspect_n: int = 0  # >0: a worker was lost while it rendered in a group of this size (bisection)

    @property
    def token(self) -> str:
        """The fencing token the scripts compare: ``"{attempt}:{epoch}"`` (``"{attempt}"`` without one)."""
        return f"{self.attempt}:{self.epoch}" if self.epoch else str(self.attempt)


@dataclass(frozen=True)
class NewJob:
    """A validated request with its ids, ready to be recorded as ``queued``.

    ``request_json`` is the request exactly as its record will store it (``""``: serialized at
    recording); submission serializes once, measures it (``cost_bytes``) and records the same text.
    """

    job_id: str
    request: RenderRequest
    pool: str
    cost_s: float | None = None  # estimated GPU-seconds (infra.state.quota); None: not counted
    cost_bytes: int | None = None  # estimated bytes of the record (infra.state.quota); None: not counted
    request_json: str = field(default="", repr=False, compare=False)


class JobStore(JobReads):
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

    def __init__(self, client: redis.Redis, *, job_ttl_s: int = 7 * 24 * 3600, lease_s: float = 20.0,
                 max_attempts: int = 3):
        self.r = client
        self.job_ttl_s = job_ttl_s
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self._create = client.register_script(scripts.CREATE)
        self._start = client.register_script(scripts.START)
        self._finish = client.register_script(scripts.FINISH)
        self._requeue = client.register_script(scripts.REQUEUE)
        self._release = client.register_script(scripts.RELEASE)
        self._retry = client.register_script(scripts.RETRY)
        self._start_group = client.register_script(group_scripts.START)
        self._touch_group = client.register_script(group_scripts.TOUCH)
        self._succeed_group = client.register_script(group_scripts.SUCCEED)
        #: On Redis Cluster, a job gives its quota back to its shard's counter (its own slot);
        #: on one Redis, to the tenant's counter itself, so a submission reads one key.
        self._cluster = isinstance(client, RedisCluster)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "JobStore":
        """A store on the Redis at ``url`` (``redis://`` or ``rediss://``, password allowed)."""
        return cls(redis.Redis.from_url(url, decode_responses=True), **kwargs)

    def _run(self, script: Script, names: list[str], args: list, pipe: Any) -> None:
        """Queue one transition script on ``pipe``. redis-py's cluster pipeline refuses EVALSHA
        (it cannot load a missing script on the right node mid-pipeline), so on Redis Cluster the
        script goes as EVAL (its body each time; the server caches it by SHA1 all the same),
        routed to the one slot of its keys."""
        if self._cluster:
            pipe.execute_command("EVAL", script.script, len(names), *names, *args)
        else:
            script(keys=names, args=args, client=pipe)

    def server_time(self) -> float:
        """The Redis server's clock, epoch seconds (the clock every lease is measured on)."""
        return server_time(self.r)

    # ---- creation -------------------------------------------------------------------------
    def create_batch(self, batch_id: str, jobs: Sequence[NewJob], *, priority: str = "normal",
                     extra: dict[str, str] | None = None, tenant: str = PUBLIC_TENANT,
                     idempotency: tuple[str, int] | None = None) -> None:
        """Record a batch and all its jobs as ``queued`` (no expiry until they end; see ``job_ttl_s``),
        owned by ``tenant``, in one MULTI/EXEC round trip (all or nothing), and index the jobs in
        ``rf:pending`` (their messages are about to be published; the reaper republishes any that
        never arrive).

        ``idempotency`` = (Redis key, TTL seconds): that key is set to ``batch_id`` in the same
        transaction, so a retry never finds the key without the batch, nor the batch without it."""
        published = self.server_time()
        now = repr(time.time())
        s = keys.shard(batch_id)
        pipe = self.r.pipeline(transaction=True)  # one slot when the job ids carry the batch's shard
        bkey = keys.batch(batch_id)
        pipe.hset(bkey, mapping={"created_at": now, "total": len(jobs), "priority": priority, "tenant": tenant,
                                 **(extra or {})})
        pipe.hset(keys.batch_counts(batch_id), mapping={"queued": len(jobs), "done": 0})
        pipe.rpush(keys.batch_jobs(batch_id), *[j.job_id for j in jobs])
        common = [batch_id, tenant, priority, now, self.job_ttl_s]
        for i in range(0, len(jobs), CREATE_CHUNK):  # one script call per chunk, not one HSET per job
            chunk = jobs[i:i + CREATE_CHUNK]
            args: list = list(common)
            for job in chunk:
                args += (job.pool, job.request_json or job.request.model_dump_json(),
                         "" if job.cost_s is None else repr(job.cost_s),
                         "" if job.cost_bytes is None else job.cost_bytes)
            self._run(self._create, [keys.job(j.job_id) for j in chunk], args, pipe)
        for js, ids in shards.by_shard(j.job_id for j in jobs).items():
            pipe.zadd(keys.pending(js), dict.fromkeys(ids, published))
        recent = keys.recent_batches(tenant, s)
        pipe.zadd(recent, {batch_id: float(now)})
        pipe.zremrangebyrank(recent, 0, -RECENT_BATCHES_MAX - 1)
        pipe.expire(recent, self.job_ttl_s)
        if idempotency is not None:
            pipe.set(idempotency[0], batch_id, ex=idempotency[1])
        pipe.execute()

    # ---- worker transitions (pipelined over a batch) --------------------------------------
    def _keys(self, job_id: str, batch_id: str | None = None, tenant: str | None = None) -> list[str]:
        if batch_id is None or tenant is None:
            batch_id, tenant = self._owners([job_id])[0]
        s = keys.shard(job_id)
        return [keys.job(job_id), keys.batch_counts(batch_id), keys.leases(s), keys.pending(s), keys.dead(s),
                keys.dead_of(tenant, s), keys.batch(batch_id), keys.batch_jobs(batch_id),
                keys.quota_returned(tenant, s) if self._cluster else keys.quota(tenant)]

    def _owners(self, job_ids: Sequence[str]) -> list[tuple[str, str]]:
        """``(batch_id, tenant)`` per job id, in one round trip (``"_"`` for an unknown job)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), "batch_id", "tenant")
        return [(b or "_", t or (PUBLIC_TENANT if b else "_")) for b, t in pipe.execute()]

    def start_many(self, job_ids: Sequence[str], worker: str, *, force: bool = False) -> dict[str, StartedJob | str]:
        """Move each job to ``running`` for ``worker`` with a fresh lease; two round trips (one
        script call per shard of the jobs, :mod:`infra.state.group_scripts`), and a third for
        running jobs whose lease expired (or all running ones, forced), which the one-job start
        script takes over, accounting the lost attempt first.

        A repeated id is started once. Returns, per job id, a :class:`StartedJob`, or the reason
        it must not run: ``missing``, a terminal state, or ``running`` (another attempt holds a
        live lease). ``force`` takes over a running job whatever its lease (operators only).
        """
        job_ids = list(dict.fromkeys(job_ids))
        owners = dict(zip(job_ids, self._owners(job_ids)))
        answers = self._grouped(self._start_group, [(j, *owners[j]) for j in job_ids],
                                [worker, repr(self.lease_s), "1" if force else "0"], lambda job_id: [job_id])
        single = [j for j in job_ids if int(answers[j][0]) < 0]  # expired or forced: the one-job script
        if single:  # accounts the lost attempt first
            pipe = self.r.pipeline(transaction=False)
            for job_id in single:
                self._run(self._start, self._keys(job_id, *owners[job_id]),
                          [job_id, worker, repr(self.lease_s), "1" if force else "0", self.max_attempts, MAX_LOSSES],
                          pipe)
            answers.update(zip(single, pipe.execute()))
        out: dict[str, StartedJob | str] = {}
        for job_id in job_ids:
            (attempt, payload, *rest), (batch_id, tenant) = answers[job_id], owners[job_id]
            if int(attempt) == 0:
                out[job_id] = payload
            else:
                out[job_id] = StartedJob(job_id, batch_id, int(attempt), RenderRequest.model_validate_json(payload),
                                         tenant, rest[0] if rest else "", int(rest[1]) if len(rest) > 1 else 0)
        return out

    def _grouped(self, script: Script, jobs: Sequence[tuple[str, str, str | None]], head: list,
                 per_job: Callable[[str], list]) -> dict[str, Any]:
        """Run a per-group script (:mod:`infra.state.group_scripts`) once per shard of ``jobs``
        (``(job_id, batch_id, tenant)``, one slot each on Redis Cluster), all in one round trip:
        ``head`` then ``per_job(job_id)`` as arguments. Returns each job's answer by id."""
        groups = self._shard_groups(jobs)
        pipe = self.r.pipeline(transaction=False)
        for group, names in groups:
            self._run(script, names, [*head, *(arg for j, _, _ in group for arg in per_job(j))], pipe)
        return {j: answer for (group, _), answers in zip(groups, pipe.execute() if groups else [])
                for (j, _, _), answer in zip(group, answers)}

    def _shard_groups(self, jobs: Sequence[tuple[str, str, str | None]]) -> list[tuple[list, list[str]]]:
        """``jobs`` (``(job_id, batch_id, tenant)``) by the shard of their ids, each group with the
        keys of its script call (nine per job; one slot on Redis Cluster)."""
        groups: dict[str, list[tuple[str, str, str | None]]] = {}
        for job in jobs:
            groups.setdefault(keys.shard(job[0]), []).append(job)
        return [(group, [name for j, b, t in group for name in self._keys(j, b, t)]) for group in groups.values()]

    def progress_many(self, updates: Iterable[tuple[StartedJob, float]]) -> dict[str, int]:
        """Record progress 0…1 for running jobs and renew their leases, in one round trip.

        Returns, per job id, :data:`HELD` (this attempt still holds the job), :data:`CANCELED`
        (canceled meanwhile: stop working on it) or :data:`STALE` (another attempt or a
        terminal state owns it: discard this attempt's work).
        """
        return self._touch((job, repr(progress), "") for job, progress in updates)

    def renew_leases(self, jobs: Iterable[StartedJob], *, rendered: bool = False) -> dict[str, int]:
        """Extend the leases of running jobs by ``lease_s`` from now, in one round trip; answers
        as :meth:`progress_many` does, so it also tells whether each job is still held. With
        ``rendered``, also record that their render is over (see :meth:`mark_rendering`)."""
        return self._touch((job, "", "0" if rendered else "") for job in jobs)

    def mark_rendering(self, jobs: Sequence[StartedJob], rendered: Sequence[StartedJob] = ()) -> dict[str, int]:
        """Record that this attempt now renders ``jobs`` as one group (their ``group_n``, read by
        the reaper should the worker be lost: bisection across attempts, :mod:`infra.state.scripts`)
        and that the render of ``rendered`` (the group before, still being stored) is over, so
        that a crash from here on is not laid on them; renews all their leases, in one round
        trip, and answers as :meth:`renew_leases`."""
        group = str(len(jobs))
        return self._touch([*((job, "", "0") for job in rendered), *((job, "", group) for job in jobs)])

    def _touch(self, updates: Iterable[tuple[StartedJob, str, str]]) -> dict[str, int]:
        updates = list(updates)  # a job twice: its last update wins, as one write after another would
        args = {job.job_id: [job.job_id, job.token, progress, group] for job, progress, group in updates}
        jobs = {job.job_id: job for job, _, _ in updates}
        return {j: int(code) for j, code in self._grouped(
            self._touch_group, [(j, job.batch_id, job.tenant or PUBLIC_TENANT) for j, job in jobs.items()],
            [repr(self.lease_s)], args.__getitem__).items()}

    def succeed(self, job: StartedJob, result: JobResult) -> bool:
        """``running`` → ``succeeded`` for this attempt. False when the attempt is stale."""
        return bool(self._finish_one(job.job_id, job.token, "succeeded", "result", result.model_dump_json(),
                                     batch_id=job.batch_id, tenant=job.tenant))

    def succeed_many(self, results: Sequence[tuple[StartedJob, JobResult]]) -> dict[str, bool]:
        """:meth:`succeed` for a group's jobs in one round trip (one script call per shard of the
        jobs, :mod:`infra.state.group_scripts`, in which each job is fenced on its own by its
        attempt's ``attempt:epoch`` token; jobs
        started by :meth:`start_many` carry their tenant, so no lookup precedes it). Returns, per
        job id, False for a stale attempt."""
        payloads = {job.job_id: [job.job_id, job.token, result.model_dump_json()] for job, result in results}
        answers = self._grouped(self._succeed_group, [(job.job_id, job.batch_id, job.tenant) for job, _ in results],
                                [], payloads.__getitem__)
        return {job.job_id: bool(int(answers[job.job_id])) for job, _ in results}

    def fail(self, job: StartedJob, error: JobError, *, retry: bool = False) -> str | None:
        """``running`` → ``failed`` for this attempt, listed in the dead-letter set.

        With ``retry`` (a transient error: storage or broker away, out of memory) and attempts
        left, the job goes back to ``queued`` instead, its error kept as ``last_error``; the
        caller republishes it. Returns ``"failed"``, ``"queued"``, or None when the attempt is stale.
        """
        code = self._finish_one(job.job_id, job.token, "failed", "error", error.model_dump_json(),
                                batch_id=job.batch_id, tenant=job.tenant, retry=retry)
        return {1: "failed", 2: "queued"}.get(code)

    def cancel(self, job_id: str) -> bool:
        """Any non-terminal state → ``canceled``. False when the job is unknown or already ended.

        A running job's worker learns it at its next progress write and drops the job."""
        return bool(self._finish_one(job_id, "*", "canceled", "", ""))

    def _finish_one(self, job_id: str, attempt: str, state: str, field: str, payload: str,
                    batch_id: str | None = None, tenant: str | None = None, retry: bool = False) -> int:
        return int(self._finish(keys=self._keys(job_id, batch_id, tenant),
                                args=[job_id, attempt, state, field, payload, "1" if retry else "0",
                                      self.max_attempts]))

    def release(self, jobs: Iterable[StartedJob]) -> list[tuple[str, str]]:
        """Give running jobs back (worker shutting down): this attempt → ``queued``, without
        spending the attempt budget. Returns ``(job_id, pool)`` of those released, to republish."""
        jobs = list(jobs)
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            self._run(self._release, self._keys(job.job_id, job.batch_id, job.tenant),
                      [job.job_id, job.token], pipe)
        return [(job.job_id, pool) for job, (code, pool) in zip(jobs, pipe.execute() if jobs else []) if int(code)]

    # ---- recovery (the reaper) ------------------------------------------------------------
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
