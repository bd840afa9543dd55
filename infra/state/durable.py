"""Durable acknowledgement: before the API answers 202, the jobs it recorded are on disk (or on
a replica), so a ``kill -9`` of redis-server, a node loss or a failover cannot take them back.

Place in the data flow: submission (:mod:`infra.submission.submitter`) records a batch and its wait-lane
entries, then calls :meth:`DurableAck.wait` before it answers. Modes (``RENDERFARM_DURABLE_ACK``):

``off``       answer at once (Redis's own ``appendfsync`` policy decides what a crash loses).
``local``     the primary's AOF holds the writes, fsynced.
``replicas``  that, and at least one replica has them (``WAIT``) and, on Redis ≥ 7.2, fsynced them.

On Redis ≥ 7.2 this is ``WAITAOF numlocal numreplicas timeout`` (Redis docs, "WAITAOF"). WAITAOF
waits for the writes of the connection that sends it, and a connection pool may send the batch
on another connection, so the wait first writes one marker (``INCR rf:ack``) on the waiting
connection: the AOF is sequential, so once that write is fsynced, every write before it is too.

Before 7.2 there is no command that waits for an fsync. The fallback (``local``): with
``appendfsync always`` nothing is needed (Redis fsyncs before it replies); with ``everysec`` it
waits ``fallback_s`` (default 2 s: everysec fsyncs each second and postpones an fsync by at most
two seconds, per redis.conf's ``appendfsync`` notes), which is a bound on time, not a proof; with
AOF off the data can only be as durable as RDB snapshots, and a warning is logged once.
``replicas`` before 7.2 uses ``WAIT 1 timeout`` (acknowledged by a replica, not fsynced there).
"""

from __future__ import annotations

import logging
import time

import redis

from infra import keys

log = logging.getLogger(__name__)

MODES = ("off", "local", "replicas")


class NotDurable(Exception):
    """The writes were not confirmed durable within the timeout (the API answers 503: the jobs
    exist, and the client's retry with the same idempotency key gets the same batch)."""


def redis_version(client: redis.Redis) -> tuple[int, ...]:
    """The server's ``redis_version`` (INFO server) as a tuple of ints, e.g. ``(7, 0, 15)``."""
    version = str(client.info("server").get("redis_version", "0"))
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def run_id(client: redis.Redis) -> str:
    """The server's ``run_id`` (INFO server): 40 hex characters, new at every start of redis-server.
    The job-state scripts store it with each attempt as its epoch (:mod:`infra.state.scripts`)."""
    return str(client.info("server")["run_id"])


class DurableAck:
    """Waits until the writes made so far are durable, as ``mode`` says.

    Args:
        client: the Redis the writes went to.
        mode: ``off``, ``local`` or ``replicas``.
        timeout_ms: most milliseconds one wait may take (WAITAOF / WAIT timeout).
        fallback_s: seconds the pre-7.2 ``local`` fallback waits under ``appendfsync everysec``.
    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, client: redis.Redis, mode: str = "off", *, timeout_ms: int = 5000, fallback_s: float = 2.0):
        if mode not in MODES:
            raise ValueError(f"durable ack mode must be one of {MODES}, not {mode!r}")
        self.r = client
        self.mode = mode
        self.timeout_ms = timeout_ms
        self.fallback_s = fallback_s
        self._version: tuple[int, ...] | None = None
        self._warned = False

    def has_waitaof(self) -> bool:
        """Whether the server has ``WAITAOF`` (Redis ≥ 7.2); read once from INFO server."""
        if self._version is None:
            self._version = redis_version(self.r)
        return self._version >= (7, 2)

    def wait(self) -> str:
        """Block until the writes made before this call are durable; returns how it was confirmed
        (``off``, ``waitaof``, ``wait``, ``always``, ``everysec-sleep``, ``no-aof``).

        Raises:
            NotDurable: WAITAOF/WAIT did not confirm within ``timeout_ms``.
        """
        if self.mode == "off":
            return "off"
        replicas = 1 if self.mode == "replicas" else 0
        pipe = self.r.pipeline(transaction=False)  # one connection: the marker, then the wait
        pipe.incr(keys.DURABLE_ACK)
        if self.has_waitaof():
            pipe.execute_command("WAITAOF", 1, replicas, self.timeout_ms)
            _, (local, remote) = pipe.execute()
            if int(local) < 1 or int(remote) < replicas:
                raise NotDurable(f"WAITAOF confirmed {local} local and {remote} replica fsyncs in {self.timeout_ms} ms")
            return "waitaof"
        if replicas:
            pipe.execute_command("WAIT", 1, self.timeout_ms)
            _, acked = pipe.execute()
            if int(acked) < 1:
                raise NotDurable(f"no replica acknowledged the writes in {self.timeout_ms} ms")
            return "wait"
        pipe.execute()
        persistence = self.r.info("persistence")
        if not int(persistence.get("aof_enabled", 0)):
            self._warn("redis-server has appendonly no: a crash loses writes since its last RDB snapshot")
            return "no-aof"
        try:
            policy = self.r.config_get("appendfsync").get("appendfsync", "everysec")
        except redis.ResponseError:  # CONFIG disabled (managed Redis): assume the default
            policy = "everysec"
        if policy == "always":
            return "always"
        if policy == "no":
            self._warn("redis-server has appendfsync no: the OS decides when writes reach the disk")
        time.sleep(self.fallback_s)
        return "everysec-sleep"

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("durable ack %s: %s", self.mode, message)
