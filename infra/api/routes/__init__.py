"""One ``APIRouter`` per resource of the status API: jobs, batches, the catalog index, dead
letters, workers, queues, health, metrics and throughput (:mod:`~infra.api.routes.telemetry`),
the gallery, the dashboard page and input uploads. The webhook secret's route is in
:mod:`infra.api.webhooks`, the compatible APIs' in :mod:`infra.api.compat`;
:data:`infra.api.server.ROUTERS` lists them all.

Place in the data flow: HTTP → auth and limits (middleware) → **a route** → submission, the
job-state store, the registry, the queue depths → the response models.
"""
