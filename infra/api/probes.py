"""Shared, cached answers for the probes and the scrape: ``/healthz``'s evaluation
(:class:`Readiness`) and the ``/metrics`` exposition.

Place in the data flow: beside it. Load balancers, Kubernetes and Prometheus may ask every API
replica many times a second, unauthenticated; each expensive answer is computed by one thread at
a time and reused for a second or a few by every caller (the others wait for it instead of
computing it too), so the load on Redis and S3 does not grow with the number of probes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

T = TypeVar("T")


class Cached(Generic[T]):
    """``compute()``'s last answer, recomputed at most once per ``ttl_s`` seconds, by one thread.

    Args:
        compute: the expensive call; an exception it raises is cached as its answer too
            (re-raised to every caller until the answer is stale), so an outage is not probed
            by every request.
        ttl_s: seconds an answer stays fresh (0: recompute every time, still one at a time).
    """

    def __init__(self, compute: Callable[[], T], ttl_s: float):
        self.compute = compute
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._value: T | None = None
        self._error: BaseException | None = None

    def get(self) -> T:
        """The fresh answer (computing it when stale). Raises what ``compute`` raised."""
        with self._lock:
            if time.monotonic() - self._at >= self.ttl_s:
                try:
                    self._value, self._error = self.compute(), None
                except Exception as exc:  # cached and re-raised below
                    self._value, self._error = None, exc
                self._at = time.monotonic()
            if self._error is not None:
                raise self._error
            return self._value  # type: ignore[return-value]


#: ``/healthz``'s overall answer: Redis and S3 answer; only S3 fails or a service of ``renderfarm up``
#: is down (HTTP 200 still); Redis fails (503).
HealthStatus = Literal["ok", "degraded", "unavailable"]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


class Readiness:
    """``/healthz``'s evaluation, shared by every probe of an API process.

    One evaluation (a Redis PING, and the S3 check, itself reused for ``s3_ttl_s``) serves every
    caller for ``ttl_s`` seconds; the list of unhealthy workers (one read of each live worker's
    registry hash) is a separate answer, computed only when a caller allowed to see it asks, and
    reused for ``ttl_s`` as well. Nothing here writes to Redis.

    Args:
        ping_redis: raises when Redis does not answer (``redis.Redis.ping``).
        ping_s3: raises when the bucket cannot be reached (``Storage.ping``).
        unhealthy_workers: names of the live workers whose circuit breaker is open.
        stack_down: the services of a ``renderfarm up`` that are down now, name → why
            (:func:`infra.state.stack_events.read_down`; empty without a local stack).
        stack_events: the newest lines of that stack's supervisor, newest first.
        ttl_s: seconds one evaluation (and one worker list) is reused (``RENDERFARM_HEALTH_CACHE_S``).
        s3_ttl_s: seconds one S3 check is reused (``RENDERFARM_HEALTH_S3_CACHE_S``).
    """

    def __init__(self, ping_redis: Callable[[], object], ping_s3: Callable[[], object],
                 unhealthy_workers: Callable[[], list[str]], *, ttl_s: float, s3_ttl_s: float,
                 stack_down: Callable[[], dict[str, str]] = dict,
                 stack_events: Callable[[], list[str]] = list):
        self._ping_redis = ping_redis
        self._stack_down = stack_down
        self._s3 = Cached(ping_s3, s3_ttl_s)
        self._status: Cached[tuple[HealthStatus, dict[str, str]]] = Cached(self._evaluate, ttl_s)
        self._workers: Cached[list[str]] = Cached(unhealthy_workers, ttl_s)
        self._events: Cached[list[str]] = Cached(stack_events, ttl_s)

    def _evaluate(self) -> tuple[HealthStatus, dict[str, str]]:
        checks = {}
        down: dict[str, str] = {}
        try:
            self._ping_redis()
            checks["redis"] = "ok"
            # the stack's own record before the S3 check: one Redis read, true at this instant
            # rather than after an S3 check that may take its whole timeout
            try:
                down = self._stack_down()
            except Exception as exc:  # part of the answer, like a failing check
                down = {"stack": _error(exc)}
        except Exception as exc:  # a failing check is part of the answer
            checks["redis"] = _error(exc)
        try:
            self._s3.get()
            checks["s3"] = "ok"
        except Exception as exc:
            checks["s3"] = _error(exc)
        status: HealthStatus
        if checks["redis"] != "ok":
            return "unavailable", checks
        if down:
            checks["stack"] = "; ".join(f"{name}: {why}" for name, why in sorted(down.items()))[:300]
        status = "ok" if checks["s3"] == "ok" and not down else "degraded"
        return status, checks

    def status(self) -> tuple[HealthStatus, dict[str, str]]:
        """``(status, checks)``: the overall answer and, per check (``redis``, ``s3``), ``ok`` or
        the error's type and message (at most 300 characters). Never raises."""
        status, checks = self._status.get()
        return status, dict(checks)

    def stack_events(self) -> list[str] | None:
        """The newest lines of a ``renderfarm up``'s supervisor, newest first (empty: none);
        None when they cannot be read (Redis down)."""
        try:
            return list(self._events.get())
        except Exception:  # Redis down: the status already says so
            return None

    def unhealthy_workers(self) -> list[str] | None:
        """Names of the live workers whose circuit breaker is open (empty: none); None when the
        registry cannot be read (Redis down)."""
        try:
            return list(self._workers.get())
        except Exception:  # Redis down: the status already says so
            return None
