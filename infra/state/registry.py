"""The worker registry: each live worker's self-description, kept fresh by its heartbeat.

Data flow: workers write here every ``heartbeat_interval_s``; the status API (``GET
/v1/workers``, the dashboard) and the local stack read it. A worker not heard from for
``heartbeat_ttl_s`` is gone: its hash expires and it drops out of :func:`live_workers`. Reading
the registry writes nothing (probes and scrapes read it); the reaper's sweep drops the names of
gone workers from the sorted set (:func:`prune`).

Keys (:mod:`infra.keys`): ``rf:{workers}`` (sorted set, name → last heartbeat epoch seconds) and
``rf:{workers}:{name}`` (hash of JSON-encoded fields); the braces are a hash tag, so the
heartbeat script's two keys share a Redis Cluster slot.

Every time here is the Redis server's clock (``TIME``): the heartbeat is stamped inside a Lua
script and liveness is judged against :func:`infra.background.server_time`, so a worker whose
clock is off (20 s behind the API, or 60 s) is still seen, and its pool still dispatched.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from infra import keys
from infra.background import server_time

#: A worker's start-up states, in order (``worker.warmup.StartupState`` reports them in its
#: heartbeat's ``state``): the pipeline loads, the batch is sized, the shapes warm up; only
#: ``ready`` takes jobs.
STARTUP_STATES = ("loading", "sizing", "warming", "ready")
#: The states before the pipeline is loaded and the batch sized (a start that may still fail).
LOADING_STATES = STARTUP_STATES[:2]

# KEYS[1] rf:{workers}:{name}, KEYS[2] rf:{workers} (one slot); ARGV[1] name, ARGV[2] ttl (s),
# ARGV[3…] field, JSON value.
# The heartbeat's time is the server's, taken inside the script. Each beat replaces the whole
# description: a worker restarted under the same name (the local stack's supervisor) must not show
# the fields its previous process had and this one has not yet (a batch size while it loads).
_HEARTBEAT = """
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('DEL', KEYS[1])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], 'last_heartbeat', now)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
return now
"""


def heartbeat(client: redis.Redis, name: str, info: dict[str, Any], ttl_s: float) -> float:
    """Record ``info`` (JSON-able values) for worker ``name``, replacing what its last heartbeat said,
    and mark it alive for ``ttl_s`` seconds, stamped with the Redis server's clock (one script, one
    round trip); returns that time (epoch s)."""
    fields = [x for k, v in {**info, "name": name}.items() if k != "last_heartbeat" for x in (k, json.dumps(v))]
    return float(client.eval(_HEARTBEAT, 2, keys.worker(name), keys.WORKERS, name, max(1, int(ttl_s)), *fields))


def deregister(client: redis.Redis, name: str) -> None:
    """Remove worker ``name`` at once (clean shutdown)."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(keys.worker(name))
    pipe.zrem(keys.WORKERS, name)
    pipe.execute()


def prune(client: redis.Redis, ttl_s: float = 20.0) -> int:
    """Drop from ``rf:{workers}`` the names not heard from within ``ttl_s`` seconds (Redis server
    clock); returns how many. Their hashes have expired already: this only keeps the sorted set
    from growing with every worker that ever ran. The reaper calls it once per sweep.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    return int(client.zremrangebyscore(keys.WORKERS, "-inf", f"({server_time(client) - ttl_s}"))


def live_workers(client: redis.Redis, ttl_s: float = 20.0) -> list[dict[str, Any]]:
    """Workers heard from within ``ttl_s`` seconds, each a dict with ``name``, ``model``, ``pool``,
    ``device``, ``batch_size``, ``pid``, ``host``, ``last_heartbeat`` and ``heartbeat_age_s``
    (both on the Redis server's clock, whatever the clocks of the worker and the caller)."""
    now = server_time(client)
    names = client.zrangebyscore(keys.WORKERS, now - ttl_s, "+inf")
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
