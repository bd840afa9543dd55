"""Reading and writing the farm-wide indexes that are split into shards for Redis Cluster.

Place in the data flow: beside the job-state store (:mod:`infra.state.job_store`), the reaper and the
dead-letter pages. Every farm-wide sorted set (leases, pending, dead letters, a tenant's dead
letters and recent batches) is kept as :data:`infra.keys.SHARDS` sorted sets, one per hash tag,
so that a transition script touches one job's keys and that job's shard of each index in one
slot. A reader asks every shard in one pipelined round trip (on Redis Cluster, one per node:
redis-py groups a non-transactional cluster pipeline by node) and merges the answers by score.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable

import redis

from infra import keys


def by_shard(ids: Iterable[str]) -> dict[str, list[str]]:
    """Group job or batch ids by their shard (:func:`infra.keys.shard`), order kept within a shard."""
    out: dict[str, list[str]] = defaultdict(list)
    for entity_id in ids:
        out[keys.shard(entity_id)].append(entity_id)
    return out


def oldest(client: redis.Redis, name: Callable[[str], str], max_score: float, limit: int) -> list[str]:
    """The ``limit`` members with the lowest scores ≤ ``max_score`` across every shard of the
    index ``name(shard)``, lowest score first."""
    pipe = client.pipeline(transaction=False)
    for s in keys.SHARDS:
        pipe.zrangebyscore(name(s), "-inf", repr(max_score), start=0, num=limit, withscores=True)
    merged = heapq.merge(*pipe.execute(), key=lambda entry: entry[1])
    return [member for member, _ in list(merged)[:limit]]


def newest(client: redis.Redis, name: Callable[[str], str], offset: int, count: int) -> list[str]:
    """Members ``offset`` … ``offset + count − 1`` by descending score across every shard of
    ``name(shard)`` (a page of the merged index, newest first)."""
    if count <= 0:
        return []
    pipe = client.pipeline(transaction=False)
    for s in keys.SHARDS:
        pipe.zrevrange(name(s), 0, offset + count - 1, withscores=True)
    merged = heapq.merge(*pipe.execute(), key=lambda entry: -entry[1])
    return [member for member, _ in list(merged)[offset:offset + count]]


def card(client: redis.Redis, name: Callable[[str], str]) -> int:
    """Members of the index ``name(shard)``, summed over its shards."""
    pipe = client.pipeline(transaction=False)
    for s in keys.SHARDS:
        pipe.zcard(name(s))
    return sum(pipe.execute())


def remove(client: redis.Redis, name: Callable[[str], str], ids: Iterable[str]) -> None:
    """Drop job ids from the index ``name(shard)`` (each from its own shard), in one round trip."""
    groups = by_shard(ids)
    if not groups:
        return
    pipe = client.pipeline(transaction=False)
    for s, members in groups.items():
        pipe.zrem(name(s), *members)
    pipe.execute()


def members(client: redis.Redis, name: Callable[[str], str]) -> set[str]:
    """Every member of the index ``name(shard)`` over its shards (tools and tests; reads it all)."""
    pipe = client.pipeline(transaction=False)
    for s in keys.SHARDS:
        pipe.zrange(name(s), 0, -1)
    return {member for answer in pipe.execute() for member in answer}
