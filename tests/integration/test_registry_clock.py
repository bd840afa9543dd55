"""Worker liveness on the Redis server's clock, on a real redis-server: a
worker whose clock is 60 s behind is live, and its pool has dispatch capacity."""

from __future__ import annotations

import time

import pytest

from infra import keys
from infra.background import server_time
from infra.broker.dispatch import batch_capacity
from infra.state import registry

pytestmark = pytest.mark.integration
DB = 13
SKEW_S = 60.0


def test_a_worker_60s_behind_is_live_and_dispatched(redis_db, monkeypatch):
    r = redis_db(DB)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - SKEW_S)  # this process's clock, 60 s behind
    stamped = registry.heartbeat(r, "w-behind", {"pool": "tiny", "batch_size": 8, "healthy": True}, ttl_s=20)
    monkeypatch.setattr(time, "time", lambda: real_time() + SKEW_S)  # the reader's clock, 60 s ahead
    assert abs(stamped - server_time(r)) < 2.0
    (worker,) = registry.live_workers(r, ttl_s=20)
    assert worker["name"] == "w-behind" and 0 <= worker["heartbeat_age_s"] < 2.0
    assert batch_capacity(registry.live_workers(r, ttl_s=20)) == {"tiny": 8}


def test_liveness_is_judged_on_the_server_clock(redis_db):
    """An entry stamped 60 s back on the server's clock (what the old code wrote for a worker
    whose clock was 60 s behind) is gone; one stamped now is live."""
    r = redis_db(DB)
    registry.heartbeat(r, "w-now", {"pool": "tiny"}, ttl_s=20)
    registry.heartbeat(r, "w-old", {"pool": "tiny"}, ttl_s=20)
    r.zadd(keys.WORKERS, {"w-old": server_time(r) - SKEW_S})
    assert [w["name"] for w in registry.live_workers(r, ttl_s=20)] == ["w-now"]


def test_reading_the_registry_writes_nothing_and_prune_drops_gone_names(redis_db):
    """``live_workers`` (what /healthz, /v1/workers and the dispatcher read) leaves a gone worker's
    name in the sorted set; :func:`registry.prune` (the reaper's sweep) removes it, and only it."""
    r = redis_db(DB)
    registry.heartbeat(r, "w-now", {"pool": "tiny"}, ttl_s=20)
    registry.heartbeat(r, "w-gone", {"pool": "tiny"}, ttl_s=20)
    r.zadd(keys.WORKERS, {"w-gone": server_time(r) - SKEW_S})
    assert [w["name"] for w in registry.live_workers(r, ttl_s=20)] == ["w-now"]
    assert sorted(r.zrange(keys.WORKERS, 0, -1)) == ["w-gone", "w-now"]  # the read removed nothing
    assert registry.prune(r, ttl_s=20) == 1
    assert r.zrange(keys.WORKERS, 0, -1) == ["w-now"]
    assert registry.prune(r, ttl_s=20) == 0


def test_a_heartbeat_replaces_the_last_description(redis_db):
    """A worker restarted under the same name (the local stack's supervisor restarts it so) is
    described by its own heartbeat alone: its previous process's batch size and counts are gone
    while it loads, not shown as its own."""
    r = redis_db(DB)
    registry.heartbeat(r, "w-restarted", {"pool": "tiny", "state": "ready", "batch_size": 4, "images_done": 9}, 20)
    registry.heartbeat(r, "w-restarted", {"pool": "tiny", "state": "loading"}, 20)
    (worker,) = [w for w in registry.live_workers(r, ttl_s=20) if w["name"] == "w-restarted"]
    assert worker["state"] == "loading" and "batch_size" not in worker and "images_done" not in worker, worker
