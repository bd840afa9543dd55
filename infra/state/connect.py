"""Connections to the farm's Redis: one Redis, a Sentinel-managed primary, or a Redis Cluster.

Place in the data flow: beside it. The API, the workers, the reaper and the tools open the
state store here (``RENDERFARM_STATE_REDIS_URL``, else ``RENDERFARM_REDIS_URL``) and the
broker's Redis too (:func:`redis_client`); the Celery app takes its broker URL and transport
options from :func:`celery_broker`. The broker must be one Redis or a Sentinel group, never a
Cluster: kombu's Redis transport moves messages between keys of different queues in one command
(``BRPOP`` over several lists, ``unacked`` with its index in one MULTI), which Redis Cluster
refuses across slots.

URL forms:

``redis://``, ``rediss://``, ``unix://``
    one Redis (redis-py's own URL syntax).
``sentinel://[[user]:password@]host:26379[,host2:26379…]/master_name[/db][?sentinel_password=…]``
    the primary of the Sentinel group ``master_name`` (``sentinels://``: TLS to the sentinels and
    the primary). redis-py's :class:`redis.sentinel.Sentinel` asks the sentinels which server is
    the primary, and a connection that finds a replica where the primary was (``READONLY``) or
    none at all asks again, so every process follows a failover by itself (Redis docs, "High
    availability with Redis Sentinel"; redis-py, "Sentinel support"). The user and password are
    the data servers'; ``sentinel_password`` the sentinels' own when they require one.
``redis+cluster://host:port`` (``rediss+cluster://``)
    one node of a Redis Cluster; redis-py's :class:`redis.cluster.RedisCluster` discovers the
    others (``CLUSTER SLOTS``) and routes each command to its slot's node. What the farm needs
    from it: every Lua script's keys in one slot and every MULTI/EXEC in one slot (the hash tags
    of :mod:`infra.keys`); non-transactional pipelines may span slots.

The job-state scripts' fencing (:mod:`infra.state.lua`) needs nothing more across a failover: an
attempt's epoch is stored in the job's hash and replicated with it, so a worker's token still
matches on the promoted replica, and an attempt the replica never received is refused there.
redis-py's :class:`redis.commands.core.Script` loads a script again when the new primary answers
``NOSCRIPT``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, NamedTuple, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

#: URL schemes of a Redis Cluster node, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: URL schemes of a Sentinel group, and whether each uses TLS.
SENTINEL_SCHEMES = {"sentinel": False, "sentinels": True}
#: Sentinel's default port (Redis docs, "High availability with Redis Sentinel").
SENTINEL_PORT = 26379


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster node (``redis+cluster://`` or ``rediss+cluster://``)."""
    return _scheme(url) in CLUSTER_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel group (``sentinel://`` or ``sentinels://``)."""
    return _scheme(url) in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelGroup:
    """A Sentinel-managed primary, as a ``sentinel://`` URL names it.

    Attributes:
        sentinels: the sentinels' (host, port) pairs, in the URL's order.
        master_name: the group's name in the sentinels' configuration (``sentinel monitor NAME …``).
        db: the database number on the primary.
        username: the data servers' ACL user (None: ``default``).
        password: the data servers' password (None: no AUTH).
        sentinel_password: the sentinels' own password (None: no AUTH to the sentinels).
        tls: TLS to the sentinels and to the primary (``sentinels://``).
    """

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> "SentinelGroup":
        """Parse ``sentinel://[[user]:password@]host[:port][,host[:port]…]/master_name[/db][?sentinel_password=…]``.

        Raises:
            ValueError: not a Sentinel URL, no sentinel, a port or database that is not a number,
                no master name, or an unknown query parameter.
        """
        scheme = _scheme(url)
        if scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"not a Sentinel URL (sentinel:// or sentinels://): {url!r}")
        # urlsplit reads one host; the sentinels' list is split here
        parts = urlsplit("redis://" + url.split("://", 1)[1])
        auth, _, hosts = parts.netloc.rpartition("@")
        user, _, password = auth.partition(":") if auth else ("", "", "")
        sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h)
        if not sentinels:
            raise ValueError(f"a Sentinel URL names at least one sentinel host: {url!r}")
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2:
            raise ValueError(f"a Sentinel URL's path is /master_name or /master_name/db: {url!r}")
        if len(path) == 2 and not path[1].isdigit():
            raise ValueError(f"the database in a Sentinel URL is a number, not {path[1]!r}")
        query = parse_qs(parts.query)
        unknown = set(query) - {"sentinel_password"}
        if unknown:
            raise ValueError(f"unknown Sentinel URL parameter(s) {sorted(unknown)}; known: sentinel_password")
        return cls(sentinels=sentinels, master_name=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
                   username=unquote(user) or None, password=unquote(password) or None,
                   sentinel_password=query.get("sentinel_password", [None])[0], tls=SENTINEL_SCHEMES[scheme])

    def sentinel_options(self) -> dict[str, Any]:
        """The options of a connection to a sentinel (not to the primary): TLS and the sentinels'
        own password, each only when the URL asks for it (redis-py's and kombu's ``sentinel_kwargs``)."""
        options: dict[str, Any] = {"ssl": True} if self.tls else {}
        if self.sentinel_password:
            options["password"] = self.sentinel_password
        return options

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A redis-py :class:`Sentinel` over this group's sentinels; ``kwargs`` (timeouts,
        ``decode_responses``) go to the connections to the primary."""
        sentinel_kwargs = self.sentinel_options()
        for timeout in ("socket_timeout", "socket_connect_timeout"):
            if timeout in kwargs:
                sentinel_kwargs[timeout] = kwargs[timeout]
        return Sentinel(list(self.sentinels), sentinel_kwargs=sentinel_kwargs, **kwargs)

    def primary(self, **kwargs: Any) -> redis.Redis:
        """A client of the group's current primary that follows failovers (``kwargs`` as
        :meth:`sentinel`)."""
        kwargs = {**kwargs, "db": self.db}
        if self.tls:
            kwargs["ssl"] = True
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        return self.sentinel(**kwargs).master_for(self.master_name, redis_class=redis.Redis)

    def kombu_url(self) -> str:
        """kombu's form of this group: ``sentinel://[user:password@]host:port/db`` per sentinel,
        joined by ``;`` (the master name goes in the transport options, :func:`celery_broker`)."""
        auth = ""
        if self.password:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        return ";".join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text.strip("[]") else (text, "", "")
    if port and not port.isdigit():
        raise ValueError(f"a sentinel's port is a number, not {port!r}: {url!r}")
    return host.strip("[]") or text, int(port) if port else SENTINEL_PORT


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client of the Redis at ``url`` with ``decode_responses=True`` (and ``kwargs``):
    :class:`redis.Redis` for ``redis://``, ``rediss://`` or ``unix://``; the Sentinel group's
    primary for ``sentinel://`` (following failovers); :class:`RedisCluster` for
    ``redis+cluster://host:port`` (typed as ``redis.Redis``: the farm uses only the commands
    both offer).

    Raises:
        ValueError: a malformed Sentinel URL, or a cluster URL that names a database other than 0
            (Redis Cluster has one).
    """
    kwargs.setdefault("decode_responses", True)
    scheme = _scheme(url)
    if scheme in SENTINEL_SCHEMES:
        return SentinelGroup.parse(url).primary(**kwargs)
    plain = CLUSTER_SCHEMES.get(scheme)
    if plain is None:
        return redis.Redis.from_url(url, **kwargs)
    rest = url.split("://", 1)[1]
    path = rest.split("?", 1)[0].partition("/")[2]
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0; {url!r} names database {path!r}")
    return cast(redis.Redis, RedisCluster.from_url(f"{plain}://{rest}", **kwargs))


#: The job-state store's client (:func:`redis_client`; the name the state store's callers use).
state_client = redis_client


class CeleryBroker(NamedTuple):
    """What a Celery app needs to reach the farm's broker (:func:`celery_broker`)."""

    url: str
    #: broker transport options to add to the farm's own (``master_name``, ``sentinel_kwargs``)
    transport_options: dict[str, Any]
    #: Celery's ``broker_use_ssl`` (None: as the URL says)
    use_ssl: dict[str, Any] | None = None


def celery_broker(url: str) -> CeleryBroker:
    """The Celery broker for the farm's Redis at ``url``: the URL itself for one Redis; for a
    Sentinel group kombu's ``sentinel://…;sentinel://…`` form with ``master_name`` (and
    ``sentinel_kwargs``) in the transport options and, for ``sentinels://``, TLS with the
    certificate required (kombu, "Redis transport: Sentinel").

    Raises:
        ValueError: a Redis Cluster URL (kombu's Redis transport cannot use one), or a malformed
            Sentinel URL.
    """
    if is_cluster_url(url):
        raise ValueError(f"the Celery broker cannot be a Redis Cluster ({url!r}): name one Redis or a Sentinel group")
    if not is_sentinel_url(url):
        return CeleryBroker(url, {})
    group = SentinelGroup.parse(url)
    options: dict[str, Any] = {"master_name": group.master_name}
    if sentinel_kwargs := group.sentinel_options():
        options["sentinel_kwargs"] = sentinel_kwargs
    return CeleryBroker(group.kombu_url(), options, {"ssl_cert_reqs": ssl.CERT_REQUIRED} if group.tls else None)
