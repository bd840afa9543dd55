"""The batch task: celery-batches buffers render messages and hands them over as a list.

Data flow: Redis queue of one pool → **this task** (up to ``flush_every`` messages, or what
arrived within ``flush_interval`` seconds) → the worker's batch handler
(:class:`worker.runner.BatchRunner` behind the circuit breaker, see :mod:`worker.consumer`).

The task never raises: a job's failure is recorded in the job-state store, and an unexpected
error of the handler is logged here, so the worker lives on and the batch's messages are
acknowledged (whatever must still run stays ``queued`` or ``running`` in the store, where the
reaper finds it).

Reconnects: when Celery's consumer loses the broker it resets its event loop and clears the
loop's timer (``celery.worker.loops.asynloop``, Celery 5.6), which drops celery-batches'
periodic flush; celery-batches re-arms that flush only when its reference to it is empty, and
the reference outlives the clear. A partial batch received after the reconnect would then wait
in the buffer until a ``flush_every``-th message arrived, possibly never, while the worker's
heartbeat reported it as reserved (so the reaper would not republish it either). A consumer
bootstep re-arms the flush at every start of the consumer, the first and each reconnect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, bootsteps
from celery_batches import Batches

from infra.broker.app import TASK_NAME

log = logging.getLogger("renderfarm.worker")


def rearm_flush(task: Batches, timer) -> bool:
    """Re-arm ``task``'s periodic flush on ``timer`` (a ``kombu.asynchronous.timer.Timer``) when
    celery-batches believes it armed: the old entry is cancelled (it may still be queued, if
    the consumer restarted without clearing the timer) and a fresh one takes its place.

    Uses celery-batches' ``_tref`` and ``_do_flush`` (0.11): it has no public way to do this.
    Returns True when it re-armed."""
    tref = getattr(task, "_tref", None)
    if tref is None:  # disarmed: the next message arms it
        return False
    tref.cancel()
    task._tref = timer.call_repeatedly(task.flush_interval, task._do_flush)
    return True


def install_render_task(app: Celery, handle: Callable[[Sequence[Any]], Any], *, batch_size: int,
                        flush_interval_s: float, on_consumer_start: Callable[[Any], None] | None = None):
    """Register the batch task on ``app``: ``handle(requests)`` runs at ``batch_size`` messages
    or after ``flush_interval_s`` seconds, whichever comes first. Returns the task.

    At every start of Celery's consumer (the first, and after each lost broker connection) the
    batch flush is re-armed (:func:`rearm_flush`) and then ``on_consumer_start(consumer)`` is
    called, in the consumer's thread, for timers of the caller's own (those are cleared too)."""

    @app.task(name=TASK_NAME, base=Batches, flush_every=batch_size, flush_interval=flush_interval_s,
              acks_late=True, typing=False)
    def render(requests):
        try:
            handle(requests)
        except Exception:
            log.exception("batch of %d message(s) failed outside any job; the reaper recovers its jobs",
                          len(requests))

    class RearmTimers(bootsteps.StartStopStep):
        """Consumer bootstep: runs after the task step at every (re)start of the consumer."""

        name = "renderfarm.rearm-timers"
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c) -> None:
            if rearm_flush(render, c.timer):
                log.info("consumer restarted: batch flush re-armed (%d message(s) buffered)", render._buffer.qsize())
            if on_consumer_start is not None:
                on_consumer_start(c)

    app.steps["consumer"].add(RearmTimers)
    return render
