"""The batch task: celery-batches buffers render messages and hands them over as a list.

Data flow: Redis queue of one pool → **this task** (up to ``flush_every`` messages, or what
arrived within ``flush_interval`` seconds) → :class:`worker.runner.BatchRunner`.
"""

from __future__ import annotations

from celery import Celery
from celery_batches import Batches

from infra.queue import TASK_NAME
from worker.runner import BatchRunner


def install_render_task(app: Celery, runner: BatchRunner, *, batch_size: int, flush_interval_s: float):
    """Register the batch task on ``app``: flush at ``batch_size`` messages or after
    ``flush_interval_s`` seconds, whichever comes first. Returns the task."""

    @app.task(name=TASK_NAME, base=Batches, flush_every=batch_size, flush_interval=flush_interval_s,
              acks_late=True, typing=False)
    def render(requests):
        runner.run(requests)

    return render


def set_batch_size(task, batch_size: int) -> None:
    """Change how many messages make a full batch (used after an out-of-memory split)."""
    task.flush_every = max(1, batch_size)
