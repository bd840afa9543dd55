"""Connections to the job-state store: one Redis, or a Redis Cluster.

Place in the data flow: beside it. The API, the workers, the reaper and the tools open the
state store here (``RENDERFARM_STATE_REDIS_URL``, else ``RENDERFARM_REDIS_URL``); the Celery
broker always connects to ``RENDERFARM_REDIS_URL`` itself, which must be a plain Redis: kombu's
Redis transport moves messages between keys of different queues in one command (``BRPOP`` over
several lists, ``unacked`` with its index in one MULTI), which Redis Cluster refuses across slots.

A URL whose scheme is ``redis+cluster://`` (or ``rediss+cluster://``, TLS) names one node of a
Redis Cluster; redis-py's :class:`redis.cluster.RedisCluster` discovers the others from it
(``CLUSTER SLOTS``) and routes each command to its slot's node. What the farm needs from it: every
Lua script's keys in one slot and every MULTI/EXEC in one slot (the hash tags of
:mod:`infra.keys`); non-transactional pipelines may span slots (redis-py sends one per node).
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.cluster import RedisCluster

#: URL schemes of a Redis Cluster node, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster node (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def state_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client of the state store at ``url`` with ``decode_responses=True`` (and ``kwargs``):
    :class:`redis.Redis` for ``redis://``, ``rediss://`` or ``unix://``; :class:`RedisCluster`
    for ``redis+cluster://host:port`` (typed as ``redis.Redis``: the farm uses only the commands
    both offer).

    Raises:
        ValueError: a cluster URL that names a database other than 0 (Redis Cluster has one).
    """
    kwargs.setdefault("decode_responses", True)
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if plain is None:
        return redis.Redis.from_url(url, **kwargs)
    path = rest.split("?", 1)[0].partition("/")[2]
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0; {url!r} names database {path!r}")
    return cast(redis.Redis, RedisCluster.from_url(f"{plain}://{rest}", **kwargs))
