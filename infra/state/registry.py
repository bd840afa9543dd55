"""The worker registry: each live worker's self-description, kept fresh by its heartbeat.

Data flow: workers write here every ``heartbeat_interval_s``; the status API (``GET
/v1/workers``, the dashboard) and the local stack read it. A worker not heard from for
``heartbeat_ttl_s`` is gone: its hash expires and it drops out of :func:`live_workers`.

Keys (:mod:`infra.keys`): ``rf:workers`` (sorted set, name → last heartbeat epoch seconds) and
``rf:worker:{name}`` (hash of JSON-encoded fields).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from infra import keys


def heartbeat(client: redis.Redis, name: str, info: dict[str, Any], ttl_s: float) -> None:
    """Record ``info`` (JSON-able values) for worker ``name`` and mark it alive for ``ttl_s`` seconds."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.worker(name), mapping={k: json.dumps(v) for k, v in {**info, "name": name,
                                                                        "last_heartbeat": now}.items()})
    pipe.expire(keys.worker(name), max(1, int(ttl_s)))
    pipe.zadd(keys.WORKERS, {name: now})
    pipe.execute()


def deregister(client: redis.Redis, name: str) -> None:
    """Remove worker ``name`` at once (clean shutdown)."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(keys.worker(name))
    pipe.zrem(keys.WORKERS, name)
    pipe.execute()


def live_workers(client: redis.Redis, ttl_s: float = 20.0) -> list[dict[str, Any]]:
    """Workers heard from within ``ttl_s`` seconds, each a dict with ``name``, ``model``, ``pool``,
    ``device``, ``batch_size``, ``pid``, ``host``, ``last_heartbeat`` and ``heartbeat_age_s``."""
    now = time.time()
    client.zremrangebyscore(keys.WORKERS, "-inf", now - ttl_s)
    names = client.zrange(keys.WORKERS, 0, -1)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.worker(name))
    out = []
    for fields in pipe.execute():
        if not fields:
            continue
        info = {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in fields.items()}
        info["heartbeat_age_s"] = round(now - float(info["last_heartbeat"]), 3)
        out.append(info)
    return sorted(out, key=lambda w: w["name"])
