"""infra.broker.publish.publish_jobs' Redis fast path (the submission and null-farm benchmarks lean on
it): the messages it writes are the ones ``send_task`` writes, delivery tags aside, in order,
per pool and priority; and a worker-side kombu consumer decodes them."""

from __future__ import annotations

import json

import pytest
import redis

from infra import keys
from infra.broker import app as broker_app
from infra.broker import publish
from infra.localstack import RedisServer, free_port
from infra.settings import Settings


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = RedisServer(free_port(), dir=tmp_path_factory.mktemp("redis"), run_dir=tmp_path_factory.mktemp("run"))
    with server:
        yield broker_app.make_celery(Settings(redis_url=server.url)), redis.Redis.from_url(server.url)


def _lists(client) -> dict[str, list[dict]]:
    out = {}
    for key in client.keys("renderfarm*"):
        messages = [json.loads(m) for m in client.lrange(key, 0, -1)]
        for m in messages:
            assert m["properties"].pop("delivery_tag")
        out[key.decode()] = messages
    return out


@pytest.mark.parametrize("priority", ["normal", "high"])
def test_fast_path_writes_what_send_task_writes(app, priority):
    celery, client = app
    jobs = [(f"{i:032x}", "tiny") for i in range(1, 7)] + [("e" * 32, "sd15-arch"), ("f" * 32, "tiny")]
    client.flushdb()
    assert publish.publish_jobs(celery, jobs, priority=priority) == len(jobs)
    fast = _lists(client)
    client.flushdb()
    with celery.producer_or_acquire() as producer, producer.batch():
        for job_id, pool in jobs:
            publish._send(celery, producer, job_id, pool, broker_app.PRIORITY_VALUES[priority])
    assert fast == _lists(client)
    tags = [json.loads(m)["properties"]["delivery_tag"] for m in client.lrange(next(iter(client.keys())), 0, -1)]
    assert len(set(tags)) == len(tags)


def test_published_messages_are_consumed_in_order(app):
    celery, client = app
    client.flushdb()
    ids = [f"{i:032x}" for i in range(20)]
    publish.publish_jobs(celery, [(i, "tiny") for i in ids])
    got = []
    with celery.connection_for_read() as conn:
        consumer = conn.SimpleQueue(keys.queue("tiny"))
        for _ in ids:
            message = consumer.get(timeout=5)
            got.append((message.headers["id"], message.decode()[1]["job_id"]))
            message.ack()
        consumer.close()
    assert got == [(i, i) for i in ids]
