"""The Celery app and how jobs are published to it.

Data flow: producer side (the API's submission) → **Redis broker, one queue per pool** → the
worker's batch task (``worker.tasks``), which this module names but does not define, so that
publishing needs no diffusers.

Settings that matter for batching and safety:
- JSON only (``task_serializer``/``accept_content``): a pickle payload is never accepted.
- ``task_acks_late``: a message is acked after its batch is rendered, so a killed worker's
  jobs are redelivered rather than lost.
- ``worker_prefetch_multiplier`` is set by each worker to 2 × its batch size so a full batch
  forms while the previous one renders (DESIGN.md §3.10).
- ``visibility_timeout`` is far longer than any batch, so a live worker's batch is never
  redelivered to another (§3.2); a dead worker's jobs are recovered by lease expiry instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from celery import Celery

from infra.pools import queue_name
from infra.settings import Settings

TASK_NAME = "renderfarm.render"
PRIORITY_VALUES = {"high": 0, "normal": 5, "low": 9}  # kombu redis: lower number = served first
VISIBILITY_TIMEOUT_S = 12 * 3600


def make_celery(settings: Settings) -> Celery:
    """A Celery app on the settings' Redis; used by publishers and workers alike."""
    app = Celery("renderfarm", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        task_ignore_result=True, result_backend=None, task_acks_late=True,
        task_reject_on_worker_lost=True, worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, broker_connection_max_retries=None,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S, "priority_steps": list(range(10)),
                                  "sep": ":", "queue_order_strategy": "priority"},
        task_default_priority=PRIORITY_VALUES["normal"], worker_send_task_events=False,
        task_send_sent_event=False, worker_enable_remote_control=False,
    )
    return app


def publish_jobs(app: Celery, jobs: Iterable[tuple[str, str]], priority: str = "normal") -> int:
    """Publish one render message per ``(job_id, pool)`` in pipelined round trips.

    Uses kombu's ``Producer.batch()``, which buffers publishes and writes them to Redis in
    pipelines of up to 1,000, so 10,000 jobs cost ~10 round trips, not 10,000.

    Returns:
        the number of messages published.
    """
    n = 0
    with app.producer_or_acquire() as producer:
        with producer.batch():
            for job_id, pool in jobs:
                app.send_task(TASK_NAME, kwargs={"job_id": job_id}, queue=queue_name(pool),
                              routing_key=queue_name(pool), priority=PRIORITY_VALUES[priority],
                              producer=producer)
                n += 1
    return n
