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
- ``visibility_timeout`` (12 h) is far longer than any batch. Kombu's Redis transport
  redelivers an unacknowledged message once it is older than this, whether or not its worker
  is alive; with the default one hour, a long GPU batch, or one waiting behind it in the
  prefetch buffer, would be rendered a second time by another worker (§3.2). Recovery of a
  *dead* worker's jobs does not wait for it: their leases expire in the job-state store and
  the reaper (``infra.reaper``) republishes them within seconds. The redelivery that still
  comes 12 h later is harmless: the start script skips a job that is running or finished.
- Each message's task id is its job id, so the reaper can tell which jobs have a message
  waiting in a queue (and a duplicate message is recognisable as one).
- A worker's SIGTERM is Celery's warm shutdown: the current batch finishes and is acked, and
  kombu puts the prefetched, unstarted messages back in the queue when the channel closes.

Production Redis runs with the append-only file on (``appendonly yes``, ``appendfsync
everysec``; ``renderfarm up --appendonly`` does so for the Redis it starts): queues, job
states and leases then survive a restart of redis-server, and workers, reaper and API reconnect
on their own.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterable

from celery import Celery
from kombu.utils import json as kombu_json

from infra.pools import queue_name
from infra.settings import Settings

TASK_NAME = "renderfarm.render"
#: Broker priorities (kombu redis: lower number = served first, one list per level). The order
#: between priorities and tenants is decided before publishing, by ``infra.dispatch``, which
#: publishes every job ``normal``; only recovered jobs (``infra.reaper``) are published ``high``,
#: to go ahead of the few messages the dispatcher keeps in a queue.
PRIORITY_VALUES = {"high": 0, "normal": 5, "low": 9}
PRIORITY_SEP = ":"
VISIBILITY_TIMEOUT_S = 12 * 3600


def broker_keys(pool: str) -> list[str]:
    """The Redis lists holding a pool's queued messages, one per broker priority, most urgent
    first: ``renderfarm.{pool}`` (priority 0), then ``renderfarm.{pool}:{n}``."""
    queue = queue_name(pool)
    return [queue if n == 0 else f"{queue}{PRIORITY_SEP}{n}" for n in sorted(set(PRIORITY_VALUES.values()))]


def make_celery(settings: Settings) -> Celery:
    """A Celery app on the settings' Redis; used by publishers and workers alike."""
    app = Celery("renderfarm", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        task_ignore_result=True, result_backend=None, task_acks_late=True,
        task_reject_on_worker_lost=True, worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, broker_connection_max_retries=None,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S, "priority_steps": list(range(10)),
                                  "sep": PRIORITY_SEP, "queue_order_strategy": "priority"},
        task_default_priority=PRIORITY_VALUES["normal"], worker_send_task_events=False,
        task_send_sent_event=False, worker_enable_remote_control=False,
    )
    return app


def publish_jobs(app: Celery, jobs: Iterable[tuple[str, str]], priority: str = "normal") -> int:
    """Publish one render message per ``(job_id, pool)`` in pipelined round trips.

    On kombu's Redis transport, Celery builds the first message of each pool itself
    (``send_task``: headers, properties, body, queue declaration); the others are that message
    with the job id (and the delivery tag) substituted, LPUSHed to the same list in pipelines
    of :data:`PUBLISH_CHUNK`. ``send_task`` costs ~240 µs of Python per message (measured: 2.4 s
    for 10,000), the substitution a few µs. Elsewhere (another transport, queue expiry) every
    message goes through ``send_task`` inside kombu's ``Producer.batch()``.

    Returns:
        the number of messages published.
    """
    by_pool: dict[str, list[str]] = {}
    for job_id, pool in jobs:
        by_pool.setdefault(pool, []).append(job_id)
    with app.producer_or_acquire() as producer:
        for pool, job_ids in by_pool.items():
            if not _publish_from_template(app, producer, pool, job_ids, PRIORITY_VALUES[priority]):
                with producer.batch():
                    for job_id in job_ids:
                        _send(app, producer, job_id, pool, PRIORITY_VALUES[priority])
    return sum(len(ids) for ids in by_pool.values())


PUBLISH_CHUNK = 1000


def _send(app: Celery, producer, job_id: str, pool: str, priority: int) -> None:
    app.send_task(TASK_NAME, kwargs={"job_id": job_id}, task_id=job_id, queue=queue_name(pool),
                  routing_key=queue_name(pool), priority=priority, producer=producer)


def _publish_from_template(app: Celery, producer, pool: str, job_ids: list[str], priority: int) -> bool:
    """The Redis fast path of :func:`publish_jobs`; False (nothing published) when it does not apply."""
    channel = producer.channel
    if not all(hasattr(channel, a) for a in ("_put", "_q_for_pri", "_get_message_priority", "conn_or_acquire")):
        return False
    captured: list[tuple[str, dict]] = []
    channel._put = lambda queue, message, **kwargs: captured.append((queue, message))  # this one call only
    try:
        _send(app, producer, job_ids[0], pool, priority)
    finally:
        del channel._put
    if len(captured) != 1 or (getattr(channel, "_expires", None) and captured[0][0] in channel._expires):
        if captured:  # not the shape expected: publish the captured message the regular way
            _send(app, producer, job_ids[0], pool, priority)
            for job_id in job_ids[1:]:
                _send(app, producer, job_id, pool, priority)
        return bool(captured)
    queue, message = captured[0]
    key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    template_id, body, tag = job_ids[0], message["body"], message["properties"]["delivery_tag"]
    raw, body_text = kombu_json.dumps(message), base64.b64decode(body).decode()
    with channel.conn_or_acquire() as client:
        for start in range(0, len(job_ids), PUBLISH_CHUNK):
            pipe = client.pipeline(transaction=False)
            for job_id in job_ids[start:start + PUBLISH_CHUNK]:
                new_body = base64.b64encode(body_text.replace(template_id, job_id).encode()).decode()
                pipe.lpush(key, raw.replace(body, new_body).replace(tag, str(uuid.uuid4())).replace(template_id, job_id))
            pipe.execute()
    return True
