"""The API's handles on Redis, S3 and the queue, and the FastAPI dependencies that hand them out.

Place in the data flow: built once per API process in the app's lifespan
(:func:`infra.api.server.create_app`); every route reaches the job-state store, the bucket, the
submission path and the limits through :func:`get_farm`, and its tenant through :data:`Tenant`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError

from infra.api.auth import KeyStore, current_tenant
from infra.api.limits import RateLimiter
from infra.broker.app import make_celery
from infra.broker.shards import Brokers
from infra.routing import NoPoolError
from infra.schemas import BatchAccepted, JobStatus, RenderRequest, is_farm_id
from infra.settings import Settings
from infra.state import metrics, registry
from infra.state.catalog_index import CatalogIndex
from infra.state.connect import is_cluster_url, redis_client, state_client
from infra.state.durable import DurableAck, NotDurable
from infra.state.job_store import JobStore
from infra.state.quota import QuotaExceeded, Quotas
from infra.storage.s3 import Storage, object_key
from infra.submission.input_refs import InputError, InputResolver
from infra.submission.submitter import SubmissionInFlight, Submitter
from infra.submission.url_policy import WebhookRefused, check_webhook_url

#: A route parameter holding the request's tenant (and documenting ``X-API-Key`` in the schema).
Tenant = Annotated[str, Depends(current_tenant)]


def not_found(what: str) -> HTTPException:
    """The one 404 for an id the caller may not see: unknown, malformed or another tenant's all
    answer ``{"detail": "unknown <what> id"}``, byte for byte (the id is not echoed, so the body
    says nothing about it)."""
    return HTTPException(404, f"unknown {what} id")


def require_id(value: str, what: str) -> str:
    """``value`` when it is shaped like a job or batch id (:func:`infra.schemas.is_farm_id`);
    else the same 404 as an unknown id (a malformed id never reaches a Redis key name).

    Raises:
        HTTPException: 404 :func:`not_found`.
    """
    if not is_farm_id(value):
        raise not_found(what)
    return value


class Farm:
    """The API's handles on Redis, S3 and the queue, built once per process.

    Args:
        settings: the process's settings (Redis URL, bucket, limits, pools, …).
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        if is_cluster_url(settings.state_url) and settings.durable_ack != "off":
            raise ValueError("RENDERFARM_DURABLE_ACK must be off with a Redis Cluster state store: WAITAOF "
                             "confirms one node, and a batch's writes reach several")
        self.redis = state_client(settings.state_url)
        #: The broker's Redis (queue depths); the state store's client when they are one Redis.
        self.broker_redis = (redis_client(settings.redis_url)
                             if settings.state_redis_url else self.redis)
        self.store = JobStore(self.redis, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                              max_attempts=settings.max_attempts)
        self.storage = Storage(settings, max_attempts=2)
        self.celery = make_celery(settings)
        #: Every broker: the default (``celery``, ``broker_redis``) and the shards pools name.
        self.brokers = Brokers.from_settings(settings, self.celery, self.broker_redis)
        self.quotas = Quotas(self.redis, max_jobs=settings.quota_outstanding_jobs,
                             max_gpu_s=settings.quota_gpu_seconds, max_bytes=settings.quota_outstanding_bytes,
                             hold_s=settings.quota_hold_s)
        self.submitter = Submitter(self.store, self.celery, settings.default_model, self.redis, pools=settings.pools,
                                   upscalers=settings.upscaler_names, loras=settings.loras,
                                   controls=settings.controls,
                                   quotas=self.quotas, s_per_mpx_step=settings.default_s_per_mpx_step,
                                   drain_gpu_s_per_s=lambda: float(max(1, len(self.live_workers()))),
                                   claim_s=settings.idempotency_claim_s,
                                   durable=DurableAck(self.redis, settings.durable_ack,
                                                      timeout_ms=settings.durable_ack_timeout_ms),
                                   inputs=InputResolver(self.storage, max_bytes=settings.input_max_bytes,
                                                        max_pixels=settings.input_max_pixels,
                                                        allow_private=settings.input_allow_private))
        self.keys = KeyStore(self.redis)
        self.limiter = RateLimiter.from_settings(self.redis, settings)
        self.catalog = CatalogIndex(self.store, self.locate_image, exists=self.storage.exists)
        #: Blocking DNS of webhook URLs runs here, not in the shared thread pool of sync routes.
        self.dns_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="renderfarm-webhook-dns")

    def locate_image(self, batch_id: str, job_id: str, output_format: str) -> str | None:
        """The S3 key of a job's image when the image is in the bucket (a HEAD), else None."""
        key = object_key(batch_id, job_id, output_format)
        return key if self.storage.exists(key) else None

    def live_workers(self) -> list[dict]:
        """Workers heard from within the heartbeat TTL (:func:`infra.state.registry.live_workers`)."""
        return registry.live_workers(self.redis, self.settings.heartbeat_ttl_s)

    def visible_workers(self, tenant: str) -> list[dict]:
        """:meth:`live_workers` as ``tenant`` may see them: the ids in ``current_jobs`` and
        ``reserved_jobs`` are only those of its own jobs, unless it is an admin tenant
        (``RENDERFARM_ADMIN_TENANTS``), which sees them all."""
        workers = self.live_workers()
        if tenant in self.settings.admin_tenant_set:
            return workers
        ids = sorted({j for w in workers for f in ("current_jobs", "reserved_jobs") for j in w.get(f) or []
                      if isinstance(j, str)})
        owners = dict(zip(ids, self.store.tenants_of(ids))) if ids else {}
        for w in workers:
            for field in ("current_jobs", "reserved_jobs"):
                if field in w:
                    w[field] = [j for j in w[field] or [] if owners.get(j) == tenant]
        return workers

    def check_webhook(self, url: str | None) -> None:
        """Refuse a webhook URL that fails the SSRF policy, as a 422 on ``body.webhook_url``."""
        if url is None:
            return
        try:
            check_webhook_url(url, allow_private=self.settings.webhook_allow_private)
        except WebhookRefused as exc:
            raise RequestValidationError([{"type": "value_error", "loc": ("body", "webhook_url"),
                                           "msg": f"Value error, {exc.reason}", "input": url}]) from None

    def submit(self, requests: list[RenderRequest], *, batch: bool, **kwargs) -> BatchAccepted:
        """:meth:`Submitter.submit <infra.submission.submitter.Submitter.submit>`, its domain errors
        as HTTP answers: a refused input image (:mod:`infra.submission.input_refs`, resolved
        first) is a 422 on its field (413 over the byte limit, 415 an unsupported format);
        requests no declared pool can serve are a 422 whose ``loc`` names the job
        (``body.jobs.<index>`` in a batch) and whose ``msg`` the model or the size; over the
        tenant's quota, a 429 with ``Retry-After`` (413 for a request alone over it); a duplicate
        of an idempotent submission still in flight, a 409 with ``Retry-After``; Redis not
        confirming the batch durable in time (``RENDERFARM_DURABLE_ACK``), a 503. Nothing is
        recorded for a refused submission.

        Raises:
            RequestValidationError: the 422s (FastAPI's shape, ``loc`` and ``msg`` per error).
            HTTPException: 409, 413, 415, 429 or 503.
        """
        try:
            return self.submitter.submit(requests, **kwargs)
        except InputError as exc:
            loc = ("body", *(("jobs", exc.index) if batch else ()), exc.field)
            if exc.status == 422:
                raise RequestValidationError([{"type": "invalid_input_image", "loc": loc,
                                               "msg": exc.reason, "input": None}]) from None
            raise HTTPException(exc.status, f"{'.'.join(map(str, loc[1:]))}: {exc.reason}") from None
        except QuotaExceeded as exc:
            headers = {"Retry-After": str(exc.retry_after_s)} if exc.status == 429 else None
            raise HTTPException(exc.status, exc.message, headers=headers) from None
        except NotDurable as exc:
            raise HTTPException(503, f"accepted but not yet durable: {exc}; retry with the same idempotency key",
                                headers={"Retry-After": "1"}) from None
        except SubmissionInFlight as exc:
            raise HTTPException(409, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
        except NoPoolError as exc:
            raise RequestValidationError([
                {"type": e["type"], "msg": e["msg"], "input": e["input"],
                 "loc": ("body", *(("jobs", e["index"]) if batch else ()), *((e["field"],) if e["field"] else ()))}
                for e in exc.errors]) from None

    def waiting_for(self, statuses: list[JobStatus]) -> None:
        """Set ``waiting_for`` on each queued job whose pool has no live, healthy worker (scale from
        zero; a worker whose circuit breaker is open takes no jobs)."""
        queued = [s for s in statuses if s.state == "queued" and s.pool]
        if queued:
            live = {w.get("pool") for w in self.live_workers() if w.get("healthy") is not False}
            for status in queued:
                if status.pool not in live:
                    status.waiting_for = f"a worker of pool {status.pool}"

    def cancel_batch(self, batch_id: str) -> int:
        """Cancel every unfinished job of a batch (counted as canceled images); returns how many
        this call canceled."""
        canceled = [j for j in self.store.batch_job_ids(batch_id) if self.store.cancel(j)]
        metrics.count_images(self.redis, [pool for _, _, pool, _ in self.store.routes(canceled)], "canceled")
        return len(canceled)

    def known_models(self) -> list[str]:
        """Models this farm can render now or by declaration: the default model, every declared
        pool's, and every live worker's, sorted, without duplicates."""
        found = {self.settings.default_model, *(p.model for p in self.settings.pools)}
        found.update(w["model"] for w in self.live_workers() if w.get("model"))
        return sorted(found)

    def with_url(self, status: JobStatus) -> JobStatus:
        """Attach presigned GET URLs to a finished job's result (a video's poster and preview too)."""
        result = status.result
        if result is not None:
            result.url = self.storage.presigned_url(result.key)
            if result.poster is not None:
                result.poster_url = self.storage.presigned_url(result.poster)
            if result.preview is not None:
                result.preview_url = self.storage.presigned_url(result.preview)
        return status


def get_farm(request: Request) -> Farm:
    """FastAPI dependency: the process's :class:`Farm` (built in the app's lifespan)."""
    return request.app.state.farm


#: A route parameter holding the process's :class:`Farm`.
FarmDep = Annotated[Farm, Depends(get_farm)]
