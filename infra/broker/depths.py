"""Queue depths per pool: the autoscaling signal and the dashboard's counters.

Data flow: wait lanes (:mod:`infra.broker.lanes`) + Redis broker lists + kombu's ``unacked``
hash + worker registry → **here** → ``GET /v1/queues``, ``GET /v1/queues/{pool}`` and ``/metrics``
(``renderfarm_outstanding_jobs{pool}``).

``LLEN`` of a broker queue misses most of the work (the autoscaler then reads the wrong number,
and scale-down takes workers that still hold jobs): the jobs the dispatcher
still holds in its wait lanes, and what workers have already pulled. With ``acks_late``, every
pulled message stays in kombu's ``unacked`` hash until its batch is done, whether it waits in
the worker's prefetch buffer (reserved) or renders (running). So per pool:

- ``queued``  = jobs in the wait lanes + messages in the broker lists (every priority);
- ``running`` = jobs the pool's live workers report in their heartbeats;
- ``reserved`` = unacked messages − running (prefetched, not started);
- ``outstanding`` = queued + reserved + running: what an autoscaler must provide for. A
  running batch is counted until it is acked, so scale-down never takes its worker for idle;
- ``oldest_wait_s`` = seconds the longest-waiting job not yet started has waited (lanes,
  broker lists, prefetch buffers), measured on the Redis server's clock.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from infra import keys
from infra.background import server_time
from infra.broker.kombu_redis import message_job_id
from infra.broker.lanes import backlog

log = logging.getLogger("renderfarm.depths")


def _loads(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, TypeError):
        return None


def idle_row(pool: str) -> dict[str, Any]:
    """The row of a pool with no job and no worker."""
    return {"pool": pool, "queued": 0, "reserved": 0, "running": 0, "outstanding": 0, "workers": 0,
            "oldest_wait_s": 0.0}


def _broker_lists(broker: redis.Redis) -> tuple[Counter[str], list[tuple[str, str]]]:
    """Per pool, the messages in its broker lists (every priority); and ``(pool, job id)`` of the
    oldest message of each list (kombu pushes left, pops right), whose job may still wait."""
    names = [k for k in broker.scan_iter(match=f"{keys.QUEUE_PREFIX}*", count=1000) if keys.pool_of_broker_list(k)]
    pipe = broker.pipeline(transaction=False)
    for key in names:
        pipe.type(key)
    lists = [k for k, kind in zip(names, pipe.execute() if names else []) if kind == "list"]
    pipe = broker.pipeline(transaction=False)
    for key in lists:
        pipe.llen(key)
        pipe.lindex(key, -1)
    answers = iter(pipe.execute() if lists else [])
    counts: Counter[str] = Counter()
    oldest: list[tuple[str, str]] = []
    for key in lists:
        length, last = next(answers), next(answers)
        pool = cast(str, keys.pool_of_broker_list(key))  # names holds only broker lists
        counts[pool] += int(length)
        if (job_id := message_job_id(last)) is not None:
            oldest.append((pool, job_id))
    return counts, oldest


def _pulled(broker: redis.Redis) -> tuple[Counter[str], list[tuple[str, str]]]:
    """Per pool, the messages workers pulled (kombu's ``unacked``: prefetched or running); and
    ``(pool, job id)`` of each, whose job may still wait in a prefetch buffer."""
    counts: Counter[str] = Counter()
    pulled: list[tuple[str, str]] = []
    for raw in broker.hvals(keys.UNACKED):
        entry = _loads(raw)
        if not isinstance(entry, list) or len(entry) < 3 or not isinstance(entry[2], str):
            continue
        pool = keys.pool_of_broker_list(entry[2])
        if pool is None:
            continue
        counts[pool] += 1
        if (job_id := message_job_id(entry)) is not None:
            pulled.append((pool, job_id))
    return counts, pulled


def _queued_since(client: redis.Redis, candidates: list[tuple[str, str]]) -> list[tuple[str, float]]:
    """``(pool, since)`` for each candidate ``(pool, job id)`` whose job is still ``queued``: when
    it was queued (requeued, else created), epoch seconds. A duplicate message of a job that
    started or ended does not count."""
    if not candidates:
        return []
    pipe = client.pipeline(transaction=False)
    for _, job_id in candidates:
        pipe.hmget(keys.job(job_id), "state", "created_at", "queued_at")
    out = []
    for (pool, _), (state, created, requeued) in zip(candidates, pipe.execute()):
        if state == "queued":
            try:
                out.append((pool, float(requeued or created)))
            except (TypeError, ValueError):
                pass
    return out


def queue_depths(client: redis.Redis, workers: list[dict[str, Any]], pools: Iterable[str] | None = None,
                 broker: redis.Redis | Sequence[redis.Redis] | None = None) -> list[dict[str, Any]]:
    """Per pool: ``queued``, ``reserved``, ``running``, ``outstanding`` (jobs; see the module
    docstring), ``workers`` (live) and ``oldest_wait_s`` (seconds). Sorted by pool name.

    Args:
        client: Redis with ``decode_responses=True``.
        workers: the live workers (:func:`infra.state.registry.live_workers`).
        pools: pools listed even when idle; None = the declared pools of the settings.
        broker: the broker's Redis (its queue lists and ``unacked``), or every broker's when pools
            name broker shards (:mod:`infra.broker.shards`: a pool's queue is on one of them, so
            their counts add up); None: ``client``.

    Raises:
        redis.RedisError: the state store is unreachable, or the one broker is (with several, one
            that cannot be reached is logged and left out).
    """
    if pools is None:
        from infra.settings import get_settings

        pools = [p.name for p in get_settings().pools]
    now = server_time(client)
    brokers = [client] if broker is None else list(broker) if isinstance(broker, (list, tuple)) else [broker]
    lanes = backlog(client)  # jobs the dispatcher still holds
    queued: Counter[str] = Counter({pool: n for pool, (n, _) in lanes.items()})
    waits = [(pool, oldest) for pool, (_, oldest) in lanes.items() if oldest is not None]
    unacked: Counter[str] = Counter()
    for one in brokers:
        try:
            in_lists, listed = _broker_lists(one)
            pulled_here, pulled = _pulled(one)
        except redis.RedisError as exc:  # a broker shard that is down: its pools' lanes still count
            if len(brokers) == 1:
                raise
            log.warning("a broker cannot be reached; its queues are left out of the depths: %s", exc)
            continue
        queued.update(in_lists)
        unacked.update(pulled_here)
        waits += _queued_since(client, listed + pulled)
    waiting_since: dict[str, float] = {}
    for pool, since in waits:
        if pool not in waiting_since or since < waiting_since[pool]:
            waiting_since[pool] = since
    running: Counter[str] = Counter()
    live: Counter[str] = Counter()
    for w in workers:
        live[w.get("pool", "?")] += 1
        running[w.get("pool", "?")] += len(w.get("current_jobs") or [])
    rows = []
    for pool in sorted(set(queued) | set(unacked) | set(live) | set(pools)):
        reserved = max(0, unacked[pool] - running[pool])
        oldest = waiting_since.get(pool)
        rows.append({"pool": pool, "queued": queued[pool], "reserved": reserved, "running": running[pool],
                     "outstanding": queued[pool] + reserved + running[pool], "workers": live[pool],
                     "oldest_wait_s": round(max(0.0, now - oldest), 3) if oldest is not None else 0.0})
    return rows
