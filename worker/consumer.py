"""The worker's consumer part: Celery's worker on the pool's queue, each pulled batch handed to
the batch runner behind the circuit breaker.

Place in the data flow: Redis queue of one pool → Celery (solo pool, concurrency 1) →
celery-batches' task (:mod:`worker.tasks`) → **here** → :class:`worker.runner.BatchRunner`;
each batch's outcome goes back to the breaker (:class:`worker.breaker.ConsumerBreaker`) and
Celery's own tools hear of each job (:mod:`worker.observe`).

- Received messages are *reserved* jobs until their batch starts (:class:`ReservedJobs`,
  reported in the heartbeat so that the reaper knows their messages are not lost).
- While the breaker is open, batches still buffered are republished for other workers.
- Overlapped (``RENDERFARM_WORKER_OVERLAP``), a batch's outcome reaches the breaker when it is
  recorded, through a timer of the consumer's event loop, not only when the next batch
  arrives (which a tripping worker may never get).
- :meth:`Consumer.start` runs Celery's worker until SIGTERM (warm shutdown: the batch in hand
  finishes, prefetched messages go back to the queue); :meth:`Consumer.stop` waits for the
  batches in flight to be stored and sends the last acks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from celery import Celery, signals

from infra.broker.kombu_redis import flush_acks, install_cheap_acks, install_malformed_message_guard
from infra.broker.publish import republish
from infra.settings import Settings
from infra.state.job_store import JobStore
from pipeline.memory import current_bytes
from worker.batch import BatchOutcome, job_ids_from_messages
from worker.breaker import ConsumerBreaker
from worker.observe import CeleryVisibility
from worker.runner import BatchRunner
from worker.tasks import install_render_task

log = logging.getLogger("renderfarm.worker")


class ReservedJobs:
    """Job ids this worker has received but not yet started (celery-batches' buffer: its
    prefetched jobs), reported in its heartbeat so the reaper knows their messages are not lost.

    Also the most it ever held at once (:attr:`peak`) and the process's RSS in KiB at the moment
    it first held that many (:attr:`rss_at_peak_kib`, read only when the peak grows, so at most
    once per prefetch slot over the worker's life), for ``renderfarm bench farm``'s memory rows.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self.peak = 0
        self.rss_at_peak_kib: int | None = None

    def add(self, job_id: str) -> None:
        """Note a job id whose message this worker received."""
        with self._lock:
            self._ids.add(job_id)
            if len(self._ids) > self.peak:
                self.peak = len(self._ids)
                self.rss_at_peak_kib = current_bytes("cpu") // 1024

    def discard(self, job_ids: Iterable[str]) -> None:
        """Forget job ids handed to a batch (started or skipped)."""
        with self._lock:
            self._ids.difference_update(job_ids)

    def snapshot(self) -> list[str]:
        """The job ids held now, sorted (for the heartbeat)."""
        with self._lock:
            return sorted(self._ids)


def _job_id(request: Any) -> str | None:
    """The job id a Celery request carries in its kwargs, or None (a malformed message)."""
    kwargs = getattr(request, "kwargs", None)
    job_id = kwargs.get("job_id") if isinstance(kwargs, dict) else None
    return job_id if isinstance(job_id, str) else None


class Consumer:
    """Celery's consumer for one pool's queue, as a part of the worker.

    Args:
        app: the Celery app. runner: renders the pulled batches. store: the job-state store
            (republishing, task events). breaker: the worker's circuit breaker part.
        settings: ``worker_overlap``, ``flush_interval_s``. queue: the pool's queue.
        name: the worker's name (Celery's hostname). batch_size: messages per batch; twice that
            many are prefetched (Celery's prefetch, concurrency 1). loglevel: Celery's.
    """

    def __init__(self, app: Celery, runner: BatchRunner, store: JobStore, breaker: ConsumerBreaker,
                 settings: Settings, *, queue: str, name: str, batch_size: int, loglevel: str):
        self.app, self.runner, self.store, self.breaker = app, runner, store, breaker
        self.overlap = settings.worker_overlap
        self.queue, self.name, self.loglevel = queue, name, loglevel
        self.prefetch = 2 * batch_size  # messages held unacked at once (Celery's prefetch, concurrency 1)
        self.reserved = ReservedJobs()
        self.visibility = CeleryVisibility()
        self._awaiting: dict[str, Any] = {}  # job id → its Celery request, until its batch is recorded
        self._outcome_timer: Any = None
        signals.task_received.connect(self._on_received, weak=False)
        signals.worker_ready.connect(self._on_ready, weak=False)
        install_render_task(app, self._handle, batch_size=batch_size, flush_interval_s=settings.flush_interval_s,
                            on_consumer_start=self._on_consumer_start)

    def start(self) -> None:
        """Run Celery's worker on the queue until a (warm or cold) shutdown; returns then."""
        install_malformed_message_guard()
        install_cheap_acks()
        # Celery's worker heartbeat stays on: it keeps the worker's event dispatcher, in which
        # `celery control enable_events` (and Flower) switch the task events on.
        self.app.worker_main([
            "worker", "--pool", "solo", "--concurrency", "1", "--queues", self.queue,
            "--hostname", self.name, "--prefetch-multiplier", str(self.prefetch), "--without-gossip",
            "--without-mingle", "--loglevel", self.loglevel,
        ])

    def stop(self) -> None:
        """Finish the batches in flight (rendered groups still being stored: the heartbeat renews
        their leases meanwhile), then send the acks the event loop had no iteration left to send."""
        self.runner.drain()
        try:
            flush_acks()
        except Exception as exc:  # Redis away: the reaper clears the unacked entries
            log.warning("could not send the last acks: %s", exc)

    def describe(self) -> dict:
        """For the heartbeat: the reserved job ids and the prefetch's limit and peak."""
        return {"reserved_jobs": self.reserved.snapshot(),
                "prefetch": {"limit": self.prefetch, "peak_jobs": self.reserved.peak,
                             "rss_kib_at_peak": self.reserved.rss_at_peak_kib}}

    def _handle(self, requests: Sequence[Any]) -> None:
        """The batch task's handler: one pulled batch, in Celery's consumer thread."""
        job_ids = job_ids_from_messages(requests, log_rejects=False)  # the runner logs them
        self.reserved.discard(job_ids)
        if self.breaker.open:  # still buffered when the breaker tripped: hand them to other workers
            republish(self.store, self.app, job_ids)
            self.visibility.finished(requests, None)
            return
        self.visibility.started(requests)
        if not self.overlap:
            try:
                outcomes = [self.runner.run(requests)]
            finally:
                self.visibility.finished(requests, self.store.get_jobs)
            self._record(outcomes)
            return
        try:  # overlapped: returns once the batch is started, with the batches recorded since
            outcomes = self.runner.run_overlapped(requests)
        except BaseException:
            self.visibility.finished(requests, self.store.get_jobs)
            raise
        for request in requests:  # ready (task events, inspect) when their batch is recorded
            job_id = _job_id(request)
            if job_id is None:
                self.visibility.finished([request], None)
            else:
                self._awaiting[job_id] = request
        self._record(outcomes)

    def _record(self, outcomes: Iterable[BatchOutcome]) -> None:
        """Each recorded batch's outcome to the breaker, its jobs ready for Celery's tools. Runs
        in Celery's consumer thread (the batch task, or the consumer's timer)."""
        for outcome in outcomes:
            self.breaker.record(outcome.failed_batch, outcome.infrastructure)
            done = [self._awaiting.pop(j) for j in outcome.job_ids if j in self._awaiting]
            if done:
                self.visibility.finished(done, self.store.get_jobs)

    def _on_received(self, sender: Any = None, request: Any = None, **_kw: Any) -> None:
        if (job_id := _job_id(request)) is not None:
            self.reserved.add(job_id)
        self.visibility.received(request)

    def _on_ready(self, sender: Any = None, **_kw: Any) -> None:
        self.visibility.bind(sender)
        self.breaker.bind(sender)  # opened before the consumer ran (the credentials check): applied now

    def _on_consumer_start(self, c: Any) -> None:
        """Every start of the consumer (a lost broker connection clears its event loop's timers)."""
        self.breaker.consumer_started(c)
        if self.overlap:  # the timer runs in the consumer's event loop, where a trip may cancel the queue
            if self._outcome_timer is not None:
                self._outcome_timer.cancel()
            self._outcome_timer = c.timer.call_repeatedly(0.5, lambda: self._record(self.runner.take_done()))
