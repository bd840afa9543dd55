"""The worker's circuit breaker: a worker that fails every batch stops taking work.

Data flow: the batch task reports each batch's outcome → **breaker** → on trip, the worker
cancels its queue consumer (so the pool's other workers take the jobs) and its heartbeat tells
the registry ``healthy: false``, which ``/v1/workers`` and ``/healthz`` show.
:class:`CircuitBreaker` counts; :class:`ConsumerBreaker` is the worker's part that applies it to
Celery's consumer (cancel the queue on trip, the half-open try after the cool-down, the S3
credentials checked at start and before each try).

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
from typing import Any

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


class ConsumerBreaker:
    """The circuit breaker as a part of the worker, wired to Celery's consumer.

    On trip it cancels the consumer's queue (``cancel_task_queue``) and arms one half-open try
    after ``cooldown_s`` seconds (0 = never) on the consumer's timer; the try checks the S3
    credentials first (still refused: stay open, look again after the cool-down), then lets one
    batch through (``add_task_queue``). Each change is announced through ``on_change`` (a
    heartbeat, so the registry shows ``healthy``). Consumer callbacks run in the consumer's event
    loop (the solo pool), where changing its queues is safe.

    Args:
        threshold: consecutive failed batches that open it (:class:`CircuitBreaker`).
        cooldown_s: seconds open before the half-open try (0 = stays open).
        queue: the pool's queue name.
        credentials_problem: a description of a credential error of this worker's storage, or ""
            (:func:`worker.errors.credentials_problem`).
        on_change: called after the breaker opened or went half-open.
    """

    def __init__(self, threshold: int, cooldown_s: float, queue: str, *, credentials_problem: Callable[[], str],
                 on_change: Callable[[], object]):
        self.breaker = CircuitBreaker(threshold, on_trip=self._on_trip)
        self.cooldown_s, self.queue = cooldown_s, queue
        self.credentials_problem, self.on_change = credentials_problem, on_change
        self._consumer: Any = None  # Celery's consumer, once the worker is ready
        self._reopen: Any = None  # the pending half-open try (a kombu timer entry), at most one

    @property
    def open(self) -> bool:
        """True while tripped: the worker takes no new batch."""
        return self.breaker.open

    def start(self) -> None:
        """Check the S3 credentials before any batch: refused, the breaker opens at once."""
        if problem := self.credentials_problem():
            self.breaker.trip(problem)

    def stop(self) -> None:
        """Drop the pending half-open try."""
        if self._reopen is not None:
            self._reopen.cancel()

    def record(self, failed_batch: bool, infrastructure: str = "") -> None:
        """One batch's outcome (:meth:`CircuitBreaker.record`)."""
        self.breaker.record(failed_batch, infrastructure)

    def describe(self) -> dict:
        """For the heartbeat: ``healthy`` and the ``breaker``'s state."""
        return {"healthy": not self.breaker.open, "breaker": self.breaker.state()}

    def bind(self, consumer: Any) -> None:
        """The worker is ready (Celery's ``worker_ready``): from here on a trip cancels
        ``consumer``'s queue; one that opened before (the credentials check) does so now."""
        self._consumer = consumer
        if self.breaker.open:
            self._on_trip()

    def consumer_started(self, consumer: Any) -> None:
        """Every start of the consumer: a lost broker connection clears its event loop's timers,
        which would leave the breaker open for good, so the half-open try is armed again."""
        if self.breaker.open and self._consumer is not None:
            self._arm_reopen(consumer)

    def _on_trip(self) -> None:
        if self._consumer is not None:  # we run inside the consumer's event loop (solo pool): safe to call
            self._consumer.cancel_task_queue(self.queue)
            self._arm_reopen(self._consumer)
        self.on_change()

    def _arm_reopen(self, consumer: Any) -> None:
        """One pending half-open try per cool-down."""
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = consumer.timer.call_after(self.cooldown_s, self._try_again) if self.cooldown_s > 0 else None

    def _try_again(self) -> None:
        if self.credentials_problem():  # still refused: stay open, look again after the cool-down
            self._arm_reopen(self._consumer)
            return
        self.breaker.half_open()
        if self._consumer is not None:
            self._consumer.add_task_queue(self.queue)
        self.on_change()
