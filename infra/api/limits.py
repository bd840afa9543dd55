"""Per-tenant rate limits: token buckets in Redis, one Lua script per charge.

Data flow: HTTP request → auth (:mod:`infra.api.auth`, which names the tenant) → **request bucket
here** (every authenticated route, 1 token each) → route → for submissions, **job bucket here**
(1 token per job) → submission. A refused charge is a 429 with ``Retry-After`` (whole seconds);
a batch with more jobs than the job bucket can ever hold is a 413, since waiting cannot help.

The bucket refills continuously at ``rate`` tokens/s up to ``burst``. Its state (tokens, last
refill) lives in ``rf:rl:{tenant}:{kind}`` and the clock is Redis's own (``TIME``), so several
API replicas share one limit and their clocks do not matter. The key expires once the bucket
would be full again. The request body size limit is FastAPI's ``max_body_size`` (setting
``max_body_bytes``), configured in :func:`infra.api.server.create_app`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis
from anyio import to_thread
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from infra import keys
from infra.api.error_shapes import error_response
from infra.settings import Settings

# KEYS[1] bucket hash. ARGV: rate (tokens/s), burst (tokens), cost (tokens).
# Returns {allowed 0|1, seconds until `cost` tokens are there (string), tokens left (string)}.
_TAKE = """
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(b[1]), tonumber(b[2])
if tokens == nil or ts == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, wait = 0, 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, tostring(wait), tostring(tokens)}
"""


@dataclass(frozen=True)
class Bucket:
    """A token bucket's shape: refills ``rate`` tokens/s up to ``burst``; rate 0 = unlimited."""

    kind: str
    rate: float
    burst: int

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0


class RateLimited(Exception):
    """A charge was refused. ``retry_after_s`` is when it could succeed, or None for never
    (the cost exceeds the bucket's burst)."""

    def __init__(self, tenant: str, bucket: Bucket, cost: int, retry_after_s: float | None):
        self.tenant, self.bucket, self.cost, self.retry_after_s = tenant, bucket, cost, retry_after_s
        unit = bucket.kind
        if retry_after_s is None:
            message = (f"{cost} {unit} exceed tenant {tenant!r}'s burst of {bucket.burst} {unit}; "
                       f"split the submission")
        else:
            message = (f"tenant {tenant!r} is over its limit of {bucket.rate:g} {unit}/s (burst {bucket.burst}); "
                       f"retry after {self.retry_after_header} s")
        super().__init__(message)

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s or 0)))

    def response(self, path: str = "") -> JSONResponse:
        """429 with ``Retry-After``, or 413 when waiting cannot help, in the error shape of ``path``'s
        API family (:mod:`infra.api.error_shapes`)."""
        if self.retry_after_s is None:
            return error_response(path, 413, str(self), code="request_too_large")
        return error_response(path, 429, str(self), code="rate_limit_exceeded",
                              headers={"Retry-After": self.retry_after_header})


class RateLimiter:
    """The farm's two per-tenant buckets: ``requests`` (1 per authenticated request) and
    ``jobs`` (1 per submitted job).

    Args:
        client: a ``redis.Redis`` (``decode_responses=True``).
        requests: the request bucket. jobs: the job bucket.
    """

    def __init__(self, client: redis.Redis, *, requests: Bucket, jobs: Bucket):
        self.r = client
        self.requests, self.jobs = requests, jobs
        self._take = client.register_script(_TAKE)

    @classmethod
    def from_settings(cls, client: redis.Redis, settings: Settings) -> "RateLimiter":
        """Buckets from ``RENDERFARM_RATE_LIMIT_*``."""
        return cls(client,
                   requests=Bucket("requests", settings.rate_limit_requests_per_s, settings.rate_limit_request_burst),
                   jobs=Bucket("jobs", settings.rate_limit_jobs_per_s, settings.rate_limit_job_burst))

    def charge(self, tenant: str, bucket: Bucket, cost: int = 1) -> float:
        """Take ``cost`` tokens from ``tenant``'s ``bucket``; returns the tokens left (inf if unlimited).

        Raises:
            RateLimited: not enough tokens now (``retry_after_s`` seconds until there are), or
                ``cost`` is more than the bucket ever holds (``retry_after_s`` None).
        """
        if bucket.unlimited or cost <= 0:
            return math.inf
        if cost > bucket.burst:
            raise RateLimited(tenant, bucket, cost, None)
        allowed, wait, left = self._take(keys=[keys.rate_bucket(tenant, bucket.kind)],
                                         args=[repr(float(bucket.rate)), bucket.burst, cost])
        if not int(allowed):
            raise RateLimited(tenant, bucket, cost, float(wait))
        return float(left)

    def charge_request(self, tenant: str) -> float:
        """One token from the request bucket. Raises :class:`RateLimited`."""
        return self.charge(tenant, self.requests, 1)

    def charge_jobs(self, tenant: str, jobs: int) -> float:
        """``jobs`` tokens from the job bucket. Raises :class:`RateLimited`."""
        return self.charge(tenant, self.jobs, jobs)


class RateLimitMiddleware:
    """ASGI middleware: charges the request bucket of the tenant that :mod:`infra.api.auth` put in
    ``scope["state"]["tenant"]``; open routes (no tenant) are not counted.

    ``limiter_of(scope)`` returns the :class:`RateLimiter` (built in the app's lifespan).
    """

    def __init__(self, app: ASGIApp, limiter_of):
        self.app = app
        self.limiter_of = limiter_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        if tenant is not None:
            limiter: RateLimiter = self.limiter_of(scope)
            try:
                await to_thread.run_sync(limiter.charge_request, tenant)
            except RateLimited as exc:
                await exc.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
