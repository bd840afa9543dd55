"""The status API (FastAPI): the app factory, its lifespan and ``renderfarm api``.

Data flow: producer clients → **POST here** → submission (store + wait lanes); workers → store
→ **GET here** → polling clients and the dashboard. An unknown id is always a 404. The routes
are in :mod:`infra.api.routes` (one router per resource), :mod:`infra.api.webhooks` and
:mod:`infra.api.compat` (the A1111 and OpenAI front doors), all listed in :data:`ROUTERS`.

Security (see :mod:`infra.api.auth`, :mod:`infra.api.limits`, :mod:`infra.submission.url_policy`):
every ``/v1`` route runs as one tenant, named by the ``X-API-Key`` header (``public`` without one
when auth is not required). Jobs and batches belong to the tenant that submitted them; another
tenant's id answers 404 exactly like an unknown one. ``/v1/workers`` and ``/v1/queues`` are
farm-wide (any authenticated tenant sees every pool). ``/healthz``, ``/metrics``, ``/`` and
``/openapi.json`` (and the ``/docs`` pages) need no key. Bodies over ``max_body_bytes`` are
413; a tenant over its rate limit gets 429 with ``Retry-After``.

Background loops in every API process (each safe to run in several replicas): the dispatcher
(:mod:`infra.broker.dispatch`), the reaper (:mod:`infra.broker.reaper`) and the webhook
deliverer (:mod:`infra.api.webhooks.delivery`).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError

from infra.api.auth import TenantMiddleware, redacting_log_config
from infra.api.compat import a1111, a1111_controlnet, openai_edits, openai_images, openai_videos
from infra.api.deps import Farm
from infra.api.limits import RateLimited, RateLimitMiddleware
from infra.api.routes import (
    batches,
    catalog,
    dashboard,
    deadletter,
    gallery,
    health,
    jobs,
    queues,
    telemetry,
    uploads,
    workers,
)
from infra.api.validation_errors import validation_error_handler
from infra.api.webhooks import routes as webhook_routes
from infra.api.webhooks.delivery import WebhookDispatcher
from infra.broker import dispatch
from infra.broker.reaper import Reaper
from infra.heap import freeze_startup_objects
from infra.settings import Settings, get_settings

#: Every router, in the order their routes appear in ``/openapi.json``: the farm's own resources
#: (:mod:`infra.api.routes`), the webhook secret (:mod:`infra.api.webhooks`), then the compatible
#: APIs (:mod:`infra.api.compat`).
ROUTERS: tuple[APIRouter, ...] = (jobs.router, batches.router, catalog.router, deadletter.router, workers.router,
                                  queues.router, health.router, telemetry.router, gallery.router, dashboard.router,
                                  webhook_routes.router, uploads.router, a1111.router, a1111_controlnet.router,
                                  openai_images.router, openai_edits.router, openai_videos.router)

DESCRIPTION = ("Submit text-to-image render jobs and follow them to their images.\n\n"
               "Every `/v1` route acts for the tenant of the `X-API-Key` header (required when the farm requires "
               "auth; 401 otherwise). Another tenant's job or batch id is a 404. `/v1/workers` and `/v1/queues` "
               "are farm-wide. `/healthz`, `/metrics`, `/` and `/openapi.json` are open. Too large a body is a "
               "413; too many requests or jobs per second a 429 with `Retry-After`.")


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app. ``settings`` default to the environment's."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.farm = farm = Farm(settings)
        reaper = Reaper(farm.store, farm.celery, interval_s=settings.reaper_interval_s,
                        republish_after_s=settings.republish_after_s, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                        brokers=farm.brokers).start() if settings.reaper_enabled else None
        webhooks = WebhookDispatcher.from_settings(settings, farm.redis).start() if settings.webhooks_enabled else None
        dispatcher = dispatch.from_settings(settings, farm.redis, farm.celery, brokers=farm.brokers).start()
        farm.submitter.on_enqueued = dispatcher.kick
        freeze_startup_objects("api")  # full collections then skip the imports and the Farm
        yield
        dispatcher.stop()
        if webhooks is not None:
            webhooks.stop()
        if reaper is not None:
            reaper.stop()
        farm.brokers.close()
        farm.dns_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="renderfarm", version="0.1.0", lifespan=lifespan, max_body_size=settings.max_body_bytes,
                  description=DESCRIPTION)
    # Starlette runs the last-added middleware first: auth, then the request rate limit.
    app.add_middleware(RateLimitMiddleware, limiter_of=lambda scope: scope["app"].state.farm.limiter)
    app.add_middleware(TenantMiddleware, keys_of=lambda scope: scope["app"].state.farm.keys,
                       required=settings.auth_required, scrape_token=settings.metrics_token.get_secret_value())
    app.add_exception_handler(RateLimited, lambda request, exc: exc.response(request.url.path))
    # Starlette types every handler as taking Exception; it calls this one only for its class
    app.add_exception_handler(RequestValidationError, validation_error_handler)  # type: ignore[arg-type]
    for router in ROUTERS:
        app.include_router(router)
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
