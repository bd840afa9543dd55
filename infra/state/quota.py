"""Per-tenant quotas on outstanding work: jobs, estimated GPU-seconds, and bytes of job records.

Place in the data flow: submission (:mod:`infra.submission.submitter`) **reserves** a batch's jobs,
GPU-seconds and bytes here before recording it (429 with ``Retry-After`` over the quota, 413 for
one request larger than the quota itself) → the job-state store's Lua transitions give each job's
share back when it ends and take it again on a dead-letter retry
(:mod:`infra.state.scripts`). So the counters are the tenant's queued + running work.

A job's cost is an estimate of the accelerator time it takes: its pool's seconds per
megapixel-step (``PoolSpec.s_per_mpx_step``, or ``RENDERFARM_DEFAULT_S_PER_MPX_STEP``) × width ×
height / 10⁶ × steps. The dispatcher (:mod:`infra.broker.dispatch`) shares pools between
tenants by the same cost, so one 150-step 1024² job weighs as much as ~75 512² 8-step ones.

A job's bytes are what its record holds in Redis (:func:`job_bytes`): the request as stored (its
JSON, prompts and metadata included; up to ~145 KB of UTF-8 for 2 × 2,000 characters and 32
× 1,024 of metadata) plus a fixed share for the record's other fields, its index and lane
entries and Redis's own overhead. Computed once at submission and kept on the record
(``cost_bytes``), so the give-back is exactly what was reserved; a record without the field
(written before this quota) gives back 0. Jobs and GPU-seconds alone do not bound memory: at
the job quota a tenant of 100 KB records would hold ~20 GB in a Redis that never evicts.

Keys: ``rf:quota:{tenant}`` hash ``jobs``, ``gpu_s``, ``bytes``. On one Redis the transitions give
back to this hash itself. On Redis Cluster each transition script must stay in its job's slot, so a job
gives back to its shard's hash ``rf:quota:{tenant}:{s}`` (negative counts, :mod:`infra.keys`) and
the outstanding work is the tenant's hash plus every shard's: with a limit set, a submission
reads the 256 shards first (one pipelined round trip) and passes their sum to the reservation
script; a dead-letter retry racing that read is counted at the next submission.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster

from infra import keys
from infra.video import frames_factor

#: Bytes a job's record holds in Redis besides its request's JSON: its other fields (state, times,
#: attempt, worker, epoch, the result or error written when it ends), the hash's and its entries'
#: overhead, its entries in ``rf:pending``, its batch's job list and its wait lane. Measured on
#: Redis 7.0 (jemalloc) with JobStore and enqueue: 1.9–2.5 KB for an ended job of a short prompt.
#: The allocator rounds a large request value up to its size class (up to 25 % more for 100 KB);
#: the default byte quota leaves room for that.
JOB_RECORD_OVERHEAD_BYTES = 2560

# KEYS[1] quota hash, KEYS[2] its holds (zset, same slot). ARGV: jobs, gpu_s, bytes, max_jobs,
# max_gpu_s, max_bytes (0 = no limit each), the shards' returned jobs, gpu_s and bytes (≤ 0), then
# the hold (member "batch|jobs|gpu_s|bytes"; "" = none) and its lifetime in seconds. Returns
# {1, jobs, gpu_s, bytes} reserved (and held until the batch is recorded), or {0, jobs, gpu_s,
# bytes} (nothing changed): the outstanding usage before.
_RESERVE = """
local function field(name, back)
  return (tonumber(redis.call('HGET', KEYS[1], name) or '0') or 0) + tonumber(back)
end
local jobs, gpu, bytes = field('jobs', ARGV[7]), field('gpu_s', ARGV[8]), field('bytes', ARGV[9])
local add_jobs, add_gpu, add_bytes = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_jobs, max_gpu, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local usage = {tostring(jobs), tostring(gpu), string.format('%d', bytes)}
if (max_jobs > 0 and jobs + add_jobs > max_jobs) or (max_gpu > 0 and gpu + add_gpu > max_gpu) or
   (max_bytes > 0 and bytes + add_bytes > max_bytes) then
  return {0, usage[1], usage[2], usage[3]}
end
redis.call('HINCRBY', KEYS[1], 'jobs', add_jobs)
redis.call('HINCRBYFLOAT', KEYS[1], 'gpu_s', add_gpu)
if add_bytes ~= 0 then redis.call('HINCRBY', KEYS[1], 'bytes', add_bytes) end
if ARGV[10] ~= '' and tonumber(ARGV[11]) > 0 then
  local now = redis.call('TIME')  -- the deadline to the microsecond: a hold lives hold_s, never less
  local deadline = tonumber(now[1]) + tonumber(ARGV[11]) + tonumber(now[2]) / 1000000
  redis.call('ZADD', KEYS[2], string.format('%.6f', deadline), ARGV[10])
end
return {1, usage[1], usage[2], usage[3]}
"""

# KEYS[1] quota hash, KEYS[2] its holds. ARGV: the hold (member "batch|jobs|gpu_s|bytes", or
# "batch|jobs|gpu_s" as held before the byte quota), "1" to give its share back (its batch was
# never recorded). Returns 1 when this call removed the hold (so two sweepers never give one hold
# back twice).
_DROP_HOLD = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '1' then
  local parts = {}
  for part in string.gmatch(ARGV[1], '[^|]+') do table.insert(parts, part) end
  redis.call('HINCRBY', KEYS[1], 'jobs', -tonumber(parts[2]))
  redis.call('HINCRBYFLOAT', KEYS[1], 'gpu_s', -tonumber(parts[3]))
  local bytes = tonumber(parts[4] or '0') or 0
  if bytes ~= 0 then redis.call('HINCRBY', KEYS[1], 'bytes', -bytes) end
end
return 1
"""


def job_cost_s(width: int, height: int, steps: int, s_per_mpx_step: float) -> float:
    """Estimated accelerator seconds of one render: ``s_per_mpx_step`` × megapixels × steps."""
    return s_per_mpx_step * width * height / 1e6 * steps


def request_cost_s(request: Any, s_per_mpx_step: float) -> float:
    """Estimated accelerator seconds of ``request`` (a RenderRequest): :func:`job_cost_s` at the
    steps it runs (img2img and inpainting about ``num_inference_steps × strength``, at least 1),
    times its frames for a video (:func:`infra.video.frames_factor`). What the quota charges and
    what a worker's time budgets scale by (``worker.budgets``)."""
    steps = request.num_inference_steps * (request.effective_strength or 1.0)
    return job_cost_s(request.width, request.height, max(1, round(steps)), s_per_mpx_step) * frames_factor(request)


def job_bytes(request_json: str) -> int:
    """Estimated bytes of one job's record in Redis: the request exactly as stored (its JSON,
    UTF-8 encoded) plus :data:`JOB_RECORD_OVERHEAD_BYTES`. Stable: the same request always costs
    the same, so the record keeps it and gives back exactly what was reserved."""
    return len(request_json.encode("utf-8")) + JOB_RECORD_OVERHEAD_BYTES


class Usage(NamedTuple):
    """A tenant's outstanding work: ``jobs``, estimated ``gpu_s`` (seconds) and ``bytes`` of job
    records (:func:`job_bytes`)."""

    jobs: int
    gpu_s: float
    bytes: int


@dataclass(frozen=True)
class QuotaExceeded(Exception):
    """A submission over the tenant's quota: ``status`` 413 (the request alone is larger than
    the quota) or 429 (try again after ``retry_after_s``, when enough work has ended)."""

    status: int
    message: str
    retry_after_s: int = 0

    def __str__(self) -> str:
        return self.message


def _num(x: float) -> str:
    """A count for a message: an integer in full (bytes), a float shortly."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _hold(batch_id: str, jobs: int, gpu_s: float, nbytes: int) -> str:
    """The member of a held reservation in ``rf:quota-holds``: ``batch|jobs|gpu_s|bytes``."""
    return f"{batch_id}|{jobs}|{gpu_s!r}|{nbytes}"


class Quotas:
    """The tenant counters and the reservation check.

    Args:
        client: Redis with ``decode_responses=True``.
        max_jobs: outstanding jobs per tenant (0: no limit).
        max_gpu_s: outstanding estimated GPU-seconds per tenant (0: no limit).
        max_bytes: outstanding bytes of job records per tenant (:func:`job_bytes`; 0: no limit).
        sharded: whether jobs give their share back to per-shard hashes (default: whether the
            client is a RedisCluster, the same choice as :class:`infra.state.job_store.JobStore`'s).
        hold_s: seconds a reservation may wait for its batch to be recorded (at least that
            long: its deadline is the Redis clock's time to the microsecond plus ``hold_s``); after that the
            reaper (:meth:`reclaim_abandoned`) gives back the reservation of a batch that never
            was (the API killed between the two writes). The API's is ``RENDERFARM_QUOTA_HOLD_S``.
    """

    def __init__(self, client: redis.Redis, max_jobs: int = 0, max_gpu_s: float = 0.0,
                 sharded: bool | None = None, hold_s: int = 60, max_bytes: int = 0):
        self.r = client
        self.sharded = isinstance(client, RedisCluster) if sharded is None else sharded
        self.max_jobs = max_jobs
        self.max_gpu_s = max_gpu_s
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._reserve = client.register_script(_RESERVE)
        self._drop_hold = client.register_script(_DROP_HOLD)

    def usage(self, tenant: str) -> Usage:
        """``tenant``'s outstanding jobs, GPU-seconds and bytes (:class:`Usage`)."""
        jobs, gpu, nbytes = self.r.hmget(keys.quota(tenant), "jobs", "gpu_s", "bytes")
        back = self._returned(tenant)
        return Usage(int(jobs or 0) + back.jobs, float(gpu or 0) + back.gpu_s, int(nbytes or 0) + back.bytes)

    def _returned(self, tenant: str) -> Usage:
        """What the tenant's ended jobs gave back, summed over the shards (≤ 0); all 0 on one
        Redis, where they gave it back to the tenant's hash itself."""
        if not self.sharded:
            return Usage(0, 0.0, 0)
        pipe = self.r.pipeline(transaction=False)
        for s in keys.SHARDS:
            pipe.hmget(keys.quota_returned(tenant, s), "jobs", "gpu_s", "bytes")
        answers = pipe.execute()
        return Usage(sum(int(j or 0) for j, _, _ in answers), sum(float(g or 0) for _, g, _ in answers),
                     sum(int(b or 0) for _, _, b in answers))

    def reserve(self, tenant: str, jobs: int, gpu_s: float, nbytes: int = 0, *, batch_id: str = "",
                drain_gpu_s_per_s: float = 1.0) -> None:
        """Count ``jobs``, ``gpu_s`` (seconds) and ``nbytes`` (bytes of job records) against
        ``tenant``'s quota, atomically (one script), or refuse. With a ``batch_id``, the
        reservation is also held (``rf:quota-holds``) until :meth:`recorded` says the batch exists,
        so a submission that dies between the two writes is given back.

        Args:
            drain_gpu_s_per_s: GPU-seconds the farm finishes per second for this tenant (its live
                workers), to estimate ``Retry-After``.
        Raises:
            QuotaExceeded: 413 when the request alone exceeds a quota; 429 when the tenant's
                outstanding work plus the request does (nothing is counted then).
        """
        for size, limit, what in ((jobs, self.max_jobs, "jobs"), (gpu_s, self.max_gpu_s, "GPU-seconds"),
                                  (nbytes, self.max_bytes, "bytes of job records")):
            if limit and size > limit:
                raise QuotaExceeded(413, f"this request's {_num(size)} {what} exceed the tenant's quota of "
                                         f"{_num(limit)} outstanding {what}; split it")
        limited = self.max_jobs or self.max_gpu_s or self.max_bytes
        back = self._returned(tenant) if limited else Usage(0, 0.0, 0)
        if batch_id:
            self.r.sadd(keys.QUOTA_HOLDERS, tenant)  # before the hold: the reaper finds the tenant
        ok, used_jobs, used_gpu, used_bytes = self._reserve(
            keys=[keys.quota(tenant), keys.quota_holds(tenant)],
            args=[jobs, repr(gpu_s), nbytes, self.max_jobs, repr(self.max_gpu_s), self.max_bytes,
                  back.jobs, repr(back.gpu_s), back.bytes, _hold(batch_id, jobs, gpu_s, nbytes) if batch_id else "",
                  self.hold_s if batch_id else 0])
        if int(ok):
            return
        used = Usage(int(used_jobs), float(used_gpu), int(used_bytes))
        raise QuotaExceeded(429, f"over the tenant's quota: {used.jobs} jobs, {used.gpu_s:.0f} GPU-seconds and "
                                 f"{used.bytes} bytes outstanding (limits {self.max_jobs or '∞'} jobs, "
                                 f"{self.max_gpu_s or '∞'} GPU-seconds, {self.max_bytes or '∞'} bytes)",
                            self._retry_after(used, gpu_s, nbytes, drain_gpu_s_per_s))

    def _retry_after(self, used: Usage, gpu_s: float, nbytes: int, drain_gpu_s_per_s: float) -> int:
        """Seconds until enough outstanding work should have ended for a refused request (1…3600):
        the GPU-seconds over the quota at the farm's drain rate; for bytes over it, the same share
        of the outstanding GPU-seconds (records end as their work does); else 10."""
        drain = max(drain_gpu_s_per_s, 1e-3)
        waits = []
        if self.max_gpu_s and used.gpu_s + gpu_s > self.max_gpu_s:
            waits.append((used.gpu_s + gpu_s - self.max_gpu_s) / drain)
        if self.max_bytes and used.bytes + nbytes > self.max_bytes and used.bytes > 0 and used.gpu_s > 0:
            waits.append((used.bytes + nbytes - self.max_bytes) / used.bytes * used.gpu_s / drain)
        return max(1, min(3600, round(max(waits)))) if waits else 10

    def release(self, tenant: str, jobs: int, gpu_s: float, nbytes: int = 0, *, batch_id: str) -> None:
        """Give back a reservation whose batch was not recorded (and drop its hold); the same
        arguments as its :meth:`reserve`."""
        self._drop_hold(keys=[keys.quota(tenant), keys.quota_holds(tenant)],
                        args=[_hold(batch_id, jobs, gpu_s, nbytes), "1"])

    def recorded(self, tenant: str, jobs: int, gpu_s: float, nbytes: int = 0, *, batch_id: str) -> None:
        """The batch of a held reservation is recorded: its jobs now give their share back as
        they end, so the hold goes (without giving anything back); the same arguments as its
        :meth:`reserve`."""
        self._drop_hold(keys=[keys.quota(tenant), keys.quota_holds(tenant)],
                        args=[_hold(batch_id, jobs, gpu_s, nbytes), "0"])
    def reclaim_abandoned(self, batch_exists: Callable[[str], bool], limit: int = 1000) -> int:
        """Give back the reservations held past their lifetime whose batch was never recorded
        (the submission died between the reservation and the batch's MULTI/EXEC); drop the holds
        of batches that exist. Run by the reaper. Returns how many holds were given back.

        A batch whose write is still in flight after ``hold_s`` seconds would be given back
        too; the default 60 s (``RENDERFARM_QUOTA_HOLD_S``) is far beyond a 10,000-job submission (~0.5 s)."""
        given = 0
        seconds, microseconds = self.r.time()
        now = seconds + microseconds / 1e6  # deadlines carry microseconds (whole seconds before)
        for tenant in self.r.smembers(keys.QUOTA_HOLDERS):
            holds = keys.quota_holds(tenant)
            expired = self.r.zrangebyscore(holds, "-inf", now, start=0, num=limit)
            for member in expired:
                abandoned = not batch_exists(member.split("|", 1)[0])
                dropped = int(self._drop_hold(keys=[keys.quota(tenant), holds],
                                              args=[member, "1" if abandoned else "0"]))
                given += dropped if abandoned else 0
            if not self.r.exists(holds):
                self.r.srem(keys.QUOTA_HOLDERS, tenant)  # a new hold re-adds the tenant first
        return given
