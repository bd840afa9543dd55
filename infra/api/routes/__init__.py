"""One ``APIRouter`` per resource of the status API: jobs, batches, the catalog index, dead
letters, workers, queues, health, metrics, the gallery, the dashboard page, the webhook secret
and input uploads; and the compatible APIs, each its own router: AUTOMATIC1111's ``/sdapi/v1`` and OpenAI's Images API.

Place in the data flow: HTTP → auth and limits (middleware) → **a route** → submission, the
job-state store, the registry, the queue depths → the response models.
"""

from __future__ import annotations

from fastapi import APIRouter

from infra.api.routes import (
    a1111,
    batches,
    catalog,
    dashboard,
    deadletter,
    gallery,
    health,
    jobs,
    metrics,
    openai_edits,
    openai_images,
    queues,
    uploads,
    webhooks,
    workers,
)

#: Every router, in the order their routes appear in ``/openapi.json``.
ROUTERS: tuple[APIRouter, ...] = (jobs.router, batches.router, catalog.router, deadletter.router, workers.router,
                                  queues.router, health.router, metrics.router, gallery.router, dashboard.router,
                                  webhooks.router, uploads.router, a1111.router, openai_images.router,
                                  openai_edits.router)
