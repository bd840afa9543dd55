"""Batch submission: validated requests → job records (``queued``) → Celery messages.

Data flow: producer (HTTP ``POST /v1/jobs`` / ``POST /v1/batches``) → **here** → job-state store
and the pool queues. Records are written before messages are published, so a worker never
receives a job the store does not know. Both steps are pipelined: the whole batch costs a few
round trips, never one per job.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence

import redis
from celery import Celery

from infra import webhooks
from infra.pools import pool_for_model
from infra.queue import publish_jobs
from infra.schemas import MAX_SEED, BatchAccepted, RenderRequest
from infra.store import PUBLIC_TENANT, JobStore, NewJob


def new_id() -> str:
    """A fresh job or batch id: 32 lowercase hex characters (UUID4)."""
    return uuid.uuid4().hex


def resolve(request: RenderRequest, default_model: str) -> RenderRequest:
    """Fill what the farm assigns: the default model and a random seed (0…2³²−1) when absent."""
    updates = {}
    if request.model is None:
        updates["model"] = default_model
    if request.seed is None:
        updates["seed"] = secrets.randbelow(MAX_SEED + 1)
    return request.model_copy(update=updates) if updates else request


class Submitter:
    """Creates batches: records every job, then publishes every message.

    Args:
        store: the job-state store.
        celery_app: the app whose broker receives the messages.
        default_model: model for requests that name none.
    """

    def __init__(self, store: JobStore, celery_app: Celery, default_model: str, client: redis.Redis,
                 idempotency_ttl_s: int = 24 * 3600):
        self.store = store
        self.celery_app = celery_app
        self.default_model = default_model
        self.redis = client
        self.idempotency_ttl_s = idempotency_ttl_s

    def submit(self, requests: Sequence[RenderRequest], *, priority: str = "normal",
               idempotency_key: str | None = None, webhook_url: str | None = None,
               tenant: str = PUBLIC_TENANT) -> BatchAccepted:
        """Submit ``requests`` as one batch owned by ``tenant``; returns its id and the job ids in
        submission order.

        With an ``idempotency_key`` this tenant used in the last ``idempotency_ttl_s`` seconds,
        nothing is submitted and the first batch is returned again (keys are per tenant, so one
        tenant's key never returns another tenant's batch).
        """
        batch_id = new_id()
        if idempotency_key is not None:
            key = f"rf:idem:{tenant}:{idempotency_key}"
            if not self.redis.set(key, batch_id, nx=True, ex=self.idempotency_ttl_s):
                first = self.redis.get(key)
                return BatchAccepted(batch_id=first, job_ids=self.store.batch_job_ids(first))
        jobs = []
        for request in requests:
            request = resolve(request, self.default_model)
            jobs.append(NewJob(new_id(), request, pool_for_model(request.model)))
        extra = {"webhook_url": webhook_url} if webhook_url else None
        self.store.create_batch(batch_id, jobs, priority=priority, extra=extra, tenant=tenant)
        if webhook_url:
            webhooks.enroll(self.redis, batch_id)
        publish_jobs(self.celery_app, ((j.job_id, j.pool) for j in jobs), priority=priority)
        return BatchAccepted(batch_id=batch_id, job_ids=[j.job_id for j in jobs])
