"""One ``APIRouter`` per resource of the status API: jobs, batches, the catalog index, dead
letters, workers, queues, health, metrics and the dashboard page.

Place in the data flow: HTTP → auth and limits (middleware) → **a route** → submission, the
job-state store, the registry, the queue depths → the response models.
"""

from __future__ import annotations

from fastapi import APIRouter

from infra.api.routes import batches, catalog, dashboard, deadletter, health, jobs, metrics, queues, workers

#: Every router, in the order their routes appear in ``/openapi.json``.
ROUTERS: tuple[APIRouter, ...] = (jobs.router, batches.router, catalog.router, deadletter.router, workers.router,
                                  queues.router, health.router, metrics.router, dashboard.router)
