"""The dispatcher: priorities with aging and fair share between tenants, in front of Celery.

Data flow: submission (:mod:`infra.api.submission`) records the jobs, then appends their ids to
**wait lanes here**, one Redis list per (pool, tenant, priority) → the dispatcher, a thread of
the status API (like the reaper), moves them into the pool's Celery queue in fair order,
keeping that queue shallow → workers.

Why not Celery's own priorities: kombu's Redis transport serves its priority lists strictly, so
a steady stream of ``high`` starves ``low`` forever, and one list per pool is first-come,
first-served between tenants: a 100k-job catalog submitted first blocks another tenant's ten
interactive jobs for hours. So the order is decided here, and the Celery queue of a pool holds
at most ``dispatch_depth`` × its live workers' total batch size (healthy workers only). Jobs
behind that wait in lanes, where a later, more urgent job can still overtake them.

Choosing the next job (stride scheduling, a form of weighted fair queuing):

- Within a tenant, the lane whose head job has the best *effective* priority goes first:
  ``effective = base − ⌊waited / priority_aging_s⌋`` on the scale high 0, normal 1, low 2
  (clamped at high). A ``low`` job that waited two aging periods competes as ``high``; equal
  effective priorities go oldest first. So ``low`` never starves behind a tenant's own ``high``.
- Between tenants, each has a *pass* (virtual time); the tenant with the smallest pass goes
  next and its pass grows by the job's estimated GPU-seconds (``cost_s``, :mod:`infra.state.quota`;
  1 for a record without one) / the weight of its effective priority (high 4, normal 2,
  low 1), so tenants share accelerator time, not job counts. Busy tenants share the pool in
  proportion to these weights, whatever their backlog: with equal costs, a tenant with ten
  ``high`` jobs gets two of every three slots against a ``normal`` catalog, and the catalog
  still gets the third. A tenant that was idle starts at the current virtual
  time (it cannot bank credit while away). Ties go to the older head job.

Keys (named in :mod:`infra.keys`; a pool name holds no ``:``, a tenant neither)::

    rf:wait:pools                     set: pools with waiting jobs
    rf:wait:lanes:{pool}              set: "{tenant}:{priority}" of non-empty lanes
    rf:wait:{pool}:{tenant}:{prio}    list: "{enqueued ms}:{job id}", oldest first
    rf:wfq:{pool}                     hash: tenant → pass, "_vt" → virtual time
    rf:dispatch:lock:{pool}           one dispatcher per pool at a time (SET NX PX)

Safety: popping is one Lua script per pool (atomic), under a per-pool lock held until the
messages are published, so several API replicas never overfill a queue nor dispatch a job
twice. A job waiting in a lane is *not* in ``rf:pending`` (the reaper's index of published
messages): it has no message yet. The script puts each job it pops back in ``rf:pending``, so
if the process dies between the pop and the publish, the reaper republishes it after
``republish_after_s``. Canceled or expired jobs are dropped once they reach the head of their
lane, in a pool without workers too (until then they count as queued).

Needs a single Redis (not Cluster): the script reads job hashes by name.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from celery import Celery

from infra import keys
from infra.background import PeriodicLoop, RedisLock, server_time
from infra.broker.app import broker_keys
from infra.broker.publish import publish_jobs
from infra.settings import Settings
from infra.state import registry

log = logging.getLogger("renderfarm.dispatch")

PRIORITY_LEVELS = {"high": 0, "normal": 1, "low": 2}
#: Share of the pool per dispatched job, by effective priority level (high, normal, low).
PRIORITY_WEIGHTS = (4.0, 2.0, 1.0)
#: The broker priority of dispatched messages: all equal, so the Celery queue keeps the dispatch
#: order. Recovered jobs (the reaper) are published ``high`` and so go before them.
DISPATCH_PRIORITY = "normal"
LOCK_MS = 10_000
MAX_PER_PASS = 5_000


# KEYS[1] lanes set  KEYS[2] wfq hash  KEYS[3] rf:wait:pools  KEYS[4] rf:pending
# ARGV: pool, want (0 = only drop dead heads), now (s), aging_s, weight high, normal, low,
# max_skip, job key prefix, wait-lane prefix. Returns {skipped, job_id…}: the ids popped in dispatch order (still
# queued), and how many popped ids were dropped (canceled, finished or expired).
_DISPATCH = """
local pool, want, now, aging = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local weight = {[0] = tonumber(ARGV[5]), [1] = tonumber(ARGV[6]), [2] = tonumber(ARGV[7])}
local max_skip, job_prefix = tonumber(ARGV[8]), ARGV[9]
local levels = {high = 0, normal = 1, low = 2}
local prefix = ARGV[10] .. pool .. ':'
local function head(member)
  local key = prefix .. member
  local entry = redis.call('LINDEX', key, 0)
  if not entry then return nil end
  local ms, id = string.match(entry, '^(%d+):(.+)$')
  local tenant, priority = string.match(member, '^(.+):(%a+)$')
  return {member = member, key = key, tenant = tenant, base = levels[priority] or 1,
          ts = tonumber(ms or '0') / 1000, id = id or entry}
end
local lanes = {}
local skipped = 0
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local h = head(member)
  -- drop heads that no longer wait (canceled, finished, expired): they stop counting as queued
  while h and skipped < max_skip and redis.call('HGET', job_prefix .. h.id, 'state') ~= 'queued' do
    redis.call('LPOP', h.key)
    skipped = skipped + 1
    h = head(member)
  end
  if h then lanes[member] = h else redis.call('SREM', KEYS[1], member) end
end
local vt = tonumber(redis.call('HGET', KEYS[2], '_vt') or '0')
local pass = {}
local t = redis.call('TIME')
local stamp = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
while #out < want do
  local best = {}
  for _, h in pairs(lanes) do
    local eff = h.base
    if aging > 0 then eff = math.max(0, h.base - math.floor(math.max(0, now - h.ts) / aging)) end
    local cur = best[h.tenant]
    if not cur or eff < cur.eff or (eff == cur.eff and h.ts < cur.h.ts) then best[h.tenant] = {h = h, eff = eff} end
  end
  local pick, pick_pass = nil, nil
  for tenant, c in pairs(best) do
    if pass[tenant] == nil then pass[tenant] = tonumber(redis.call('HGET', KEYS[2], tenant) or '0') end
    local p = math.max(pass[tenant], vt)
    if pick == nil or p < pick_pass or (p == pick_pass and c.h.ts < pick.h.ts) then pick, pick_pass = c, p end
  end
  if pick == nil then break end
  local h = pick.h
  redis.call('LPOP', h.key)
  vt = pick_pass
  local cost = tonumber(redis.call('HGET', job_prefix .. h.id, 'cost_s') or '1') or 1
  pass[h.tenant] = pick_pass + cost / weight[pick.eff]
  local nxt = head(h.member)
  lanes[h.member] = nxt
  if not nxt then redis.call('SREM', KEYS[1], h.member) end
  if redis.call('HGET', job_prefix .. h.id, 'state') == 'queued' then
    redis.call('ZADD', KEYS[4], stamp, h.id)
    out[#out + 1] = h.id
  else
    skipped = skipped + 1
    if skipped >= max_skip then break end
  end
end
for tenant, p in pairs(pass) do redis.call('HSET', KEYS[2], tenant, string.format('%.9f', p)) end
redis.call('HSET', KEYS[2], '_vt', string.format('%.9f', vt))
if redis.call('SCARD', KEYS[1]) == 0 then redis.call('SREM', KEYS[3], pool) end
table.insert(out, 1, skipped)
return out
"""

def enqueue(client: redis.Redis, jobs: Sequence[tuple[str, str]], *, tenant: str, priority: str,
            ttl_s: int = 7 * 24 * 3600) -> None:
    """Append recorded jobs (``(job_id, pool)``, in submission order) to their wait lanes, in one
    MULTI/EXEC round trip, and take them out of ``rf:pending`` (they have no message yet).

    Raises:
        ValueError: an unknown ``priority``.
    """
    if priority not in PRIORITY_LEVELS:
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_LEVELS)}, got {priority!r}")
    if not jobs:
        return
    stamp = int(server_time(client) * 1000)
    by_pool: dict[str, list[str]] = defaultdict(list)
    for job_id, pool in jobs:
        by_pool[pool].append(f"{stamp}:{job_id}")
    pipe = client.pipeline(transaction=True)
    pipe.zrem(keys.PENDING, *[job_id for job_id, _ in jobs])
    for pool, entries in by_pool.items():
        key = keys.lane(pool, f"{tenant}:{priority}")
        pipe.rpush(key, *entries)
        pipe.expire(key, ttl_s)
        pipe.sadd(keys.lanes(pool), f"{tenant}:{priority}")
        pipe.sadd(keys.WAIT_POOLS, pool)
    pipe.execute()


def backlog(client: redis.Redis) -> dict[str, tuple[int, float | None]]:
    """Per pool with waiting jobs: ``(jobs in its lanes, enqueue time of the oldest head)``, the
    time in epoch seconds (Redis server clock), None when every lane is empty."""
    pools = sorted(client.smembers(keys.WAIT_POOLS))
    if not pools:
        return {}
    pipe = client.pipeline(transaction=False)
    for pool in pools:
        pipe.smembers(keys.lanes(pool))
    lanes = [(pool, sorted(members)) for pool, members in zip(pools, pipe.execute())]
    pipe = client.pipeline(transaction=False)
    for pool, members in lanes:
        for member in members:
            pipe.llen(keys.lane(pool, member))
            pipe.lindex(keys.lane(pool, member), 0)
    answers = iter(pipe.execute())
    out: dict[str, tuple[int, float | None]] = {}
    for pool, members in lanes:
        count, oldest = 0, None
        for _ in members:
            length, first = next(answers), next(answers)
            count += int(length)
            if first:
                stamp = _entry_time(first)
                oldest = stamp if oldest is None else min(oldest, stamp)
        out[pool] = (count, oldest)
    return out


def _entry_time(entry: str | bytes) -> float:
    text = entry.decode() if isinstance(entry, bytes) else entry
    return int(text.split(":", 1)[0]) / 1000


def broker_depth(client: redis.Redis, pool: str) -> int:
    """Messages waiting in the pool's Celery queue (every broker priority list); not those
    workers have already pulled."""
    pipe = client.pipeline(transaction=False)
    for key in broker_keys(pool):
        pipe.llen(key)
    return sum(pipe.execute())


def batch_capacity(workers: Iterable[dict[str, Any]]) -> Counter[str]:
    """Per pool: the total batch size of its live, healthy workers (jobs per round of batches)."""
    capacity: Counter[str] = Counter()
    for worker in workers:
        if worker.get("healthy") is False or not worker.get("pool"):
            continue
        capacity[worker["pool"]] += max(1, int(worker.get("batch_size") or 1))
    return capacity


class Dispatcher:
    """Moves waiting jobs into their pools' Celery queues in fair order (see the module docstring).

    Args:
        client: Redis with ``decode_responses=True``.
        app: the Celery app that publishes the messages.
        interval_s: seconds between passes (:meth:`kick` starts one at once).
        depth: a pool's Celery queue is filled up to ``ceil(depth × its live batch capacity)``.
        aging_s: seconds of waiting that raise a job one priority level; 0 = no aging.
        heartbeat_ttl_s: a worker not heard from for this long is gone (as in the registry).
    """

    def __init__(self, client: redis.Redis, app: Celery, *, interval_s: float = 0.2, depth: float = 2.0,
                 aging_s: float = 300.0, heartbeat_ttl_s: float = 20.0, max_skip: int = 5_000):
        self.r = client
        self.app = app
        self.interval_s = interval_s
        self.depth = depth
        self.aging_s = aging_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_skip = max_skip
        self._script = client.register_script(_DISPATCH)
        self._locks = RedisLock(client)
        self.loop = PeriodicLoop("renderfarm-dispatcher", self.tick, interval_s, log)

    # ---- one pool ---------------------------------------------------------------------------
    def pop(self, pool: str, want: int, *, now: float | None = None) -> list[str]:
        """Take up to ``want`` jobs of ``pool`` out of their lanes in fair order, atomically, and
        index them in ``rf:pending``; returns their ids in that order. Publishing is the
        caller's (see :meth:`dispatch_pool`). ``now`` (epoch seconds, default the Redis clock)
        is the instant the aging is measured at."""
        if want <= 0:
            return []
        now = server_time(self.r) if now is None else now
        answer = self._run_script(pool, min(int(want), MAX_PER_PASS), now)
        skipped, ids = int(answer[0]), list(answer[1:])
        if skipped:
            log.info("pool %s: dropped %d canceled or expired job(s) from its lanes", pool, skipped)
        return ids

    def prune(self, pool: str) -> int:
        """Drop the jobs at the heads of the pool's lanes that no longer wait (canceled, finished,
        expired), so that they stop counting as outstanding even while the pool has no worker.
        Returns how many were dropped."""
        return int(self._run_script(pool, 0, 0.0)[0])

    def _run_script(self, pool: str, want: int, now: float) -> list:
        return self._script(keys=[keys.lanes(pool), keys.wfq(pool), keys.WAIT_POOLS, keys.PENDING],
                            args=[pool, want, repr(now), repr(self.aging_s), *[repr(w) for w in PRIORITY_WEIGHTS],
                                  self.max_skip, keys.JOB_PREFIX, keys.WAIT_PREFIX])

    def dispatch_pool(self, pool: str, capacity: int) -> int:
        """Top the pool's Celery queue up to ``ceil(depth × capacity)`` messages, under the
        pool's lock (another replica holding it means nothing to do here). Returns the number
        of messages published.

        Raises:
            redis.RedisError, kombu errors: Redis unreachable (the loop logs it and tries again;
                popped jobs are republished by the reaper).
        """
        target = math.ceil(self.depth * capacity)
        if target <= 0:
            return 0
        with self._locks.hold(keys.dispatch_lock(pool), LOCK_MS) as held:
            if not held:
                return 0
            ids = self.pop(pool, target - broker_depth(self.r, pool))
            if ids:
                publish_jobs(self.app, [(job_id, pool) for job_id in ids], priority=DISPATCH_PRIORITY)
            return len(ids)

    # ---- every pool -------------------------------------------------------------------------
    def tick(self) -> dict[str, int]:
        """One pass over the pools with waiting jobs; returns, per pool, the messages published.
        A pool with no live healthy worker gets none: its jobs wait in their lanes (and count as
        outstanding, so the autoscaler starts a worker); only its canceled heads are dropped."""
        pools = self.r.smembers(keys.WAIT_POOLS)
        if not pools:
            return {}
        capacity = batch_capacity(registry.live_workers(self.r, self.heartbeat_ttl_s))
        published = {}
        for pool in sorted(pools):
            if capacity[pool] > 0:
                published[pool] = self.dispatch_pool(pool, capacity[pool])
            else:
                self.prune(pool)
        return published

    def kick(self, pools: Iterable[str] = ()) -> None:
        """Start a pass now (called after a submission; ``pools`` is informational)."""
        self.loop.wake()

    def start(self) -> "Dispatcher":
        """Pass every ``interval_s`` seconds (or when kicked) in a daemon thread; errors are logged."""
        self.loop.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread started by :meth:`start` (waits at most ``timeout`` seconds)."""
        self.loop.stop(timeout)


def from_settings(settings: Settings, client: redis.Redis, app: Celery) -> Dispatcher:
    """A dispatcher configured by :class:`infra.settings.Settings`."""
    return Dispatcher(client, app, interval_s=settings.dispatch_interval_s, depth=settings.dispatch_depth,
                      aging_s=settings.priority_aging_s, heartbeat_ttl_s=settings.heartbeat_ttl_s)

