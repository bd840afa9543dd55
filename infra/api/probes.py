"""Shared, cached answers for the probes and the scrape: the S3 check of ``/healthz`` and the
``/metrics`` exposition.

Place in the data flow: beside it. Load balancers, Kubernetes and Prometheus may ask every API
replica many times a second; each expensive answer is computed by one thread at a time and
reused for a few seconds by every caller (the others wait for it instead of computing it too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

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
