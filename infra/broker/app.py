"""The Celery app: the broker every producer publishes to and every worker consumes from.

Data flow: the dispatcher and the reaper publish (:mod:`infra.broker.publish`) → **Redis broker,
one queue per pool** → the worker's batch task (:mod:`worker.tasks`), which this module names but
does not define, so that publishing needs no diffusers.

Settings that matter for batching and safety:
- JSON only (``task_serializer``/``accept_content``): a pickle payload is never accepted.
- ``task_acks_late``: a message is acked after its batch is rendered, so a killed worker's
  jobs are redelivered rather than lost.
- ``worker_prefetch_multiplier`` is set by each worker to 2 × its batch size so a full batch
  forms while the previous one renders (a prefetch capped below the batch size would never
  let a batch form).
- ``visibility_timeout`` (12 h) is far longer than any batch. Kombu's Redis transport
  redelivers an unacknowledged message once it is older than this, whether or not its worker
  is alive; with the default one hour, a long GPU batch, or one waiting behind it in the
  prefetch buffer, would be rendered a second time by another worker (Celery's documented
  caveat for the Redis transport). Recovery of a *dead* worker's jobs does not wait for it:
  their leases expire in the job-state store and the reaper (:mod:`infra.broker.reaper`)
  republishes them within seconds. The redelivery that still comes 12 h later is harmless: the
  start script skips a job that is running or finished.
- Each message's task id is its job id, so the reaper can tell which jobs have a message
  waiting in a queue (and a duplicate message is recognisable as one).
- A worker's SIGTERM is Celery's warm shutdown: the current batch finishes and is acked, and
  kombu puts the prefetched, unstarted messages back in the queue when the channel closes.
- Celery's own tools see the farm: remote control is on (``celery -A infra.broker.celery_app
  inspect ping|stats|reserved``, answered by a worker between two batches), workers send
  worker events (heartbeats, also during batches) and, with
  ``RENDERFARM_CELERY_TASK_EVENTS`` or once Flower or ``celery control enable_events`` turns them
  on, a task event per job (:mod:`worker.observe`).

Production Redis runs with the append-only file on (``appendonly yes``, ``appendfsync
everysec``; ``renderfarm up --appendonly`` does so for the Redis it starts): queues, job
states and leases then survive a restart of redis-server, and workers, reaper and API reconnect
on their own.
"""

from __future__ import annotations

from celery import Celery

from infra import keys
from infra.settings import Settings
from infra.state.connect import celery_broker

TASK_NAME = "renderfarm.render"
#: Broker priorities (kombu redis: lower number = served first, one list per level). The order
#: between priorities and tenants is decided before publishing, by :mod:`infra.broker.dispatch`,
#: which publishes every job ``normal``; only recovered jobs (:mod:`infra.broker.reaper`) are
#: published ``high``, to go ahead of the few messages the dispatcher keeps in a queue.
PRIORITY_VALUES = {"high": 0, "normal": 5, "low": 9}
VISIBILITY_TIMEOUT_S = 12 * 3600


def broker_keys(pool: str) -> list[str]:
    """The Redis lists holding a pool's queued messages, one per broker priority, most urgent
    first: ``renderfarm.{pool}`` (priority 0), then ``renderfarm.{pool}:{n}``."""
    return [keys.broker_list(pool, n) for n in sorted(set(PRIORITY_VALUES.values()))]


def make_celery(settings: Settings, url: str | None = None) -> Celery:
    """A Celery app on the broker at ``url`` (default: the settings' ``redis_url``; a broker shard's
    URL, :mod:`infra.broker.shards`), one Redis or a Sentinel group's primary
    (:func:`infra.state.connect.celery_broker`); used by publishers and workers alike.

    Raises:
        ValueError: a broker URL kombu cannot use (a Redis Cluster, a malformed Sentinel URL).
    """
    broker = celery_broker(url or settings.redis_url)
    app = Celery("renderfarm", broker=broker.url, set_as_current=False)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        task_ignore_result=True, result_backend=None, task_acks_late=True,
        task_reject_on_worker_lost=True, worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, broker_connection_max_retries=None,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S, "priority_steps": list(range(10)),
                                  "sep": keys.PRIORITY_SEP, "queue_order_strategy": "priority",
                                  **broker.transport_options},
        task_default_priority=PRIORITY_VALUES["normal"], worker_send_task_events=settings.celery_task_events,
        task_send_sent_event=False, worker_enable_remote_control=True,
    )
    if broker.use_ssl is not None:
        app.conf.broker_use_ssl = broker.use_ssl
    return app
