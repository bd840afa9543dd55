"""The local stack's supervisor events in its Redis, for the status API and the dashboard.

Place in the data flow: beside it. ``renderfarm up`` (:mod:`infra.localstack.cli`) hands every
:class:`~infra.localstack.supervisor.ServiceEvent` to :class:`StackEvents`, which appends it to
the stream :data:`infra.keys.STACK_EVENTS` (the newest :data:`KEEP`) and keeps the hash
:data:`infra.keys.STACK_DOWN` (service → its exit, while it is down). ``/healthz``
(:mod:`infra.api.routes.health`) answers ``degraded`` while that hash is not empty and lists the
newest events; the dashboard shows them. When the event is about Redis itself, or Redis does not
answer, the events wait in memory and are written once it answers again.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Protocol

from infra import keys


class ServiceEvent(Protocol):
    """What :class:`StackEvents` writes of an event (:class:`infra.localstack.supervisor.ServiceEvent`)."""

    @property
    def service(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def down_s(self) -> float | None: ...


#: Events kept in the stream (``XADD … MAXLEN ~``).
KEEP = 200


class StackEvents:
    """Writes supervisor events to the stack's Redis, keeping those Redis could not take yet.

    Args:
        redis_url: the stack's Redis (its job-state store, which the API reads).
        pending_max: events kept in memory while Redis does not answer (the oldest are dropped).
    """

    def __init__(self, redis_url: str, *, pending_max: int = 1000):
        from infra.state.connect import redis_client

        self._redis = redis_client(redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
        self._pending: deque[ServiceEvent] = deque(maxlen=pending_max)

    def reset(self) -> None:
        """Forget the outages of an earlier stack on the same data (its services are not down now).

        Raises:
            redis.RedisError: Redis does not answer.
        """
        self._redis.delete(keys.STACK_DOWN)

    def record(self, event: ServiceEvent) -> None:
        """Queue ``event`` and write every queued event that Redis takes now (never raises)."""
        self._pending.append(event)
        self.flush()

    def flush(self) -> int:
        """Write the queued events in order; returns how many are still waiting (Redis down)."""
        import redis

        while self._pending:
            event = self._pending[0]
            try:
                self._write(event)
            except (redis.RedisError, OSError):
                break
            self._pending.popleft()
        return len(self._pending)

    def _write(self, event: ServiceEvent) -> None:
        fields: dict[Any, Any] = {"service": event.service, "kind": event.kind, "at": f"{event.at:.3f}",
                                  "message": event.message}
        if event.down_s is not None:
            fields["down_s"] = f"{event.down_s:.1f}"
        pipe = self._redis.pipeline(transaction=True)
        pipe.xadd(keys.STACK_EVENTS, fields, maxlen=KEEP, approximate=True)
        if event.kind == "exited":
            pipe.hset(keys.STACK_DOWN, event.service, json.dumps({"at": event.at, "message": event.message}))
        elif event.kind == "ready":
            pipe.hdel(keys.STACK_DOWN, event.service)
        pipe.execute()

    def close(self) -> None:
        """Close the connection."""
        self._redis.close()


def read_down(client: Any) -> dict[str, str]:
    """Services of a ``renderfarm up`` that are down now: name → the line of their exit
    (empty when none, or when no local stack writes here).

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True`` on the stack's Redis.
    """
    return {name: json.loads(value).get("message", "") for name, value in client.hgetall(keys.STACK_DOWN).items()}


def read_events(client: Any, count: int = 10) -> list[dict[str, str]]:
    """The newest ``count`` supervisor events, newest first: ``service``, ``kind``, ``at``
    (epoch seconds, as text), ``message`` and, for ``ready``, ``down_s`` (seconds, as text).

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True`` on the stack's Redis.
    """
    return [dict(fields) for _, fields in client.xrevrange(keys.STACK_EVENTS, count=count)]
