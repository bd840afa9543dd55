"""Tenants and their API keys: creation, revocation, and the check on every API request.

Data flow: an operator runs ``renderfarm keys create --tenant T`` (:mod:`infra.api.keys_cli`) →
**KeyStore here** writes the key's hash to Redis and prints the key once → the client sends it
as ``X-API-Key`` → **TenantMiddleware here** looks the hash up and puts the tenant in
``scope["state"]["tenant"]`` → rate limits (:mod:`infra.api.limits`) → routes, which scope every
job and batch to that tenant (another tenant's ids answer 404).

Clients that cannot set ``X-API-Key`` send the key as ``Authorization: Bearer <key>`` (the OpenAI
SDK's ``api_key``) or as the password of HTTP Basic auth (A1111 clients' ``--api-auth``
user:password). When auth is not required, such a credential that is not shaped like a farm key
is ignored (the OpenAI SDK insists on sending one), and the request is anonymous.

A key reads ``rf_<key id>_<secret>``: the key id (12 hex digits) is public and names the key in
listings, logs and ``keys revoke``; the secret is 32 random bytes. Only the key's SHA-256 is
stored (a 256-bit random secret needs no slow hash), so a Redis dump gives no usable key.

Redis keys (:mod:`infra.keys`):
    rf:{auth}:apikey:{sha256}     hash: tenant, key_id, name, created_at (epoch seconds)
    rf:{auth}:apikeys             hash: key_id → sha256 (every key, for listing and revocation)
    rf:{auth}:tenant:{t}:keys     set of key ids

``RENDERFARM_AUTH_REQUIRED`` (``auth_required``) on: every route but :data:`OPEN_PATHS` needs a
valid key, else 401. Off (the local demo): a key is optional; a valid one selects its tenant,
an invalid one is still a 401, and a request without one is tenant ``public``.

Keys never reach a log: the middleware does not log them, 401 bodies do not echo them, and
:class:`RedactKeys` masks anything shaped like a key in uvicorn's log records (an access-log
line whose URL carries one, for instance).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import time
from dataclasses import dataclass

import redis
from anyio import to_thread
from fastapi import Request, Security
from fastapi.security import APIKeyHeader
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from infra import keys
from infra.api.error_shapes import error_response
from infra.state.job_store import PUBLIC_TENANT

#: The header clients send their key in.
HEADER = "X-API-Key"

#: Routes the middleware lets through without a key: liveness/readiness, Prometheus (whose route
#: checks its own scrape token or an admin key), the dashboard page and the API's own
#: description. Everything under /v1 needs one when auth is required, including the farm-wide
#: /v1/workers and /v1/queues.
OPEN_PATHS = frozenset({"/healthz", "/livez", "/metrics", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})

#: Farm-wide, tenant-free read routes that also accept the scrape token (``RENDERFARM_METRICS_TOKEN``)
#: as ``Authorization: Bearer``: the queue depths KEDA's metrics-api scaler polls. A request that
#: presents the token here is tenant :data:`SCRAPE_TENANT` (it can see no tenant's jobs).
SCRAPE_PATHS = ("/v1/queues",)
SCRAPE_TENANT = "scrape"

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
KEY_RE = re.compile(r"rf_([0-9a-f]{12})_[A-Za-z0-9_-]{20,}")


def hash_key(key: str) -> str:
    """The stored form of a key: SHA-256, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def redact(text: str) -> str:
    """``text`` with every API key in it replaced by ``rf_<key id>_***``."""
    return KEY_RE.sub(lambda m: f"rf_{m.group(1)}_***", text)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name (1–63 of ``a-z 0-9 _ . -``, starting alphanumeric).

    Raises:
        ValueError: naming the rule.
    """
    if not TENANT_RE.match(tenant):
        raise ValueError(f"tenant must be 1–63 characters of a-z, 0-9, '_', '.', '-', starting with a letter "
                         f"or digit; got {tenant!r}")
    return tenant


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a tenant, and the id of the key it used (None: anonymous)."""

    tenant: str
    key_id: str | None = None


@dataclass(frozen=True)
class KeyInfo:
    """One stored key, without its secret."""

    key_id: str
    tenant: str
    name: str
    created_at: float


class KeyStore:
    """API keys in Redis, stored hashed.

    Args:
        client: a ``redis.Redis`` with ``decode_responses=True``.
    """

    def __init__(self, client: redis.Redis):
        self.r = client

    def create(self, tenant: str, name: str = "") -> tuple[KeyInfo, str]:
        """Make a key for ``tenant``; returns its info and the key itself, which is not stored
        anywhere and cannot be shown again.

        Raises:
            ValueError: an invalid tenant name.
        """
        check_tenant(tenant)
        key_id = secrets.token_hex(6)
        key = f"rf_{key_id}_{secrets.token_urlsafe(32)}"
        info = KeyInfo(key_id, tenant, name[:200], time.time())
        digest = hash_key(key)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.api_key(digest), mapping={"tenant": tenant, "key_id": key_id, "name": info.name,
                                                 "created_at": repr(info.created_at)})
        pipe.hset(keys.API_KEYS, key_id, digest)
        pipe.sadd(keys.tenant_keys(tenant), key_id)
        pipe.execute()
        return info, key

    def revoke(self, key_id: str) -> KeyInfo | None:
        """Delete the key ``key_id``; it stops working at once. Returns its info, or None when unknown."""
        digest = self.r.hget(keys.API_KEYS, key_id)
        if digest is None:
            return None
        h = self.r.hgetall(keys.api_key(digest))
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.api_key(digest))
        pipe.hdel(keys.API_KEYS, key_id)
        if h:
            pipe.srem(keys.tenant_keys(h['tenant']), key_id)
        pipe.execute()
        return self._info(h) if h else KeyInfo(key_id, "", "", 0.0)

    def list(self, tenant: str | None = None) -> list[KeyInfo]:
        """Every key (or ``tenant``'s), oldest first, without secrets."""
        if tenant is not None:
            ids = sorted(self.r.smembers(keys.tenant_keys(tenant)))
            digests = self.r.hmget(keys.API_KEYS, ids) if ids else []
        else:
            digests = list(self.r.hgetall(keys.API_KEYS).values())
        pipe = self.r.pipeline(transaction=False)
        for digest in digests:
            pipe.hgetall(keys.api_key(digest or '-'))
        infos = [self._info(h) for h in pipe.execute() if h]
        return sorted(infos, key=lambda i: (i.created_at, i.key_id))

    def authenticate(self, key: str) -> Principal | None:
        """The principal a key belongs to, or None when it is unknown or revoked."""
        if not key or len(key) > 200:
            return None
        h = self.r.hmget(keys.api_key(hash_key(key)), ["tenant", "key_id"])
        if h[0] is None:
            return None
        return Principal(tenant=h[0], key_id=h[1])

    @staticmethod
    def _info(h: dict[str, str]) -> KeyInfo:
        return KeyInfo(h["key_id"], h["tenant"], h.get("name", ""), float(h.get("created_at", 0)))


def _unauthorized(path: str, detail: str) -> JSONResponse:
    return error_response(path, 401, detail, code="invalid_api_key", headers={"WWW-Authenticate": HEADER})


def presented_keys(headers: list[tuple[bytes, bytes]], *, required: bool) -> list[str]:
    """The API keys a request presents: its ``X-API-Key`` headers; else the token of an
    ``Authorization: Bearer`` header or the password of ``Authorization: Basic``. Unless ``required``,
    a Bearer or Basic credential not shaped like a farm key counts as none (anonymous)."""
    keys_ = [v.decode("latin-1") for k, v in headers if k == b"x-api-key"]
    if keys_:
        return keys_
    auth = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), "")
    scheme, _, credential = auth.strip().partition(" ")
    credential = credential.strip()
    if scheme.lower() == "basic":
        try:
            credential = base64.b64decode(credential, validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            credential = ""
    elif scheme.lower() != "bearer":
        return []
    if not credential or (not required and not KEY_RE.fullmatch(credential)):
        return []
    return [credential]


class TenantMiddleware:
    """ASGI middleware: authenticates ``X-API-Key`` and sets ``scope["state"]["tenant"]`` and
    ``["key_id"]``; answers 401 itself, before any body is read.

    Args:
        app: the wrapped ASGI app.
        keys_of: returns the :class:`KeyStore` for a scope (built in the app's lifespan).
        required: whether a key is required outside :data:`OPEN_PATHS`.
        scrape_token: the metrics scrape token; "" = none. On :data:`SCRAPE_PATHS` a request
            presenting exactly this token (``Authorization: Bearer`` or ``X-API-Key``) passes as
            tenant :data:`SCRAPE_TENANT`, so an autoscaler can read queue depths without a tenant key.
    """

    def __init__(self, app: ASGIApp, keys_of, required: bool, scrape_token: str = ""):
        self.app = app
        self.keys_of = keys_of
        self.required = required
        self.scrape_token = scrape_token.encode()

    def _is_scrape(self, path: str, keys: list[str]) -> bool:
        return (bool(self.scrape_token) and len(keys) == 1
                and any(path == p or path.startswith(p + "/") for p in SCRAPE_PATHS)
                and hmac.compare_digest(keys[0].encode("utf-8", "surrogatepass"), self.scrape_token))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        keys = presented_keys(scope["headers"], required=self.required)
        principal: Principal | None = None
        if self._is_scrape(scope["path"], keys):
            principal = Principal(SCRAPE_TENANT)
        elif keys:
            if len(keys) == 1:
                principal = await to_thread.run_sync(self.keys_of(scope).authenticate, keys[0])
            if principal is None:
                await _unauthorized(scope["path"], "invalid or revoked API key")(scope, receive, send)
                return
        elif self.required:
            await _unauthorized(scope["path"], f"this route needs an API key in the {HEADER} header "
                                               "(or Authorization: Bearer)")(scope, receive, send)
            return
        else:
            principal = Principal(PUBLIC_TENANT)
        state = scope.setdefault("state", {})
        state["tenant"], state["key_id"] = principal.tenant, principal.key_id
        await self.app(scope, receive, send)


_api_key_header = APIKeyHeader(name=HEADER, auto_error=False, scheme_name="ApiKey",
                               description="A tenant's API key (`renderfarm keys create`). Required when "
                                           "RENDERFARM_AUTH_REQUIRED is on; optional otherwise.")


def current_tenant(request: Request, _key: str | None = Security(_api_key_header)) -> str:
    """FastAPI dependency: the tenant :class:`TenantMiddleware` authenticated. Declaring it on a
    route also documents the ``X-API-Key`` scheme in ``/openapi.json``."""
    return request.state.tenant


class RedactKeys(logging.Filter):
    """Logging filter that masks API keys in a record's message and arguments (uvicorn's
    access log passes the request line as arguments)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def redacting_log_config() -> dict:
    """uvicorn's logging config with :class:`RedactKeys` on every handler."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_api_keys"] = {"()": "infra.api.auth.RedactKeys"}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_api_keys")
    return config
