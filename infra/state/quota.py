"""Per-tenant quotas on outstanding work: jobs, and estimated GPU-seconds.

Place in the data flow: submission (:mod:`infra.api.submission`) **reserves** a batch's jobs
and GPU-seconds here before recording it (429 with ``Retry-After`` over the quota, 413 for one
request larger than the quota itself) → the job-state store's Lua transitions give each job's
share back when it ends and take it again on a dead-letter retry
(:mod:`infra.state.scripts`). So the counters are the tenant's queued + running work.

A job's cost is an estimate of the accelerator time it takes: its pool's seconds per
megapixel-step (``PoolSpec.s_per_mpx_step``, or ``RENDERFARM_DEFAULT_S_PER_MPX_STEP``) × width ×
height / 10⁶ × steps. The dispatcher (:mod:`infra.broker.dispatch`) shares pools between
tenants by the same cost, so one 150-step 1024² job weighs as much as ~75 512² 8-step ones.

Keys: ``rf:quota:{tenant}`` hash ``jobs``, ``gpu_s``. On one Redis the transitions give back to
this hash itself. On Redis Cluster each transition script must stay in its job's slot, so a job
gives back to its shard's hash ``rf:quota:{tenant}:{s}`` (negative counts, :mod:`infra.keys`) and
the outstanding work is the tenant's hash plus every shard's: with a limit set, a submission
reads the 256 shards first (one pipelined round trip) and passes their sum to the reservation
script; a dead-letter retry racing that read is counted at the next submission.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster

from infra import keys

# KEYS[1] quota hash, KEYS[2] its holds (zset, same slot). ARGV: jobs, gpu_s, max_jobs (0 = none),
# max_gpu_s (0 = none), the shards' returned jobs and gpu_s (≤ 0), then the batch id and the
# hold's lifetime in seconds. Returns {1, jobs, gpu_s} reserved (and held until the batch is
# recorded), or {0, jobs, gpu_s} (nothing changed): the outstanding usage before.
_RESERVE = """
local jobs = (tonumber(redis.call('HGET', KEYS[1], 'jobs') or '0') or 0) + tonumber(ARGV[5])
local gpu = (tonumber(redis.call('HGET', KEYS[1], 'gpu_s') or '0') or 0) + tonumber(ARGV[6])
local add_jobs, add_gpu = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_jobs, max_gpu = tonumber(ARGV[3]), tonumber(ARGV[4])
if (max_jobs > 0 and jobs + add_jobs > max_jobs) or (max_gpu > 0 and gpu + add_gpu > max_gpu) then
  return {0, tostring(jobs), tostring(gpu)}
end
redis.call('HINCRBY', KEYS[1], 'jobs', add_jobs)
redis.call('HINCRBYFLOAT', KEYS[1], 'gpu_s', add_gpu)
if tonumber(ARGV[8]) > 0 then
  local now = redis.call('TIME')
  redis.call('ZADD', KEYS[2], tonumber(now[1]) + tonumber(ARGV[8]), ARGV[7] .. '|' .. ARGV[1] .. '|' .. ARGV[2])
end
return {1, tostring(jobs), tostring(gpu)}
"""

# KEYS[1] quota hash, KEYS[2] its holds. ARGV: the hold (member), "1" to give its jobs and
# GPU-seconds back (its batch was never recorded). Returns 1 when this call removed the hold
# (so two sweepers never give one hold back twice).
_DROP_HOLD = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '1' then
  local _, jobs, gpu = string.match(ARGV[1], '^(.*)|([^|]*)|([^|]*)$')
  redis.call('HINCRBY', KEYS[1], 'jobs', -tonumber(jobs))
  redis.call('HINCRBYFLOAT', KEYS[1], 'gpu_s', -tonumber(gpu))
end
return 1
"""


def job_cost_s(width: int, height: int, steps: int, s_per_mpx_step: float) -> float:
    """Estimated accelerator seconds of one render: ``s_per_mpx_step`` × megapixels × steps."""
    return s_per_mpx_step * width * height / 1e6 * steps


@dataclass(frozen=True)
class QuotaExceeded(Exception):
    """A submission over the tenant's quota: ``status`` 413 (the request alone is larger than
    the quota) or 429 (try again after ``retry_after_s``, when enough work has ended)."""

    status: int
    message: str
    retry_after_s: int = 0

    def __str__(self) -> str:
        return self.message


class Quotas:
    """The tenant counters and the reservation check.

    Args:
        client: Redis with ``decode_responses=True``.
        max_jobs: outstanding jobs per tenant (0: no limit).
        max_gpu_s: outstanding estimated GPU-seconds per tenant (0: no limit).
        sharded: whether jobs give their share back to per-shard hashes (default: whether the
            client is a RedisCluster, the same choice as :class:`infra.state.jobs.JobStore`'s).
        hold_s: seconds a reservation may wait for its batch to be recorded; after that the
            reaper (:meth:`reclaim_abandoned`) gives back the reservation of a batch that never
            was (the API killed between the two writes).
    """

    def __init__(self, client: redis.Redis, max_jobs: int = 0, max_gpu_s: float = 0.0,
                 sharded: bool | None = None, hold_s: int = 60):
        self.r = client
        self.sharded = isinstance(client, RedisCluster) if sharded is None else sharded
        self.max_jobs = max_jobs
        self.max_gpu_s = max_gpu_s
        self.hold_s = hold_s
        self._reserve = client.register_script(_RESERVE)
        self._drop_hold = client.register_script(_DROP_HOLD)

    def usage(self, tenant: str) -> tuple[int, float]:
        """``(outstanding jobs, outstanding GPU-seconds)`` of ``tenant``."""
        jobs, gpu = self.r.hmget(keys.quota(tenant), "jobs", "gpu_s")
        back_jobs, back_gpu = self._returned(tenant)
        return int(jobs or 0) + back_jobs, float(gpu or 0) + back_gpu

    def _returned(self, tenant: str) -> tuple[int, float]:
        """What the tenant's ended jobs gave back, summed over the shards (≤ 0); (0, 0) on one
        Redis, where they gave it back to the tenant's hash itself."""
        if not self.sharded:
            return 0, 0.0
        pipe = self.r.pipeline(transaction=False)
        for s in keys.SHARDS:
            pipe.hmget(keys.quota_returned(tenant, s), "jobs", "gpu_s")
        answers = pipe.execute()
        return sum(int(j or 0) for j, _ in answers), sum(float(g or 0) for _, g in answers)

    def reserve(self, tenant: str, jobs: int, gpu_s: float, *, batch_id: str = "",
                drain_gpu_s_per_s: float = 1.0) -> None:
        """Count ``jobs`` and ``gpu_s`` against ``tenant``'s quota, atomically, or refuse. With a
        ``batch_id``, the reservation is also held (``rf:quota-holds``) until :meth:`recorded`
        says the batch exists, so a submission that dies between the two writes is given back.

        Args:
            drain_gpu_s_per_s: GPU-seconds the farm finishes per second for this tenant (its live
                workers), to estimate ``Retry-After``.
        Raises:
            QuotaExceeded: 413 when the request alone exceeds a quota; 429 when the tenant's
                outstanding work plus the request does (nothing is counted then).
        """
        for size, limit, what in ((jobs, self.max_jobs, "jobs"), (gpu_s, self.max_gpu_s, "GPU-seconds")):
            if limit and size > limit:
                raise QuotaExceeded(413, f"this request's {size:g} {what} exceed the tenant's quota of {limit:g} "
                                         f"outstanding {what}; split it")
        back_jobs, back_gpu = self._returned(tenant) if self.max_jobs or self.max_gpu_s else (0, 0.0)
        if batch_id:
            self.r.sadd(keys.QUOTA_HOLDERS, tenant)  # before the hold: the reaper finds the tenant
        ok, used_jobs, used_gpu = self._reserve(keys=[keys.quota(tenant), keys.quota_holds(tenant)],
                                                args=[jobs, repr(gpu_s), self.max_jobs, repr(self.max_gpu_s),
                                                      back_jobs, repr(back_gpu), batch_id,
                                                      self.hold_s if batch_id else 0])
        if int(ok):
            return
        excess = max(float(used_gpu) + gpu_s - self.max_gpu_s, 0.0) if self.max_gpu_s else 0.0
        wait = max(1, min(3600, round(excess / max(drain_gpu_s_per_s, 1e-3)) if excess else 10))
        raise QuotaExceeded(429, f"over the tenant's quota: {used_jobs} jobs and {float(used_gpu):.0f} GPU-seconds "
                                 f"outstanding (limits {self.max_jobs or '∞'} jobs, {self.max_gpu_s or '∞'} "
                                 "GPU-seconds)", wait)

    def release(self, tenant: str, jobs: int, gpu_s: float, *, batch_id: str) -> None:
        """Give back a reservation whose batch was not recorded (and drop its hold)."""
        self._drop_hold(keys=[keys.quota(tenant), keys.quota_holds(tenant)],
                        args=[f"{batch_id}|{jobs}|{gpu_s!r}", "1"])

    def recorded(self, tenant: str, jobs: int, gpu_s: float, *, batch_id: str) -> None:
        """The batch of a held reservation is recorded: its jobs now give their share back as
        they end, so the hold goes (without giving anything back)."""
        self._drop_hold(keys=[keys.quota(tenant), keys.quota_holds(tenant)],
                        args=[f"{batch_id}|{jobs}|{gpu_s!r}", "0"])

    def reclaim_abandoned(self, batch_exists: Callable[[str], bool], limit: int = 1000) -> int:
        """Give back the reservations held past their lifetime whose batch was never recorded
        (the submission died between the reservation and the batch's MULTI/EXEC); drop the holds
        of batches that exist. Run by the reaper. Returns how many holds were given back.

        A batch whose write is still in flight after ``hold_s`` seconds would be given back
        too; the default 60 s is far beyond a 10,000-job submission (~0.5 s)."""
        given = 0
        now = int(self.r.time()[0])
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
