"""The parts every background loop shares (infra/background.py) and the key names (infra/keys.py),
on the session's real redis-server."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from infra import keys
from infra.background import PeriodicLoop, RedisLock, server_time

DB = 7


def test_a_lock_is_exclusive_released_by_its_holder_only_and_expires(redis_db):
    r = redis_db(DB)
    locks = RedisLock(r)
    with locks.hold("rf:test:lock", 10_000) as first:
        with locks.hold("rf:test:lock", 10_000) as second:
            assert first and not second
        assert r.exists("rf:test:lock")  # the refused claim did not release the holder's lock
    assert not r.exists("rf:test:lock")
    old = locks.hold("rf:test:lock", 50)
    assert old.__enter__()
    time.sleep(0.1)  # expired: another holder takes it, and the old holder must not free it
    new = locks.hold("rf:test:lock", 10_000)
    assert new.__enter__()
    old.__exit__(None, None, None)
    assert r.exists("rf:test:lock")
    new.__exit__(None, None, None)
    assert not r.exists("rf:test:lock")


def test_server_time_is_the_redis_clock(redis_db):
    r = redis_db(DB)
    seconds, micros = r.time()
    assert abs(server_time(r) - (seconds + micros / 1e6)) < 1.0


def test_a_loop_passes_on_schedule_wakes_at_once_survives_errors_and_stops():
    passes: list[float] = []
    failed = threading.Event()

    def body() -> None:
        passes.append(time.monotonic())
        if len(passes) == 2:
            failed.set()
            raise ConnectionError("Redis restarting")

    loop = PeriodicLoop("test-loop", body, interval_s=30.0, log=logging.getLogger("test"))
    loop.start()
    deadline = time.monotonic() + 5
    while not passes and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.wake()  # the second pass comes now, not 30 s later, and raises
    assert failed.wait(5)
    loop.wake()  # the loop survived its error
    while len(passes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop(timeout=5)
    assert len(passes) == 3 and passes[-1] - passes[0] < 5
    assert not loop._thread.is_alive()


@pytest.mark.parametrize("pool", ["tiny", "h100-sdxl", "stabilityai--sd-turbo"])
def test_broker_list_names_map_back_to_their_pool(pool):
    assert keys.queue(pool) == f"renderfarm.{pool}"
    for level in (0, 5, 9):
        assert keys.pool_of_broker_list(keys.broker_list(pool, level)) == pool
    assert keys.pool_of_broker_list(keys.job("x")) is None
