"""The dispatcher: priorities with aging and fair share between tenants, in front of Celery.

Data flow: submission records the jobs, then appends their ids to the **wait lanes**
(:mod:`infra.broker.lanes`), one Redis list per (pool, tenant, priority) → **the dispatcher
here**, a thread of the status API (like the reaper), moves them into the pool's Celery queue
in fair order, keeping that queue shallow → workers.

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

Keys (named in :mod:`infra.keys`; the lanes' own in :mod:`infra.broker.lanes`)::

    rf:wfq:{pool}                     hash: tenant → pass, "_vt" → virtual time
    rf:dispatch:lock:{pool}           one dispatcher per pool at a time (SET NX PX)

Safety: popping is one Lua script per pool (atomic), under a per-pool lock held until the
messages are published, so several API replicas never overfill a queue nor dispatch a job
twice. A job waiting in a lane is *not* in ``rf:pending`` (the reaper's index of published
messages): it has no message yet. The script moves each job it pops into the pool's popped set
(``rf:wait:popped:{pool}``, same slot); the dispatcher then indexes the still-queued ones in
``rf:pending`` and only after that empties the popped set, so if the process dies between the
pop and the publish, the next pass (under the lock) indexes the leftovers and the reaper
republishes them after ``republish_after_s``. Canceled or expired jobs are dropped once they
reach the head of their lane, in a pool without workers too (until then they count as queued).

Redis Cluster: a pool's lanes, lane set, fair-share hash and popped set share the pool's hash
tag, and the script reads no job record (a job's cost travels in its lane entry; the job states
are read by the caller), so it runs in one slot.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from celery import Celery

from infra import keys
from infra.background import PeriodicLoop, RedisLock, server_time
from infra.broker.app import broker_keys
from infra.broker.lanes import entry_job
from infra.broker.publish import publish_jobs
from infra.broker.shards import BROKER_ERRORS, Brokers
from infra.settings import Settings
from infra.state import registry, shards
from infra.state.lua import CALL_CHUNKED

log = logging.getLogger("renderfarm.dispatch")

#: Share of the pool per dispatched job, by effective priority level (high, normal, low).
PRIORITY_WEIGHTS = (4.0, 2.0, 1.0)
#: The broker priority of dispatched messages: all equal, so the Celery queue keeps the dispatch
#: order. Recovered jobs (the reaper) are published ``high`` and so go before them.
DISPATCH_PRIORITY = "normal"
LOCK_MS = 10_000
MAX_PER_PASS = 5_000


# KEYS[1] lanes set  KEYS[2] wfq hash  KEYS[3] popped zset: all three tagged with the pool, so
# the script runs in one slot on Redis Cluster and reads no job record (costs travel in the lane
# entries; states are checked by the caller). ARGV: want, now (s), aging_s, weight high, normal,
# low, the pool's lane prefix. Returns {lanes left (0: the pool has none), job_id…}: the ids popped
# in dispatch order, each also added to the popped set (the caller moves them to rf:pending).
_DISPATCH = CALL_CHUNKED + """
local want, now, aging = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local weight = {[0] = tonumber(ARGV[4]), [1] = tonumber(ARGV[5]), [2] = tonumber(ARGV[6])}
local levels = {high = 0, normal = 1, low = 2}
local prefix = ARGV[7]
-- each lane's entries are read in chunks (LRANGE) and the taken ones trimmed once at the end
-- (LTRIM), instead of one LINDEX and one LPOP per job; buf[key] = {entries, next index, taken}
local CHUNK = 64
local buf = {}
local function entry_at(key)
  local b = buf[key]
  if not b then
    b = {entries = {}, i = 1, taken = 0, done = false}
    buf[key] = b
  end
  if b.i > #b.entries and not b.done then
    b.entries = redis.call('LRANGE', key, b.taken, b.taken + CHUNK - 1)
    b.i = 1
    b.done = #b.entries < CHUNK
  end
  return b.entries[b.i]
end
local function head(member)
  local key = prefix .. member
  local entry = entry_at(key)
  if not entry then return nil end
  local ms, rest = string.match(entry, '^(%d+):(.+)$')
  rest = rest or entry
  local id, cost = string.match(rest, '^([^:]+):(.+)$')
  local tenant, priority = string.match(member, '^(.+):(%a+)$')
  return {member = member, key = key, tenant = tenant, base = levels[priority] or 1,
          ts = tonumber(ms or '0') / 1000, id = id or rest, cost = tonumber(cost or '1') or 1}
end
local lanes = {}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local h = head(member)
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
  local b = buf[h.key]
  b.i = b.i + 1
  b.taken = b.taken + 1
  vt = pick_pass
  pass[h.tenant] = pick_pass + h.cost / weight[pick.eff]
  local nxt = head(h.member)
  lanes[h.member] = nxt
  if not nxt then redis.call('SREM', KEYS[1], h.member) end
  out[#out + 1] = h.id
end
for key, b in pairs(buf) do
  if b.taken > 0 then redis.call('LTRIM', key, b.taken, -1) end
end
local popped = {}
for _, id in ipairs(out) do
  popped[#popped + 1] = stamp
  popped[#popped + 1] = id
end
if #popped > 0 then call_chunked('ZADD', KEYS[3], popped) end
for tenant, p in pairs(pass) do redis.call('HSET', KEYS[2], tenant, string.format('%.9f', p)) end
redis.call('HSET', KEYS[2], '_vt', string.format('%.9f', vt))
table.insert(out, 1, redis.call('SCARD', KEYS[1]))
return out
"""

# Drop a lane's head only while it is still the entry the caller checked. KEYS[1] lane, ARGV[1] entry.
_DROP_HEAD = """
if redis.call('LINDEX', KEYS[1], 0) == ARGV[1] then redis.call('LPOP', KEYS[1]) return 1 end
return 0
"""


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
        broker: the broker's Redis, where the Celery queues are measured (default ``client``:
            one Redis for both; on Redis Cluster the broker is a plain Redis of its own).
        brokers: the farm's brokers when pools name broker shards (:mod:`infra.broker.shards`;
            None: ``app`` and ``broker`` serve every pool).
    """

    def __init__(self, client: redis.Redis, app: Celery, *, interval_s: float = 0.2, depth: float = 2.0,
                 aging_s: float = 300.0, heartbeat_ttl_s: float = 20.0, max_skip: int = 5_000,
                 broker: redis.Redis | None = None, brokers: Brokers | None = None):
        self.r = client
        self.brokers = brokers or Brokers.single(app, broker if broker is not None else client)
        self.interval_s = interval_s
        self.depth = depth
        self.aging_s = aging_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_skip = max_skip
        self._script = client.register_script(_DISPATCH)
        self._drop_head = client.register_script(_DROP_HEAD)
        self._locks = RedisLock(client)
        self.loop = PeriodicLoop("renderfarm-dispatcher", self.tick, interval_s, log)

    # ---- one pool ---------------------------------------------------------------------------
    def pop(self, pool: str, want: int, *, now: float | None = None) -> list[str]:
        """Take up to ``want`` jobs of ``pool`` out of their lanes in fair order, atomically, and
        index the still-queued ones in ``rf:pending``; returns their ids in that order.
        Publishing is the caller's (see :meth:`dispatch_pool`). ``now`` (epoch seconds, default
        the Redis clock) is the instant the aging is measured at."""
        if want <= 0:
            return []
        now = server_time(self.r) if now is None else now
        self._settle(pool, self.r.zrange(keys.popped(pool), 0, -1))  # a dead dispatcher's leftovers
        self._drop_dead_heads(pool)
        answer = self._run_script(pool, min(int(want), MAX_PER_PASS), now)
        left, ids = int(answer[0]), list(answer[1:])
        queued = self._settle(pool, ids)
        if len(queued) < len(ids):
            log.info("pool %s: dropped %d canceled or expired job(s) from its lanes", pool, len(ids) - len(queued))
        if not left:
            self._forget_pool(pool)
        return queued

    def _settle(self, pool: str, ids: Sequence[str]) -> list[str]:
        """Index the popped ``ids`` still ``queued`` in ``rf:pending``, then take every one out of
        the pool's popped set; returns the queued ones, order kept."""
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.job(job_id), "state")
        queued = [job_id for job_id, state in zip(ids, pipe.execute()) if state == "queued"]
        if queued:
            stamp = server_time(self.r)
            pipe = self.r.pipeline(transaction=False)
            for s, members in shards.by_shard(queued).items():
                pipe.zadd(keys.pending(s), dict.fromkeys(members, stamp))
            pipe.execute()
        self.r.zrem(keys.popped(pool), *ids)
        return queued

    def _forget_pool(self, pool: str) -> None:
        """Take a pool whose lanes are empty out of ``rf:wait:pools``, and put it back if a
        submission filled a lane meanwhile (:func:`enqueue` adds the pool after its lanes)."""
        self.r.srem(keys.WAIT_POOLS, pool)
        if self.r.scard(keys.lanes(pool)):
            self.r.sadd(keys.WAIT_POOLS, pool)

    def _run_script(self, pool: str, want: int, now: float) -> list:
        return self._script(keys=[keys.lanes(pool), keys.wfq(pool), keys.popped(pool)],
                            args=[want, repr(now), repr(self.aging_s), *[repr(w) for w in PRIORITY_WEIGHTS],
                                  keys.lane_prefix(pool)])

    def prune(self, pool: str) -> int:
        """Drop the jobs at the heads of the pool's lanes that no longer wait (canceled, finished,
        expired), so that they stop counting as outstanding even while the pool has no worker;
        forget the pool once its lanes are empty. Returns how many were dropped."""
        dropped = self._drop_dead_heads(pool)
        self._settle(pool, self.r.zrange(keys.popped(pool), 0, -1))
        if not int(self._run_script(pool, 0, 0.0)[0]):  # want 0: only drops empty lanes from the set
            self._forget_pool(pool)
        return dropped

    def _drop_dead_heads(self, pool: str) -> int:
        """Drop lane heads whose job no longer waits, so they never take a turn in the fair
        order; at most ``max_skip``. Returns how many were dropped."""
        dropped = 0
        members = sorted(self.r.smembers(keys.lanes(pool)))
        while members and dropped < self.max_skip:
            pipe = self.r.pipeline(transaction=False)
            for member in members:
                pipe.lindex(keys.lane(pool, member), 0)
            heads = [(m, e) for m, e in zip(members, pipe.execute()) if e]
            pipe = self.r.pipeline(transaction=False)
            for _, entry in heads:
                pipe.hget(keys.job(entry_job(entry)), "state")
            dead = [(m, e) for (m, e), state in zip(heads, pipe.execute() if heads else []) if state != "queued"]
            if not dead:
                break
            for member, entry in dead:
                dropped += int(self._drop_head(keys=[keys.lane(pool, member)], args=[entry]))
            members = [m for m, _ in dead]
        if dropped:
            log.info("pool %s: dropped %d canceled or expired job(s) from its lanes", pool, dropped)
        return dropped

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
            broker = self.brokers.for_pool(pool)
            ids = self.pop(pool, target - broker_depth(broker.client, pool))
            if ids:
                publish_jobs(broker.app, [(job_id, pool) for job_id in ids], priority=DISPATCH_PRIORITY)
            return len(ids)

    # ---- every pool -------------------------------------------------------------------------
    def tick(self) -> dict[str, int]:
        """One pass over the pools with waiting jobs; returns, per pool, the messages published.
        A pool with no live healthy worker gets none: its jobs wait in their lanes (and count as
        outstanding, so the autoscaler starts a worker); only its canceled heads are dropped. A
        pool whose broker cannot be reached is logged and skipped (its jobs wait in their lanes),
        so that a broker shard that is down stops its own pools only."""
        pools = self.r.smembers(keys.WAIT_POOLS)
        if not pools:
            return {}
        capacity = batch_capacity(registry.live_workers(self.r, self.heartbeat_ttl_s))
        published = {}
        for pool in sorted(pools):
            if capacity[pool] <= 0:
                self.prune(pool)
                continue
            try:
                published[pool] = self.dispatch_pool(pool, capacity[pool])
            except BROKER_ERRORS as exc:
                log.warning("pool %s: its broker %s cannot be reached; its jobs wait: %s", pool,
                            self.brokers.for_pool(pool).name or "(default)", exc)
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


def from_settings(settings: Settings, client: redis.Redis, app: Celery,
                  broker: redis.Redis | None = None, brokers: Brokers | None = None) -> Dispatcher:
    """A dispatcher configured by :class:`infra.settings.Settings` (``broker``, ``brokers``: see
    :class:`Dispatcher`)."""
    return Dispatcher(client, app, interval_s=settings.dispatch_interval_s, depth=settings.dispatch_depth,
                      aging_s=settings.priority_aging_s, heartbeat_ttl_s=settings.heartbeat_ttl_s, broker=broker,
                      brokers=brokers)

