"""The worker's circuit breaker: a worker that fails every batch stops taking work.

Data flow: the batch task reports each batch's outcome → **breaker** → on trip, the worker
cancels its queue consumer (so the pool's other workers take the jobs) and its heartbeat tells
the registry ``healthy: false``, which ``/v1/workers`` and ``/healthz`` show.

A *failed batch* is one in which jobs ran and every one of them ended in an error (a poison
request among good ones does not count: the good ones succeed). After ``threshold``
consecutive failed batches the breaker opens. After ``cooldown_s`` (0 = never) it lets one
batch through again (half-open): success closes it, another failure opens it again at once.
A zombie worker (a broken device, a corrupt model) so costs the farm a few batches per
cool-down, not every job it would have pulled. An error that is plainly this worker's
infrastructure's (``worker.errors``: S3 credentials, a broken device) opens it at once
(:meth:`CircuitBreaker.trip`), without waiting for ``threshold`` batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("renderfarm.worker")


class CircuitBreaker:
    """Counts consecutive failed batches; calls ``on_trip()`` when ``threshold`` is reached."""

    def __init__(self, threshold: int, *, on_trip: Callable[[], None] | None = None):
        self.threshold = threshold
        self.on_trip = on_trip or (lambda: None)
        self.consecutive_failures = 0
        self.tripped_at: float | None = None
        self.reason = ""  # why it opened at once (trip), "" otherwise
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """True while tripped: the worker takes no new batch."""
        return self.tripped_at is not None

    def record(self, failed_batch: bool, infrastructure: str = "") -> None:
        """Note one batch's outcome; trips the breaker on the ``threshold``-th failure in a row,
        or at once when ``infrastructure`` names an error of this worker's infrastructure."""
        if infrastructure:
            self.trip(infrastructure)
            return
        with self._lock:
            if not failed_batch:
                if self.consecutive_failures or self.open:
                    log.info("circuit breaker closed after a successful batch")
                self.consecutive_failures = 0
                self.tripped_at = None
                self.reason = ""
                return
            self.consecutive_failures += 1
            trip = self.consecutive_failures >= self.threshold and not self.open
            if trip:
                self.tripped_at = time.time()
        if trip:
            log.error("circuit breaker open: %d consecutive failed batches; this worker stops consuming",
                      self.consecutive_failures)
            self.on_trip()

    def trip(self, reason: str) -> None:
        """Open the breaker now (an infrastructure error: ``reason``); no-op when already open."""
        with self._lock:
            if self.open:
                return
            self.tripped_at = time.time()
            self.reason = reason
            self.consecutive_failures = max(self.consecutive_failures, self.threshold)
        log.error("circuit breaker open at once: %s; this worker stops consuming", reason)
        self.on_trip()

    def half_open(self) -> None:
        """Let the next batch through; its failure trips the breaker again at once."""
        with self._lock:
            self.tripped_at = None
            self.reason = ""
            self.consecutive_failures = max(0, self.threshold - 1)
        log.warning("circuit breaker half-open: trying one batch")

    def state(self) -> dict:
        """For the registry: ``open``, ``consecutive_failures``, ``tripped_at`` (epoch seconds or None),
        ``reason`` (the infrastructure error that opened it at once, or "")."""
        return {"open": self.open, "consecutive_failures": self.consecutive_failures, "tripped_at": self.tripped_at,
                "reason": self.reason}
