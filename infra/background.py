"""What every background loop of the farm shares: a periodic thread, a Redis lock, server time.

Place in the data flow: beside it. The API process runs three loops on these parts: the
dispatcher (wait lanes → pool queues, :mod:`infra.broker.dispatch`), the reaper (dead workers'
jobs and lost messages back to work, :mod:`infra.broker.reaper`) and the webhook deliverer
(:mod:`infra.api.webhooks.delivery`). Each is safe to run in every API replica: a :class:`RedisLock`
makes one replica do a given piece of work at a time, and times are the Redis server's clock
(:func:`server_time`), never a host's, so clock skew between hosts does not matter.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Iterator

import redis


def server_time(client: redis.Redis) -> float:
    """The Redis server's clock, epoch seconds (the clock every lease and wait is measured on).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    seconds, micros = client.time()
    return seconds + micros / 1e6


# Delete the key only if it still holds our token, so an expired lock another holder has taken
# since is never released by the old one.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLock:
    """Short exclusive claims in Redis (``SET key token NX PX ttl``), released only by their
    holder. A holder that dies loses the claim after ``ttl``.

    Args:
        client: the Redis client the claims live in.
    """

    def __init__(self, client: redis.Redis):
        self.client = client
        self._release = client.register_script(_RELEASE)

    @contextlib.contextmanager
    def hold(self, key: str, ttl_ms: int) -> Iterator[bool]:
        """Try to claim ``key`` for at most ``ttl_ms`` milliseconds; yields whether the claim was
        taken (``False``: another holder has it; do nothing) and releases it on exit.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        token = secrets.token_hex(8)
        held = bool(self.client.set(key, token, nx=True, px=max(1, int(ttl_ms))))
        try:
            yield held
        finally:
            if held:
                self._release(keys=[key], args=[token])


class PeriodicLoop:
    """Runs ``body()`` every ``interval_s`` seconds in a daemon thread until stopped.

    :meth:`wake` starts the next pass at once (the dispatcher is woken by every submission).
    An exception from ``body`` (Redis restarting, a publish failing) is logged as a warning and
    the loop goes on: a background loop never dies of a passing fault.

    Args:
        name: the thread's name, also used in log lines.
        body: one pass of the loop.
        interval_s: seconds between the end of a pass and the start of the next.
        log: where failures are logged.
    """

    def __init__(self, name: str, body: Callable[[], object], interval_s: float, log: logging.Logger):
        self.name = name
        self.body = body
        self.interval_s = interval_s
        self.log = log
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Pass until :meth:`stop` is called (blocks the calling thread)."""
        while not self._stop.is_set():
            try:
                self.body()
            except Exception as exc:  # a passing fault: try again next pass
                self.log.warning("%s pass failed: %s: %s", self.name, type(exc).__name__, exc)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def start(self) -> PeriodicLoop:
        """Run :meth:`run` in a daemon thread; returns self."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Start the next pass now."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait for its thread (at most ``timeout`` seconds)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
