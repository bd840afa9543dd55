"""The worker's heartbeat part: a daemon thread that re-registers the worker and renews its leases.

Data flow: worker → **registry** (``GET /v1/workers``, the dashboard) and → job-state store
(leases of the jobs it holds, so that only a dead worker's jobs are ever recovered).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from infra.state import registry

log = logging.getLogger("renderfarm.worker")


class Heartbeat(threading.Thread):
    """Every ``interval_s`` seconds: publish ``describe()`` to the registry with TTL ``ttl_s``."""

    def __init__(self, client: redis.Redis, name: str, describe: Callable[[], dict[str, Any]], *,
                 interval_s: float, ttl_s: float, on_beat: Callable[[], object] | None = None):
        super().__init__(name="renderfarm-heartbeat", daemon=True)
        self.client, self.worker_name, self.describe = client, name, describe
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.on_beat = on_beat or (lambda: None)
        self._stop_event = threading.Event()

    def start(self) -> None:
        """Register now (raises when Redis is away: a worker that cannot register takes no
        work), then beat every ``interval_s`` seconds in this thread. Once started, a second
        call only beats (the worker starts it before loading, then again with its parts)."""
        self.beat()
        if not self.is_alive():
            super().start()

    def beat(self) -> None:
        """One heartbeat now."""
        registry.heartbeat(self.client, self.worker_name, self.describe(), self.ttl_s)
        self.on_beat()

    def beat_quietly(self) -> None:
        """One heartbeat now; a failure is logged, never raised (Redis briefly away)."""
        try:
            self.beat()
        except Exception as exc:
            log.warning("heartbeat failed: %s", exc)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.beat_quietly()  # keep beating through a Redis outage, never kill the worker

    def stop(self) -> None:
        """Stop beating and remove the worker from the registry."""
        self._stop_event.set()
        try:
            registry.deregister(self.client, self.worker_name)
        except Exception as exc:
            log.warning("could not deregister: %s", exc)
