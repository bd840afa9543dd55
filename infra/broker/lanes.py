"""Wait lanes: where submitted jobs wait for the dispatcher, one Redis list per (pool, tenant,
priority).

Data flow: submission (:mod:`infra.submission.submitter`) records the jobs, then **appends their
ids here** (:func:`enqueue`) → the dispatcher (:mod:`infra.broker.dispatch`) pops them in fair
order into the pool's Celery queue; the queue depths (:mod:`infra.broker.depths`) count what
still waits (:func:`backlog`).

A lane entry is ``"{enqueued ms}:{job id}[:{cost_s}]"``: the Redis server's clock when it was
enqueued (for aging and ``oldest_wait_s``) and the job's estimated GPU-seconds
(:mod:`infra.state.quota`; absent: 1), so the dispatch script reads no job record.

Keys (named in :mod:`infra.keys`; a pool name holds no ``:``, a tenant neither)::

    rf:wait:pools                     set: pools with waiting jobs
    rf:wait:lanes:{pool}              set: "{tenant}:{priority}" of non-empty lanes
    rf:wait:{pool}:{tenant}:{prio}    list: "{enqueued ms}:{job id}[:{cost_s}]", oldest first

Redis Cluster: a pool's lanes and its lane set share the pool's hash tag, so :func:`enqueue`'s
MULTI/EXEC per pool runs in one slot; ``rf:wait:pools`` is written after the lanes, so a
dispatcher that empties a pool and takes it out re-adds it if a lane filled meanwhile.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import redis

from infra import keys
from infra.background import server_time
from infra.state import shards

#: A job's priority → its base level on the aging scale (high 0, normal 1, low 2).
PRIORITY_LEVELS = {"high": 0, "normal": 1, "low": 2}


def enqueue(client: redis.Redis, jobs: Sequence[tuple[str, str]], *, tenant: str, priority: str,
            ttl_s: int = 7 * 24 * 3600, costs: Sequence[float | None] | None = None) -> None:
    """Append recorded jobs (``(job_id, pool)``, in submission order) to their wait lanes (one
    MULTI/EXEC per pool: its keys share the pool's hash tag), take them out of ``rf:pending``
    (they have no message yet), then list their pools in ``rf:wait:pools``. ``costs``: each job's
    estimated GPU-seconds (:mod:`infra.state.quota`), carried in its lane entry for fair share
    (None: 1).

    Raises:
        ValueError: an unknown ``priority``, or ``costs`` of another length than ``jobs``.
    """
    if priority not in PRIORITY_LEVELS:
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_LEVELS)}, got {priority!r}")
    if costs is not None and len(costs) != len(jobs):
        raise ValueError(f"{len(costs)} costs for {len(jobs)} jobs")
    if not jobs:
        return
    stamp = int(server_time(client) * 1000)
    by_pool: dict[str, list[str]] = defaultdict(list)
    for i, (job_id, pool) in enumerate(jobs):
        cost = costs[i] if costs is not None else None
        by_pool[pool].append(f"{stamp}:{job_id}" if cost is None else f"{stamp}:{job_id}:{cost!r}")
    member = f"{tenant}:{priority}"
    for pool, entries in by_pool.items():
        pipe = client.pipeline(transaction=True)
        pipe.rpush(keys.lane(pool, member), *entries)
        pipe.expire(keys.lane(pool, member), ttl_s)
        pipe.sadd(keys.lanes(pool), member)
        pipe.execute()
    shards.remove(client, keys.pending, [job_id for job_id, _ in jobs])
    client.sadd(keys.WAIT_POOLS, *by_pool)  # after the lanes: a dispatcher never forgets a non-empty pool


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
                stamp = entry_time(first)
                oldest = stamp if oldest is None else min(oldest, stamp)
        out[pool] = (count, oldest)
    return out


def entry_time(entry: str | bytes) -> float:
    """When a lane entry ``{enqueued ms}:{job id}[:{cost_s}]`` was enqueued, epoch seconds."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    return int(text.split(":", 1)[0]) / 1000


def entry_job(entry: str) -> str:
    """The job id of a lane entry ``{enqueued ms}:{job id}[:{cost_s}]``."""
    return entry.split(":", 2)[1]
