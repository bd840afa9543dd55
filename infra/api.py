"""The status API (FastAPI): submission over HTTP, job and batch status, workers, queues,
health, metrics and the dashboard page.

Data flow: producer clients → **POST here** → submission (store + queue); workers → store
→ **GET here** → polling clients and the dashboard. An unknown id is always a 404.

Security (see :mod:`infra.auth`, :mod:`infra.limits`, :mod:`infra.webhooks_policy`): every
``/v1`` route runs as one tenant, named by the ``X-API-Key`` header (``public`` without one when
auth is not required). Jobs and batches belong to the tenant that submitted them; another
tenant's id answers 404 exactly like an unknown one. ``/v1/workers`` and ``/v1/queues`` are
farm-wide (any authenticated tenant sees every pool). ``/healthz``, ``/metrics``, ``/`` and
``/openapi.json`` (and the ``/docs`` pages) need no key. Bodies over ``max_body_bytes`` are
413; a tenant over its rate limit gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from typing import Annotated

import redis
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infra import dispatch, farm_metrics, registry
from infra.auth import KeyStore, TenantMiddleware, current_tenant, redacting_log_config
from infra.catalog_index import CatalogIndex, CatalogLookup, CatalogLookupResult
from infra.dashboard import router as dashboard_router
from infra.errors import validation_error_handler
from infra.limits import RateLimited, RateLimiter, RateLimitMiddleware
from infra.queue import make_celery
from infra.pools import NoPoolError
from infra.queues import idle_row, queue_depths
from infra.reaper import Reaper, republish
from infra.schemas import BatchAccepted, BatchStatus, BatchSubmission, JobAccepted, JobStatus, RenderRequest
from infra.settings import Settings, get_settings
from infra.storage import Storage
from infra.store import PUBLIC_TENANT, JobStore
from infra.submission import Submitter
from infra.webhooks import WebhookDispatcher
from infra.webhooks_policy import WebhookRefused, check_webhook_url

#: A route parameter holding the request's tenant (and documenting ``X-API-Key`` in the schema).
Tenant = Annotated[str, Depends(current_tenant)]


class Farm:
    """The API's handles on Redis, S3 and the queue, built once per process."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.redis = redis.Redis.from_url(settings.redis_url, decode_responses=True)
        self.store = JobStore(self.redis, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                              max_attempts=settings.max_attempts)
        self.storage = Storage(settings, max_attempts=2)
        self.celery = make_celery(settings)
        self.submitter = Submitter(self.store, self.celery, settings.default_model, self.redis, pools=settings.pools)
        self.keys = KeyStore(self.redis)
        self.limiter = RateLimiter.from_settings(self.redis, settings)
        self.catalog = CatalogIndex(self.store, self.storage)

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
        """``Submitter.submit``; requests no declared pool can serve are a 422 whose ``loc`` names
        the job (``body.jobs.<index>`` in a batch) and whose ``msg`` the model or the size."""
        try:
            return self.submitter.submit(requests, **kwargs)
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
            live = {w.get("pool") for w in registry.live_workers(self.redis, self.settings.heartbeat_ttl_s)
                    if w.get("healthy") is not False}
            for status in queued:
                if status.pool not in live:
                    status.waiting_for = f"a worker of pool {status.pool}"

    def with_url(self, status: JobStatus) -> JobStatus:
        """Attach a presigned GET URL to a finished job's result."""
        if status.result is not None:
            status.result.url = self.storage.presigned_url(status.result.key)
        return status


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app. ``settings`` default to the environment's."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.farm = farm_ = Farm(settings)
        # the reaper recovers dead workers' jobs and lost messages (infra/reaper.py); safe to run
        # in every API replica
        reaper = Reaper(farm_.store, farm_.celery, interval_s=settings.reaper_interval_s,
                        republish_after_s=settings.republish_after_s,
                        heartbeat_ttl_s=settings.heartbeat_ttl_s).start() if settings.reaper_enabled else None
        # webhooks on batch completion (infra/webhooks.py): once per batch across replicas
        dispatcher = WebhookDispatcher.from_settings(settings, farm_.redis).start() \
            if settings.webhooks_enabled else None
        # jobs go from their wait lanes to the pool queues in fair order (infra/dispatch.py); safe
        # to run in every API replica
        job_dispatcher = dispatch.from_settings(settings, app.state.farm.redis, app.state.farm.celery).start()
        app.state.farm.submitter.on_enqueued = job_dispatcher.kick
        yield
        job_dispatcher.stop()
        if dispatcher is not None:
            dispatcher.stop()
        if reaper is not None:
            reaper.stop()
        farm_.celery.close()

    app = FastAPI(title="renderfarm", version="0.1.0", lifespan=lifespan, max_body_size=settings.max_body_bytes,
                  description="Submit text-to-image render jobs and follow them to their images.\n\n"
                              "Every `/v1` route acts for the tenant of the `X-API-Key` header (required when the "
                              "farm requires auth; 401 otherwise). Another tenant's job or batch id is a 404. "
                              "`/v1/workers` and `/v1/queues` are farm-wide. `/healthz`, `/metrics`, `/` and "
                              "`/openapi.json` are open. Too large a body is a 413; too many requests or jobs "
                              "per second a 429 with `Retry-After`.")
    # Starlette runs the last-added middleware first: auth, then the request rate limit.
    app.add_middleware(RateLimitMiddleware, limiter_of=lambda scope: scope["app"].state.farm.limiter)
    app.add_middleware(TenantMiddleware, keys_of=lambda scope: scope["app"].state.farm.keys,
                       required=settings.auth_required)
    app.add_exception_handler(RateLimited, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    def farm(request: Request) -> Farm:
        return request.app.state.farm

    @app.post("/v1/jobs", status_code=202, response_model=JobAccepted, tags=["jobs"])
    async def submit_job(body: RenderRequest, request: Request, tenant: Tenant) -> JobAccepted:
        """Submit one render; it becomes a batch of one."""
        await run_in_threadpool(farm(request).limiter.charge_jobs, tenant, 1)
        accepted = await run_in_threadpool(farm(request).submit, [body], batch=False, tenant=tenant)
        return JobAccepted(job_id=accepted.job_ids[0], batch_id=accepted.batch_id)

    @app.post("/v1/batches", status_code=202, response_model=BatchAccepted, tags=["batches"])
    async def submit_batch(body: BatchSubmission, request: Request, tenant: Tenant) -> BatchAccepted:
        """Submit up to 10,000 renders as one batch. A repeated ``idempotency_key`` returns the first batch.
        A ``webhook_url`` must be http(s) on a public address (422 otherwise)."""
        await run_in_threadpool(farm(request).check_webhook, body.webhook_url)
        await run_in_threadpool(farm(request).limiter.charge_jobs, tenant, len(body.jobs))
        return await run_in_threadpool(farm(request).submit, body.jobs, batch=True, priority=body.priority,
                                       idempotency_key=body.idempotency_key, webhook_url=body.webhook_url,
                                       tenant=tenant)

    @app.post("/v1/catalog/lookup", response_model=CatalogLookupResult, tags=["catalog"])
    def catalog_lookup(body: CatalogLookup, request: Request, tenant: Tenant) -> CatalogLookupResult:
        """Per catalog key (``metadata.catalog_key`` of a submitted job), this tenant's job for it
        and its state, or null when no image exists and no job renders it (infra/catalog_index.py)."""
        return CatalogLookupResult(entries=farm(request).catalog.lookup(tenant, body.keys))

    @app.get("/v1/jobs/{job_id}", response_model=JobStatus, tags=["jobs"])
    def get_job(job_id: str, request: Request, tenant: Tenant) -> JobStatus:
        """One job's status, with a presigned URL once it succeeded. 404 for an unknown id."""
        status = farm(request).store.get_job(job_id, tenant)
        if status is None:
            raise HTTPException(404, f"unknown job id {job_id!r}")
        farm(request).waiting_for([status])
        return farm(request).with_url(status)

    @app.get("/v1/batches/{batch_id}", response_model=BatchStatus, tags=["batches"])
    def get_batch(batch_id: str, request: Request, tenant: Tenant, offset: int = Query(0, ge=0, le=10_000),
                  limit: int = Query(100, ge=0, le=1000)) -> BatchStatus:
        """Counts by state, progress 0…1 and one page of jobs (``offset``, ``limit`` ≤ 1,000)."""
        status = farm(request).store.get_batch(batch_id, offset=offset, limit=limit, tenant=tenant)
        if status is None:
            raise HTTPException(404, f"unknown batch id {batch_id!r}")
        status.jobs = [farm(request).with_url(j) for j in status.jobs]
        farm(request).waiting_for(status.jobs)
        return status

    @app.delete("/v1/jobs/{job_id}", tags=["jobs"])
    def cancel_job(job_id: str, request: Request, tenant: Tenant) -> dict:
        """Cancel a job that has not finished. 404 for an unknown id."""
        store = farm(request).store
        status = store.get_job(job_id, tenant)
        if status is None:
            raise HTTPException(404, f"unknown job id {job_id!r}")
        canceled = store.cancel(job_id)
        if canceled:
            farm_metrics.count_images(farm(request).redis, [status.pool], "canceled")
        return {"job_id": job_id, "canceled": canceled, "state": store.get_job(job_id).state}

    @app.delete("/v1/batches/{batch_id}", tags=["batches"])
    def cancel_batch(batch_id: str, request: Request, tenant: Tenant) -> dict:
        """Cancel every job of a batch that has not finished. 404 for an unknown id."""
        store = farm(request).store
        meta = store.batch_meta(batch_id)
        if not meta or meta.get("tenant", PUBLIC_TENANT) != tenant:
            raise HTTPException(404, f"unknown batch id {batch_id!r}")
        canceled = [j for j in store.batch_job_ids(batch_id) if store.cancel(j)]
        farm_metrics.count_images(farm(request).redis, [pool for _, _, pool, _ in store.routes(canceled)], "canceled")
        return {"batch_id": batch_id, "canceled": len(canceled)}

    @app.get("/v1/dead-letter", tags=["jobs"])
    def dead_letter(request: Request, tenant: Tenant, offset: int = Query(0, ge=0, le=10**9),
                    limit: int = Query(100, ge=1, le=1000)) -> dict:
        """Failed jobs of this tenant, newest first, with their last error; page on with ``next_offset``."""
        more, jobs = farm(request).store.dead_letters(offset=offset, limit=limit, tenant=tenant)
        return {"jobs": [j.model_dump(mode="json") for j in jobs], "offset": offset, "limit": limit,
                "next_offset": offset + limit if more else None}

    @app.post("/v1/dead-letter/{job_id}/retry", status_code=202, tags=["jobs"])
    def retry_dead_letter(job_id: str, request: Request, tenant: Tenant) -> dict:
        """Put a failed job back in its queue with a fresh attempt budget. 404 for an unknown id,
        409 when the job is not failed."""
        f = farm(request)
        status = f.store.get_job(job_id, tenant)
        if status is None:
            raise HTTPException(404, f"unknown job id {job_id!r}")
        if f.store.retry(job_id) is None:
            raise HTTPException(409, f"job {job_id!r} is {f.store.get_job(job_id).state}, not failed")
        republish(f.store, f.celery, [job_id])
        return {"job_id": job_id, "state": "queued"}

    @app.get("/v1/workers", tags=["farm"], dependencies=[Depends(current_tenant)])
    def workers(request: Request) -> list[dict]:
        """Live workers: device, recipe, model, pool, batch size, last heartbeat, current jobs, and
        ``images_per_s`` over the last few minutes."""
        f = farm(request)
        return farm_metrics.with_rates(f.redis, registry.live_workers(f.redis, f.settings.heartbeat_ttl_s))

    @app.get("/v1/queues", tags=["farm"], dependencies=[Depends(current_tenant)])
    def queues(request: Request) -> list[dict]:
        """Per pool (every declared one, and any with jobs or workers): queued (waiting for dispatch
        or in the broker), reserved (prefetched), running, outstanding (the autoscaling signal),
        live workers and ``oldest_wait_s`` (seconds the longest-waiting unstarted job has waited)."""
        f = farm(request)
        return queue_depths(f.redis, registry.live_workers(f.redis, f.settings.heartbeat_ttl_s),
                            pools=[p.name for p in f.settings.pools])

    @app.get("/v1/queues/{pool}", tags=["farm"], dependencies=[Depends(current_tenant)])
    def queue(pool: str, request: Request) -> dict:
        """One pool's row of ``/v1/queues`` (jobs; all zeros for a pool with nothing queued and no
        worker), so that KEDA's metrics-api scaler reads a scalar at ``valueLocation: outstanding``."""
        rows = queues(request)
        return next((r for r in rows if r["pool"] == pool), idle_row(pool))

    @app.get("/healthz", tags=["farm"])
    def healthz(request: Request) -> JSONResponse:
        """200 when Redis and S3 answer, else 503 with the failing check. Workers whose circuit
        breaker is open are listed in ``unhealthy_workers`` (present only when there are some):
        they do not make the API itself unhealthy, since it still serves."""
        checks = {}
        for name, probe in (("redis", farm(request).redis.ping), ("s3", farm(request).storage.ping)):
            try:
                probe()
                checks[name] = "ok"
            except Exception as exc:
                checks[name] = f"{type(exc).__name__}: {exc}"[:300]
        ok = all(v == "ok" for v in checks.values())
        body = {"status": "ok" if ok else "unavailable", "checks": checks}
        if checks["redis"] == "ok":
            unhealthy = [w["name"] for w in registry.live_workers(farm(request).redis, settings.heartbeat_ttl_s)
                         if w.get("healthy") is False]
            if unhealthy:
                body["unhealthy_workers"] = unhealthy
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["farm"])
    def metrics(request: Request) -> Response:
        """Prometheus text format: queue wait, render seconds per image and batch size
        (histograms), images by pool and state, outstanding jobs and live workers per pool
        (see :mod:`infra.farm_metrics`)."""
        f = farm(request)
        body, content_type = farm_metrics.exposition(f.redis, f.settings.heartbeat_ttl_s)
        return Response(body, media_type=content_type)

    app.include_router(dashboard_router)  # GET / (the dashboard page), /v1/batches, /v1/throughput

    return app


def run_api(args: argparse.Namespace) -> None:
    """Serve the API with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info", log_config=redacting_log_config())


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm api`` to the CLI."""
    p = subparsers.add_parser("api", help="serve the status API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=run_api)
