"""Broker shards (infra.broker.shards) on a real redis-server, no workers: declarations refused
with clear errors, each pool's messages published to its own broker by the dispatcher, the
republish path and the reaper, and queue depths adding the brokers up. Two databases of the
session's redis-server stand for the two brokers here; ``tests/faults/test_broker_shards.py``
runs a shard on a redis-server of its own with real workers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from infra import keys
from infra.broker.app import broker_keys
from infra.broker.depths import queue_depths
from infra.broker.dispatch import Dispatcher, broker_depth
from infra.broker.lanes import enqueue
from infra.broker.publish import republish
from infra.broker.reaper import queued_job_ids
from infra.broker.shards import Brokers
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state import registry
from infra.state.job_store import JobStore, NewJob
from infra.submission.submitter import new_id

DEFAULT_DB, SHARD_DB = 5, 8
POOLS = [{"name": "on-default", "model": "null"}, {"name": "on-shard", "model": "null", "broker": "shard-b"}]


@pytest.fixture
def brokers(redis_db, redis_server):
    redis_db(DEFAULT_DB), redis_db(SHARD_DB)  # flushed before and after
    settings = Settings(redis_url=redis_server.db_url(DEFAULT_DB), pools=POOLS,
                        brokers={"shard-b": redis_server.db_url(SHARD_DB), "unused": "redis://nowhere:1/0"})
    made = Brokers.from_settings(settings)
    yield made
    made.close()


def _queued(r, pool: str, n: int) -> list[str]:
    jobs = [NewJob(new_id(), RenderRequest(prompt="p", seed=1, model="null"), pool) for _ in range(n)]
    JobStore(r).create_batch(new_id(), jobs)
    return [j.job_id for j in jobs]


def test_a_pool_naming_an_undeclared_shard_or_a_cluster_broker_is_refused():
    with pytest.raises(ValidationError, match="names broker shard 'b', which RENDERFARM_BROKERS does not declare"):
        Settings(pools=[{"name": "p", "model": "null", "broker": "b"}])
    with pytest.raises(ValidationError, match="needs one Redis or a sentinel:// group"):
        Settings(brokers={"b": "redis+cluster://127.0.0.1:7000"})
    with pytest.raises(ValidationError, match="broker shard name"):
        Settings(brokers={"B/x": "redis://127.0.0.1:6379/0"})
    settings = Settings(pools=[{"name": "p", "model": "null", "broker": "b"}],
                        brokers=json.dumps({"b": "redis://10.0.0.2:6379/0"}))  # as RENDERFARM_BROKERS reads
    assert settings.pool_broker_url("p") == "redis://10.0.0.2:6379/0"
    assert settings.pool_broker_url("undeclared") == settings.redis_url


def test_only_shards_that_pools_name_are_connected(brokers):
    assert [b.name for b in brokers.all()] == [None, "shard-b"]
    assert brokers.for_pool("on-shard").name == "shard-b" and brokers.for_pool("anything").name is None


def test_dispatcher_publishes_each_pool_to_its_broker_and_depths_add_them_up(brokers):
    r, shard = brokers.default.client, brokers.for_pool("on-shard").client
    for pool in ("on-default", "on-shard"):
        ids = _queued(r, pool, 6)
        enqueue(r, [(j, pool) for j in ids], tenant="t", priority="normal")
        registry.heartbeat(r, f"w-{pool}", {"pool": pool, "batch_size": 2, "healthy": True}, ttl_s=30)
    dispatcher = Dispatcher(r, brokers.default.app, brokers=brokers, depth=1.0)
    assert dispatcher.tick() == {"on-default": 2, "on-shard": 2}
    assert (broker_depth(r, "on-default"), broker_depth(r, "on-shard")) == (2, 0)
    assert (broker_depth(shard, "on-shard"), broker_depth(shard, "on-default")) == (2, 0)
    assert dispatcher.tick() == {"on-default": 0, "on-shard": 0}  # each queue measured on its own broker: full
    rows = {row["pool"]: row for row in queue_depths(r, [], pools=[], broker=brokers.clients())}
    assert rows["on-shard"]["queued"] == rows["on-default"]["queued"] == 6
    alone = {row["pool"]: row for row in queue_depths(r, [], pools=[], broker=r)}
    assert alone["on-shard"]["queued"] == 4, "reading the default broker alone misses the shard's messages"


def test_republish_sends_each_job_back_to_its_pools_broker(brokers):
    r, shard = brokers.default.client, brokers.for_pool("on-shard").client
    ids = {pool: _queued(r, pool, 3) for pool in ("on-default", "on-shard")}
    assert republish(JobStore(r), brokers, ids["on-default"] + ids["on-shard"], priority="high") == 6
    assert queued_job_ids(shard) == set(ids["on-shard"]) and queued_job_ids(r) == set(ids["on-default"])
    assert shard.llen(keys.queue("on-shard")) == 3  # priority high: the queue's first list


def test_a_shard_that_is_down_stops_its_own_pools_only(redis_db, redis_server):
    from infra.broker.reaper import Reaper
    from infra.localstack import free_port

    r = redis_db(DEFAULT_DB)
    settings = Settings(redis_url=redis_server.db_url(DEFAULT_DB), pools=POOLS,
                        brokers={"shard-b": f"redis://127.0.0.1:{free_port()}/0"})  # nothing listens there
    brokers = Brokers.from_settings(settings)
    try:
        ids = {pool: _queued(r, pool, 3) for pool in ("on-default", "on-shard")}
        for pool in ids:
            enqueue(r, [(j, pool) for j in ids[pool]], tenant="t", priority="normal")
            registry.heartbeat(r, f"w-{pool}", {"pool": pool, "batch_size": 2, "healthy": True}, ttl_s=30)
        assert Dispatcher(r, brokers.default.app, brokers=brokers, depth=1.0).tick() == {"on-default": 2}
        rows = {row["pool"]: row for row in queue_depths(r, [], pools=[], broker=brokers.clients())}
        assert (rows["on-default"]["queued"], rows["on-shard"]["queued"]) == (3, 3)  # the shard's lanes still count

        store = JobStore(r)
        dispatched = ids["on-default"][:2]  # the third still waits in its lane
        assert republish(store, brokers, dispatched + ids["on-shard"]) == 2
        reaper = Reaper(store, brokers.default.app, republish_after_s=0.0, brokers=brokers)
        r.delete(*broker_keys("on-default"))  # pool a's messages lost: the reaper must publish them again
        report = reaper.sweep()
        assert sorted(report.republished) == sorted(dispatched), "the shard's jobs wait for their broker"
    finally:
        brokers.close()
