"""The cheap-ack patch of :mod:`infra.broker.kombu_redis` against a real redis-server and kombu's
own Redis transport: inside an event loop, acks update kombu's bookkeeping at once and reach
Redis together when :func:`flush_acks` runs (the loop's next callback); outside one, kombu's own
ack still runs. One Redis client serves the channel."""

from __future__ import annotations

import pytest
from kombu import Connection
from kombu.asynchronous import Hub, set_event_loop

from infra.broker.kombu_redis import flush_acks, install_cheap_acks

DB = 9


@pytest.fixture
def conn(redis_server, redis_db):
    redis_db(DB).flushdb()
    install_cheap_acks()
    with Connection(redis_server.db_url(DB)) as connection:
        yield connection


def _received(conn, n: int):
    queue = conn.SimpleQueue("rf-test-acks")
    for i in range(n):
        queue.put({"i": i})
    return queue, [queue.get(timeout=5) for _ in range(n)]


def test_acks_in_an_event_loop_reach_redis_together(conn, redis_db):
    r = redis_db(DB)
    queue, messages = _received(conn, 3)
    assert r.hlen("unacked") == 3
    hub = Hub()
    set_event_loop(hub)
    try:
        for message in messages:
            message.ack()
        assert all(m.acknowledged for m in messages)
        assert r.hlen("unacked") == 3  # deferred: nothing sent yet
        assert flush_acks() == 3
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
        assert flush_acks() == 0
    finally:
        set_event_loop(None)
        hub.close()
        queue.close()


def test_without_an_event_loop_kombu_acks_at_once(conn, redis_db):
    r = redis_db(DB)
    queue, messages = _received(conn, 2)
    messages[0].ack()
    assert r.hlen("unacked") == 1
    messages[1].ack()
    assert r.hlen("unacked") == 0
    channel = conn.default_channel
    with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
        assert first is second  # one client per channel
    queue.close()


def test_acks_of_a_closed_channel_are_dropped_without_stopping_the_loop(conn, redis_db):
    """After a lost connection Celery reconnects on a new channel; a flush that still holds the
    old channel's acks must not raise inside the event loop (it stopped the worker: scenario b)."""
    r = redis_db(DB)
    queue, messages = _received(conn, 2)
    hub = Hub()
    set_event_loop(hub)
    try:
        for message in messages:
            message.ack()
        conn.default_channel.close()  # kombu sets the channel's connection to None
        assert flush_acks() == 0
        assert r.hlen("unacked") == 2  # left for the reaper, as orphans of running or done jobs
    finally:
        set_event_loop(None)
        hub.close()
