"""Webhooks on batch completion: a signed JSON POST to the batch's ``webhook_url``, retried with
backoff, sent once per batch however many API replicas run.

Data flow: producer → ``POST /v1/batches`` with ``webhook_url`` → submission stores the URL on
the batch and **enrolls** the batch in ``rf:webhooks:pending``
(:func:`infra.submission.submitter.enroll_webhook`) → workers, the reaper and cancels move its
jobs, and the store's per-state counters with them → the **dispatcher here** (a background
thread of every API process, like the reaper) sees ``queued = running = 0`` → checks the URL
against the SSRF policy again (:mod:`infra.submission.url_policy`; the name may resolve
elsewhere by now) → POSTs to the address that check returned, signed with the batch's tenant's
own secret the Standard Webhooks way (:mod:`infra.api.webhooks.signing`) → the receiver checks
it with any Standard Webhooks library.

Why a pending set rather than an event pushed by the store's Lua: every way a job ends (worker,
reaper, cancel, dead-letter retry) already moves the batch's counters, so reading them covers all
of them without touching the transition scripts; a batch stays in the set until its webhook is
delivered or given up, so an API that dies mid-delivery loses nothing. The cost is one pipelined
read per due batch per poll (``webhook_poll_s``).

Delivery: body ``{"event": "batch.finished", "batch_id", "total", "counts", "created_at",
"finished_at"}`` (``finished_at``: when the farm saw the batch end, ISO 8601 UTC; the body is
fixed on first sight and identical on every attempt). Headers:
    webhook-id               the batch id (receivers deduplicate on it)
    webhook-timestamp        epoch seconds of this attempt
    webhook-signature        ``v1,`` + base64 HMAC-SHA256 of ``<id>.<timestamp>.<body>`` under
                             the tenant's secret (Standard Webhooks)
    X-Renderfarm-Delivery    the batch id again (as before)
    X-Renderfarm-Attempt     1, 2, …
A 2xx answer delivers it. Anything else (another status, a redirect, which is never followed, a
timeout, a refused connection) is retried after ``webhook_backoff_s × 2^(attempt-1)`` seconds
(capped at 300 s) up to ``webhook_max_attempts`` attempts; a URL the policy now refuses fails
at once. The outcome stays in ``rf:webhook:{batch}``.

Fair across tenants: a batch seen unfinished is looked at again only after ``recheck_s``, so
a tenant's many unfinished batches never fill the window of due batches; ended batches are
started round-robin by tenant, and one tenant holds at most ``per_tenant`` of the
``concurrency`` delivery slots, so one tenant's slow receivers cannot hold up the others.

Once per batch: an attempt is made only under ``rf:webhook:{batch}:lock`` (SET NX PX, longer than
the request timeout) and only while the outcome is not yet recorded, so two replicas never both
send it. If a replica dies after the receiver got the POST but before recording the outcome,
another replica sends it again after the lock expires: receivers should deduplicate on
``X-Renderfarm-Delivery``. A batch whose jobs go back to work (dead-letter retry) after its
webhook was sent is not announced again.

Redis keys:
    rf:webhooks:pending        sorted set: batch id → when to look at it next (epoch seconds)
    rf:webhook:{batch}         hash: body, attempts, status (delivered|failed), last_error,
                               response_status, delivered_at (expires with the job records)
    rf:webhook:{batch}:lock    the delivery claim
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis

from infra import keys
from infra.api.webhooks.signing import sign_headers, tenant_secret, verify_signature  # noqa: F401 (receivers)
from infra.background import PeriodicLoop, RedisLock, server_time
from infra.settings import Settings
from infra.state.job_store import PUBLIC_TENANT
from infra.submission.url_policy import IPAddress, WebhookRefused, check_webhook_url

log = logging.getLogger("renderfarm.webhooks")

EVENT = "batch.finished"
DELIVERY_HEADER = "X-Renderfarm-Delivery"
ATTEMPT_HEADER = "X-Renderfarm-Attempt"
#: Longest wait between two attempts, seconds.
MAX_BACKOFF_S = 300.0
_NOT_ENDED = ("queued", "running")

def _round_robin(groups: Mapping[str, list[str]]) -> list[tuple[str, str]]:
    """``(group, item)`` taking one item of each group in turn: a, b, c, a, b, a, …"""
    out, queues = [], {g: list(items) for g, items in groups.items()}
    while queues:
        for group in list(queues):
            out.append((group, queues[group].pop(0)))
            if not queues[group]:
                del queues[group]
    return out


def _iso(epoch: float | str | None) -> str | None:
    if epoch in (None, "", "0"):
        return None
    return datetime.fromtimestamp(float(epoch), tz=timezone.utc).isoformat()


def build_body(batch_id: str, meta: Mapping[str, str], counts: Mapping[str, str], finished_at: float) -> bytes:
    """The JSON body announcing that ``batch_id`` ended (compact, keys in a fixed order)."""
    states = ("queued", "running", "succeeded", "failed", "canceled")
    body = {
        "event": EVENT,
        "batch_id": batch_id,
        "total": int(meta.get("total", 0)),
        "counts": {s: int(counts.get(s, 0) or 0) for s in states},
        "created_at": _iso(meta.get("created_at")),
        "finished_at": _iso(finished_at),
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ---- one delivery attempt -----------------------------------------------------------------
def _pinned(url: str, ip: IPAddress) -> tuple[str, dict[str, str], dict]:
    """The URL with its host replaced by the checked address, the Host header, and the TLS
    server name, so that the connection goes where the SSRF check looked (no third DNS answer)."""
    parts = urlsplit(url)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = f"{host}:{parts.port}" if parts.port else host
    # the URL passed check_webhook_url, which resolved its host
    host_header = cast(str, parts.hostname) if parts.port is None else f"{parts.hostname}:{parts.port}"
    if ip.version == 6 and parts.hostname and ":" in parts.hostname:
        host_header = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
    extensions = {"sni_hostname": parts.hostname} if parts.scheme.lower() == "https" else {}
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), {"Host": host_header}, extensions


def post_once(url: str, body: bytes, headers: Mapping[str, str], *, allow_private: bool, timeout_s: float,
              http: httpx.Client, resolver: Callable[..., list] | None = None) -> int:
    """Check ``url`` against the SSRF policy and POST ``body`` to the first address it allows.

    Returns the HTTP status. Raises :class:`~infra.submission.url_policy.WebhookRefused` (permanent)
    or ``httpx.HTTPError`` (connection, timeout: worth retrying).
    """
    kwargs: dict[str, Any] = {} if resolver is None else {"resolver": resolver}
    addresses = check_webhook_url(url, allow_private=allow_private, **kwargs)
    pinned, host_header, extensions = _pinned(url, addresses[0])
    parts = urlsplit(url)
    auth = (parts.username or "", parts.password or "") if parts.username else None
    response = http.post(pinned, content=body, headers={**headers, **host_header}, extensions=extensions,
                         timeout=timeout_s, auth=auth if auth is not None else httpx.Auth(),
                         follow_redirects=False)  # httpx.Auth(): none (the pinned URL has no userinfo)
    return response.status_code


class WebhookDispatcher:
    """Watches enrolled batches and delivers each one's webhook once it ends.

    Args:
        client: Redis with ``decode_responses=True`` (the job-state store's).
        allow_private: the SSRF policy's ``allow_private`` (``webhook_allow_private``).
        max_attempts: attempts per batch before it is given up.
        backoff_s: wait before the second attempt, seconds; doubles each time, capped at 300 s.
        timeout_s: per-request timeout, seconds.
        poll_s: seconds between two looks at the pending set.
        concurrency: deliveries in flight at once (a slow receiver does not hold up the others).
        per_tenant: deliveries of one tenant in flight at once (default: half of ``concurrency``).
        recheck_s: seconds before a batch seen unfinished is looked at again (default ``2 × poll_s``).
        ttl_s: how long the outcome record is kept, seconds.
    """

    def __init__(self, client: redis.Redis, *, allow_private: bool = False, max_attempts: int = 5,
                 backoff_s: float = 2.0, timeout_s: float = 10.0, poll_s: float = 1.0, concurrency: int = 4,
                 per_tenant: int | None = None, recheck_s: float | None = None,
                 ttl_s: int = 7 * 24 * 3600, batch_limit: int = 1000):
        self.r = client
        self.per_tenant = max(1, concurrency // 2) if per_tenant is None else per_tenant
        self.recheck_s = 2 * poll_s if recheck_s is None else recheck_s
        self.allow_private = allow_private
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.ttl_s = ttl_s
        self.batch_limit = batch_limit
        self.http = httpx.Client(headers={"User-Agent": "renderfarm-webhooks/1"}, trust_env=False)
        self._locks = RedisLock(client)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="renderfarm-webhook")
        self._inflight: dict[str, str] = {}  # batch id → tenant
        self._inflight_lock = threading.Lock()
        self.loop = PeriodicLoop("renderfarm-webhooks", self.poll, poll_s, log)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> "WebhookDispatcher":
        """A dispatcher configured by the ``webhook_*`` settings."""
        return cls(client, allow_private=settings.webhook_allow_private,
                   max_attempts=settings.webhook_max_attempts, backoff_s=settings.webhook_backoff_s,
                   timeout_s=settings.webhook_timeout_s, poll_s=settings.webhook_poll_s, ttl_s=settings.job_ttl_s)

    def _now(self) -> float:
        return server_time(self.r)

    # ---- one poll -------------------------------------------------------------------------
    def poll(self, wait: bool = False) -> list[str]:
        """Look at every due enrolled batch once; start a delivery for each that has ended.

        Returns the ids of batches whose delivery was started. With ``wait``, blocks until those
        deliveries are done (tests). Raises ``redis.RedisError`` when Redis is away.
        """
        now = self._now()
        due = self.r.zrangebyscore(keys.WEBHOOKS_PENDING, "-inf", now, start=0, num=self.batch_limit)
        if not due:
            return []
        pipe = self.r.pipeline(transaction=False)
        for batch_id in due:
            pipe.hmget(keys.batch(batch_id), "webhook_url", "total", "tenant")
            pipe.hmget(keys.batch_counts(batch_id), *_NOT_ENDED)
        answers = pipe.execute()
        ended: dict[str, list[str]] = {}  # tenant → its ended batches, oldest first
        later = {}
        for i, batch_id in enumerate(due):
            (url, total, tenant), not_ended = answers[2 * i], answers[2 * i + 1]
            if total is None or not url:  # the batch record expired, or it has no webhook
                self.r.zrem(keys.WEBHOOKS_PENDING, batch_id)
            elif any(int(n or 0) for n in not_ended):
                later[batch_id] = now + self.recheck_s  # out of the window until then
            else:
                ended.setdefault(tenant or PUBLIC_TENANT, []).append(batch_id)
        if later:
            self.r.zadd(keys.WEBHOOKS_PENDING, later, xx=True)
        started, futures = [], []
        for tenant, batch_id in _round_robin(ended):
            with self._inflight_lock:
                if batch_id in self._inflight or sum(t == tenant for t in self._inflight.values()) >= self.per_tenant:
                    continue
                self._inflight[batch_id] = tenant
            started.append(batch_id)
            futures.append(self._pool.submit(self._deliver_guarded, batch_id))
        if wait:
            for future in futures:
                future.result()
        return started

    def _deliver_guarded(self, batch_id: str) -> None:
        try:
            self.deliver(batch_id)
        except Exception as exc:  # Redis away mid-delivery: the batch stays pending, tried next poll
            log.warning("webhook of batch %s: %s: %s", batch_id, type(exc).__name__, exc)
        finally:
            with self._inflight_lock:
                self._inflight.pop(batch_id, None)

    def deliver(self, batch_id: str) -> str | None:
        """Make one delivery attempt for an ended batch, under its claim.

        Returns ``"delivered"``, ``"retry"`` (rescheduled), ``"failed"`` (given up), or None when
        another replica holds the claim or the outcome was already recorded.
        """
        with self._locks.hold(keys.webhook_lock(batch_id), int((self.timeout_s * 3 + 30) * 1000)) as held:
            return self._attempt(batch_id) if held else None

    def _attempt(self, batch_id: str) -> str | None:
        skey = keys.webhook(batch_id)
        state = self.r.hgetall(skey)
        if state.get("status") in ("delivered", "failed"):
            self.r.zrem(keys.WEBHOOKS_PENDING, batch_id)
            return None
        due = self.r.zscore(keys.WEBHOOKS_PENDING, batch_id)
        if due is not None and due > self._now():
            # Another replica made the attempt this poll saw as due and rescheduled it while this
            # one waited for the claim: the backoff holds, the next attempt is that replica's due time.
            return None
        meta = self.r.hgetall(keys.batch(batch_id))
        url = meta.get("webhook_url")
        if not url:
            self.r.zrem(keys.WEBHOOKS_PENDING, batch_id)
            return None
        body = state.get("body")
        if body is None:
            counts = self.r.hgetall(keys.batch_counts(batch_id))
            self.r.hsetnx(skey, "body", build_body(batch_id, meta, counts, self._now()).decode())
            self.r.expire(skey, self.ttl_s)
            body = self.r.hget(skey, "body")
        attempt = int(self.r.hincrby(skey, "attempts", 1))
        raw = body.encode()
        timestamp = int(time.time())
        secret = tenant_secret(self.r, meta.get("tenant") or PUBLIC_TENANT)
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: batch_id, ATTEMPT_HEADER: str(attempt),
                   **sign_headers(secret, batch_id, timestamp, raw)}
        permanent = False
        try:
            status = post_once(url, raw, headers, allow_private=self.allow_private, timeout_s=self.timeout_s,
                               http=self.http)
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except WebhookRefused as exc:
            status, error, permanent = None, f"refused by the webhook policy: {exc.reason}", True
        except httpx.HTTPError as exc:
            status, error = None, f"{type(exc).__name__}: {exc}"[:500]
        fields: dict[str, str | int] = {"last_attempt_at": repr(time.time())}
        if status is not None:
            fields["response_status"] = status
        if error is None:
            self.r.hset(skey, mapping={**fields, "status": "delivered", "delivered_at": fields["last_attempt_at"]})
            self.r.zrem(keys.WEBHOOKS_PENDING, batch_id)
            log.info("webhook of batch %s delivered (attempt %d, HTTP %s)", batch_id, attempt, status)
            return "delivered"
        fields["last_error"] = error
        if permanent or attempt >= self.max_attempts:
            self.r.hset(skey, mapping={**fields, "status": "failed"})
            self.r.zrem(keys.WEBHOOKS_PENDING, batch_id)
            log.error("webhook of batch %s given up after %d attempt(s): %s", batch_id, attempt, error)
            return "failed"
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))
        self.r.hset(skey, mapping=fields)
        self.r.zadd(keys.WEBHOOKS_PENDING, {batch_id: self._now() + delay})
        log.warning("webhook of batch %s attempt %d failed (%s); next in %.1fs", batch_id, attempt, error, delay)
        return "retry"

    # ---- running --------------------------------------------------------------------------
    def start(self) -> "WebhookDispatcher":
        """Poll every ``poll_s`` seconds in a daemon thread; errors are logged, never raised."""
        self.loop.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling, wait (at most ``timeout`` seconds) for the poll thread and let deliveries
        in flight finish; a batch not delivered stays pending for the next API to pick up."""
        self.loop.stop(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.http.close()
