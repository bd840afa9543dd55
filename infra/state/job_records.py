"""The job records: Redis hashes that are the farm's source of truth for every job, their
layout, their creation, and the plumbing every transition runs on.

Data flow: the producer side creates jobs here (``queued``) before their Celery messages are
published; workers move them ``running`` → ``succeeded`` | ``failed``; the reaper
(:mod:`infra.broker.reaper`) moves a dead worker's jobs back to ``queued``; the status API reads
them. :class:`infra.state.job_store.JobStore` is the whole store; its parts are this module
(:class:`JobRecords`: the layout, :meth:`~JobRecords.create_batch`, the keys and scripts of a
transition), :mod:`infra.state.job_transitions` (a worker's), :mod:`infra.state.job_recovery`
(the reaper's and the dead letters') and :mod:`infra.state.job_reads` (the statuses).

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from infra import keys
from infra.background import server_time
from infra.schemas import RenderRequest
from infra.state import group_scripts, scripts, shards
from infra.state.job_reads import PUBLIC_TENANT, JobReads

#: Batch ids kept per tenant in its recent-batches index (the dashboard's list).
RECENT_BATCHES_MAX = 1000
#: Workers a job may be lost with (killed, or stopped by the render watchdog) before it fails,
#: whatever its charged attempts: ends any loop of refunded losses (bisection across attempts
#: refunds the attempts of jobs lost in a group; a group of 256 isolates its killer in 8 losses).
MAX_LOSSES = 12
#: Jobs recorded per call of the creation script (bounds one call's arguments: 4 per job).
CREATE_CHUNK = 5000


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


class JobRecords(JobReads):
    """The store's Redis, its settings and its registered scripts, the batch's creation, and
    the keys and owners every transition needs; :class:`infra.state.job_store.JobStore` adds
    the transitions. Args as :class:`~infra.state.job_store.JobStore`'s."""

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

    def _keys(self, job_id: str, batch_id: str | None = None, tenant: str | None = None) -> list[str]:
        """The nine keys of a transition script for one job (its record, its batch's counters,
        hash and list, its shard of each index, its tenant's quota counter); the owners are
        looked up when not given."""
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
