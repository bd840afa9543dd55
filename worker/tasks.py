"""The batch task: celery-batches buffers render messages and hands them over as a list.

Data flow: Redis queue of one pool → **this task** (up to ``flush_every`` messages, or what
arrived within ``flush_interval`` seconds) → the worker's batch handler
(:class:`worker.runner.BatchRunner` behind the circuit breaker, see ``worker.main``).

The task never raises: a job's failure is recorded in the job-state store, and an unexpected
error of the handler is logged here, so the worker lives on and the batch's messages are
acknowledged (whatever must still run stays ``queued`` or ``running`` in the store, where the
reaper finds it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery
from celery_batches import Batches

from infra.broker.app import TASK_NAME

log = logging.getLogger("renderfarm.worker")


def install_render_task(app: Celery, handle: Callable[[Sequence[Any]], Any], *, batch_size: int,
                        flush_interval_s: float):
    """Register the batch task on ``app``: ``handle(requests)`` runs at ``batch_size`` messages
    or after ``flush_interval_s`` seconds, whichever comes first. Returns the task."""

    @app.task(name=TASK_NAME, base=Batches, flush_every=batch_size, flush_interval=flush_interval_s,
              acks_late=True, typing=False)
    def render(requests):
        try:
            handle(requests)
        except Exception:
            log.exception("batch of %d message(s) failed outside any job; the reaper recovers its jobs",
                          len(requests))

    return render
