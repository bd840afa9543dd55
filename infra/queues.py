"""Queue depths per pool: the autoscaling signal and the dashboard's counters.

Data flow: Redis broker + worker registry → **here** → ``GET /v1/queues`` and ``/metrics``.

``LLEN`` of a queue misses what workers have already pulled (DESIGN.md §3.3). With
``acks_late``, every pulled message stays in kombu's ``unacked`` hash until its batch is
done, so ``outstanding = queued + unacked`` counts queued, prefetched and running work alike.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import redis

from infra.pools import QUEUE_PREFIX

PRIORITY_SEP = ":"  # matches broker_transport_options["sep"] in infra.queue
UNACKED_KEY = "unacked"


def _pool_of_queue(key: str) -> str | None:
    if not key.startswith(QUEUE_PREFIX):
        return None
    return key[len(QUEUE_PREFIX):].split(PRIORITY_SEP, 1)[0] or None


def queue_depths(client: redis.Redis, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pool: ``queued``, ``reserved`` (pulled, not started), ``running``, ``outstanding``
    (= queued + reserved + running) and ``workers`` (live). Sorted by pool name."""
    queued: Counter[str] = Counter()
    for key in client.scan_iter(match=f"{QUEUE_PREFIX}*", count=1000):
        key = key.decode() if isinstance(key, bytes) else key
        pool = _pool_of_queue(key)
        if pool is not None and client.type(key) in ("list", b"list"):
            queued[pool] += client.llen(key)
    unacked: Counter[str] = Counter()
    for raw in client.hvals(UNACKED_KEY):
        try:
            pool = _pool_of_queue(json.loads(raw)[2])
        except (ValueError, IndexError, TypeError):
            continue
        if pool is not None:
            unacked[pool] += 1
    running: Counter[str] = Counter()
    live: Counter[str] = Counter()
    for w in workers:
        live[w.get("pool", "?")] += 1
        running[w.get("pool", "?")] += len(w.get("current_jobs") or [])
    rows = []
    for pool in sorted(set(queued) | set(unacked) | set(live)):
        reserved = max(0, unacked[pool] - running[pool])
        rows.append({"pool": pool, "queued": queued[pool], "reserved": reserved, "running": running[pool],
                     "outstanding": queued[pool] + reserved + running[pool], "workers": live[pool]})
    return rows
