"""Publishing render messages: new jobs (the dispatcher) and jobs going back to work (the reaper,
a worker's requeue, a dead-letter retry).

Data flow: job-state store (the job is ``queued``) → **publish here** → the pool's Celery queue
→ a worker's batch task. Each message carries only the job id (its task id too, so that a
message in a queue names its job): the worker reads the request from the job-state store.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

from celery import Celery
from kombu import Producer

from infra import keys
from infra.broker.app import PRIORITY_VALUES, TASK_NAME
from infra.broker.kombu_redis import publish_by_template
from infra.state.job_store import JobStore


class Publisher(Protocol):
    """Publishes each ``(job_id, pool)`` to its pool's broker and returns those published (the
    farm's brokers, :class:`infra.broker.shards.Brokers`)."""

    def publish(self, jobs: Iterable[tuple[str, str]], priority: str = "normal") -> list[tuple[str, str]]: ...


def _send(app: Celery, producer: Producer, job_id: str, pool: str, priority: int) -> None:
    app.send_task(TASK_NAME, kwargs={"job_id": job_id}, task_id=job_id, queue=keys.queue(pool),
                  routing_key=keys.queue(pool), priority=priority, producer=producer)


def publish_jobs(app: Celery, jobs: Iterable[tuple[str, str]], priority: str = "normal") -> int:
    """Publish one render message per ``(job_id, pool)`` in pipelined round trips.

    On kombu's Redis transport the messages of a pool are copies of one Celery-built message
    (:func:`infra.broker.kombu_redis.publish_by_template`); on another transport every message
    goes through ``send_task`` inside kombu's ``Producer.batch()``.

    Returns:
        the number of messages published.
    Raises:
        KeyError: an unknown ``priority``. kombu / redis errors: the broker is unreachable.
    """
    level = PRIORITY_VALUES[priority]
    by_pool: dict[str, list[str]] = defaultdict(list)
    for job_id, pool in jobs:
        by_pool[pool].append(job_id)
    with app.producer_or_acquire() as producer:
        for pool, job_ids in by_pool.items():
            def send(job_id: str, pool: str = pool) -> None:
                _send(app, producer, job_id, pool, level)

            if not publish_by_template(producer, send, job_ids):
                with producer.batch():
                    for job_id in job_ids:
                        send(job_id)
    return sum(len(ids) for ids in by_pool.values())


def republish(store: JobStore, app: Celery | Publisher, job_ids: Iterable[str], priority: str | None = None) -> int:
    """Publish a fresh message for each job that is still ``queued``, at ``priority`` (default:
    its batch's), and note the time in ``rf:pending``. ``app``: one Celery app for every job, or
    the farm's brokers (:class:`infra.broker.shards.Brokers`: each job to its pool's broker; the
    jobs of a broker that cannot be reached stay pending, and the reaper republishes them once
    ``republish_after_s`` has passed). Returns the number of messages published.

    Raises:
        kombu / redis errors: with one Celery app, its broker is unreachable.
    """
    by_priority: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for job_id, state, pool, job_priority in store.routes(list(job_ids)):
        if state == "queued":
            by_priority[priority or job_priority].append((job_id, pool))
    n = 0
    for level, jobs in by_priority.items():
        if isinstance(app, Celery):
            publish_jobs(app, jobs, priority=level)
        else:  # a shard that is down keeps its jobs pending: the reaper publishes them again later
            jobs = app.publish(jobs, priority=level)
        store.mark_published([job_id for job_id, _ in jobs])
        n += len(jobs)
    return n
