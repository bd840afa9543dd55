"""Broker shards: the farm's Celery queues spread over several Redis servers, one per pool.

Place in the data flow: the dispatcher, the reaper, the API's queue depths and the dead-letter
route ask :class:`Brokers` for the broker of a pool → **here** → that broker's Celery app (to
publish) and Redis client (its queue lists and kombu's ``unacked`` hash). A worker consumes from
its own pool's broker only (``Settings.pool_broker_url``).

Why shards: Celery's Redis transport cannot use a Redis Cluster (kombu moves messages between
keys of different queues in one command), so one broker Redis is the ceiling of a farm's queue
throughput; the job-state store shards on a Cluster already (:mod:`infra.state.connect`). A pool
names its shard (``PoolSpec.broker``, a name in ``RENDERFARM_BROKERS``); a pool naming none keeps
its queue on ``RENDERFARM_REDIS_URL``. A pool's queue lives on exactly one broker, so the
messages of one pool never need to move between Redis servers, and every broker-side structure
(priority lists, ``unacked``) is per shard as kombu keeps it. Job state, wait lanes, leases and
the worker registry stay in the one state store.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import kombu.exceptions
import redis
from celery import Celery

from infra.broker.app import make_celery
from infra.broker.publish import publish_jobs
from infra.settings import Settings
from infra.state.connect import redis_client

__all__ = ["BROKER_ERRORS", "Broker", "Brokers"]
log = logging.getLogger("renderfarm.brokers")
#: What a broker that cannot be reached raises: through redis-py, kombu, or the socket itself. A
#: shard that is down stops its own pools only: the callers catch these per broker.
BROKER_ERRORS = (redis.RedisError, kombu.exceptions.OperationalError, OSError)


@dataclass(frozen=True)
class Broker:
    """One broker Redis: its shard ``name`` (None: the default broker), the Celery ``app``
    publishing to it and a ``client`` of its Redis (``decode_responses=True``)."""

    name: str | None
    app: Celery
    client: redis.Redis


class Brokers:
    """The farm's brokers, and which pool's queue lives on which.

    Args:
        default: the broker of every pool that names no shard.
        shards: shard name → its broker. pool_shards: pool name → shard name (pools naming one).
    Raises:
        KeyError: a pool naming a shard not in ``shards``.
    """

    def __init__(self, default: Broker, shards: dict[str, Broker] | None = None,
                 pool_shards: dict[str, str] | None = None) -> None:
        self.default = default
        self.shards = dict(shards or {})
        self.pool_shards = dict(pool_shards or {})
        for pool, shard in self.pool_shards.items():
            if shard not in self.shards:
                raise KeyError(f"pool {pool!r} names broker shard {shard!r}, which is not declared")

    @classmethod
    def single(cls, app: Celery, client: redis.Redis) -> "Brokers":
        """One broker for every pool (no shard declared)."""
        return cls(Broker(None, app, client))

    @classmethod
    def from_settings(cls, settings: Settings, app: Celery | None = None,
                      client: redis.Redis | None = None) -> "Brokers":
        """The brokers of ``settings``: the default (``redis_url``; ``app`` and ``client`` when the
        caller holds them already) and each shard of ``brokers`` that a declared pool names.

        Raises:
            ValueError: a broker URL kombu cannot use (from :func:`make_celery`).
        """
        default = Broker(None, app or make_celery(settings), client or redis_client(settings.redis_url))
        pool_shards = {p.name: p.broker for p in settings.pools if p.broker is not None}
        shards = {name: Broker(name, make_celery(settings, url), redis_client(url))
                  for name, url in settings.brokers.items() if name in pool_shards.values()}
        return cls(default, shards, pool_shards)

    def for_pool(self, pool: str) -> Broker:
        """The broker holding ``pool``'s queue."""
        shard = self.pool_shards.get(pool)
        return self.default if shard is None else self.shards[shard]

    def all(self) -> list[Broker]:
        """Every broker: the default first, then the shards in declaration order."""
        return [self.default, *self.shards.values()]

    def clients(self) -> list[redis.Redis]:
        """A Redis client of every broker (:meth:`all`'s order)."""
        return [broker.client for broker in self.all()]

    def publish(self, jobs: Iterable[tuple[str, str]], priority: str = "normal") -> list[tuple[str, str]]:
        """Publish one render message per ``(job_id, pool)`` to each pool's broker
        (:func:`infra.broker.publish.publish_jobs`, once per broker). A broker that cannot be
        reached (:data:`BROKER_ERRORS`) is logged and its jobs left out, so that the other brokers'
        pools go on. Returns the ``(job_id, pool)`` published.

        Raises:
            KeyError: an unknown ``priority``.
        """
        by_broker: dict[str | None, list[tuple[str, str]]] = defaultdict(list)
        for job_id, pool in jobs:
            by_broker[self.pool_shards.get(pool)].append((job_id, pool))
        published: list[tuple[str, str]] = []
        for shard, routed in by_broker.items():
            try:
                publish_jobs(self.for_pool(routed[0][1]).app, routed, priority=priority)
            except BROKER_ERRORS as exc:
                log.warning("broker %s unreachable, %d message(s) not published: %s", shard or "(default)",
                            len(routed), exc)
                continue
            published += routed
        return published

    def close(self) -> None:
        """Close every broker's Celery app and Redis connections."""
        for broker in self.all():
            broker.app.close()
            broker.client.close()
