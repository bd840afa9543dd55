"""Celery's own tools see the farm's jobs: the worker state that ``celery inspect`` reads, the
task events and worker heartbeats that Flower shows.

Place in the data flow: queue → celery-batches buffers a job's message (**received**) → the batch
runner starts it (**started**) → renders, stores, records it (**succeeded** / **failed** /
**revoked** when canceled) → each step is told to Celery here:

- Celery's worker state (``celery.worker.state``): reserved on receipt, active while its batch
  runs, ready after; so ``celery inspect reserved`` lists the prefetched jobs, ``inspect stats``
  counts the jobs run, and the worker heartbeats carry the number of jobs rendering now.
  celery-batches buffers messages outside that bookkeeping, which is why it is done here. The
  requests registered never count as Celery-executed tasks (they have no start time), so a
  cold shutdown's ``cancel`` leaves them alone; the worker releases its jobs itself.
- Task events (``task-received``, ``task-started``, ``task-succeeded``, ``task-failed``,
  ``task-revoked``), sent through the worker's own event dispatcher whenever task events are on
  there: ``RENDERFARM_CELERY_TASK_EVENTS=true`` from the start, or ``celery control
  enable_events`` (which Flower sends by itself) at any time. Off, they cost nothing; on, one
  pipelined read of the batch's job states after each batch.
- Worker heartbeats (``worker-heartbeat``, ``worker-offline``) also from a thread of their own
  (:class:`CeleryHeartbeat`), on a connection of their own: Celery's own heartbeat runs in the
  solo pool's event loop, which is busy for the whole of a batch, so it falls silent during
  every render and Flower would show a working worker as offline.

A failure here is logged and never reaches a batch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery
from celery.worker import state as celery_state

from infra.schemas import JobStatus

log = logging.getLogger("renderfarm.worker")


def _safe(fn):
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - observability must never fail a batch
            log.warning("celery bookkeeping failed in %s: %s: %s", fn.__name__, type(exc).__name__, exc)
            return None

    guarded.__name__ = fn.__name__
    guarded.__doc__ = fn.__doc__
    return guarded


class CeleryVisibility:
    """Tells Celery's worker state and event stream what happens to the jobs of one worker.

    Call :meth:`bind` with the consumer once the worker is ready (``worker_ready`` signal), then
    :meth:`received` per message (Celery's request) and :meth:`started` / :meth:`finished` around
    each batch (with celery-batches' ``SimpleRequest`` copies, matched to Celery's by id).
    """

    def __init__(self) -> None:
        self.consumer: Any = None
        self._started_at = 0.0
        self._requests: dict[str, Any] = {}  # id → Celery's request, from receipt to the end of its batch

    def _celery_requests(self, requests: Sequence[Any], *, forget: bool = False) -> list[Any]:
        take = self._requests.pop if forget else self._requests.get
        return [take(r.id, None) or r for r in requests]

    def bind(self, consumer: Any) -> None:
        """The Celery consumer whose event dispatcher sends the task events."""
        self.consumer = consumer

    def task_events_on(self) -> bool:
        """Whether the worker's event dispatcher sends task events now."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        return bool(dispatcher is not None and dispatcher.enabled
                    and (not dispatcher.groups or "task" in dispatcher.groups))

    @_safe
    def received(self, request: Any) -> None:
        """A job's message entered the batch buffer: reserved, and ``task-received``."""
        self._requests[request.id] = request
        celery_state.task_reserved(request)
        if self.task_events_on():
            eta, expires = request.eta, request.expires
            request.send_event("task-received", name=request.name, args=request.argsrepr,
                               kwargs=request.kwargsrepr, root_id=request.root_id, parent_id=request.parent_id,
                               retries=request.request_dict.get("retries", 0),
                               eta=eta.isoformat() if eta else None, expires=expires.isoformat() if expires else None)

    @_safe
    def started(self, requests: Sequence[Any]) -> None:
        """A batch starts: its jobs are active, and ``task-started`` each."""
        self._started_at = time.monotonic()
        events = self.task_events_on()
        for request in self._celery_requests(requests):
            celery_state.task_accepted(request)
            if events and hasattr(request, "send_event"):
                request.send_event("task-started")

    @_safe
    def finished(self, requests: Sequence[Any], states: Callable[[list[str]], list[JobStatus | None]] | None) -> None:
        """A batch ended: its jobs are ready; with task events on, each job's outcome as read
        through ``states(job_ids)`` (succeeded, failed, or revoked when canceled)."""
        requests = self._celery_requests(requests, forget=True)
        if states is not None and self.task_events_on():
            runtime = time.monotonic() - self._started_at
            statuses = states([r.id for r in requests])
            for request, status in zip(requests, statuses):
                if status is None or not hasattr(request, "send_event"):
                    continue
                if status.state == "succeeded" and status.result is not None:
                    request.send_event("task-succeeded", result=repr(status.result.key), runtime=runtime)
                elif status.state == "failed":
                    error = status.error
                    request.send_event("task-failed", exception=f"{error.type}({error.message!r})" if error else "",
                                       traceback="")
                elif status.state == "canceled":
                    request.send_event("task-revoked", terminated=False, signum=None, expired=False)
        for request in requests:
            celery_state.task_ready(request)


class CeleryHeartbeat(threading.Thread):
    """Celery ``worker-heartbeat`` events every ``interval_s`` seconds for Flower and ``celery
    events``, from a daemon thread of their own on a connection of their own (see the module
    docstring), so that neither a busy event loop nor a slow broker delays anything else: the
    farm's own heartbeat renews leases. ``hostname`` is the worker's Celery node name
    (``celery@<name>``). :meth:`stop` sends ``worker-offline``."""

    def __init__(self, app: Celery, hostname: str, interval_s: float):
        super().__init__(name="celery-heartbeat", daemon=True)
        self.app, self.hostname, self.interval_s = app, hostname, interval_s
        self._connection: Any = None
        self._dispatcher: Any = None
        self._stop_event = threading.Event()

    def _send(self, event: str) -> None:
        if self._dispatcher is None:
            self._connection = self.app.connection_for_write(connect_timeout=2)
            self._dispatcher = self.app.events.Dispatcher(self._connection, hostname=self.hostname, groups=["worker"])
        self._dispatcher.send(event, freq=self.interval_s, active=len(celery_state.active_requests),
                              processed=celery_state.all_total_count[0], loadavg=_load_average(), retry=False,
                              **celery_state.SOFTWARE_INFO)

    @_safe
    def beat(self, event: str = "worker-heartbeat") -> None:
        """Send ``event`` now; a failure drops the connection, which the next beat reopens."""
        try:
            self._send(event)
        except Exception:
            self._close()
            raise

    def run(self) -> None:
        self.beat()
        while not self._stop_event.wait(self.interval_s):
            self.beat()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating, send ``worker-offline``, close the connection."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)
        self.beat("worker-offline")
        self._close()

    def _close(self) -> None:
        dispatcher, connection = self._dispatcher, self._connection
        self._dispatcher = self._connection = None
        for closeable in (dispatcher, connection):
            if closeable is not None:
                try:
                    closeable.close()
                except Exception:  # noqa: BLE001 - already broken
                    pass


def _load_average() -> tuple[float, float, float]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except (OSError, AttributeError):
        return (0.0, 0.0, 0.0)
