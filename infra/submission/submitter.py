"""Batch submission: validated requests → a pool each → job records (``queued``) → wait lanes.

Data flow: producer (HTTP ``POST /v1/jobs`` / ``POST /v1/batches``, through the status API's
:class:`infra.api.deps.Farm`; or a caller in Python) → **here** → job-state store and the pools'
wait lanes (:mod:`infra.broker.lanes`) → dispatcher (:mod:`infra.broker.dispatch`) → the pool
queues. Input images are resolved first (:mod:`infra.submission.input_refs`), then routing
(:mod:`infra.routing`), so a refused input or a request no pool can serve refuses the
submission before anything is written. Records are written before jobs enter a lane, so a
worker never receives a job the store does not know. Every step is pipelined: the whole batch
costs a few round trips, never one per job.

No HTTP here: every refusal is a domain error (:class:`~infra.submission.input_refs.InputError`,
:class:`~infra.routing.NoPoolError`, :class:`~infra.state.quota.QuotaExceeded`,
:class:`SubmissionInFlight`, :class:`~infra.state.durable.NotDurable`) that the API maps to its
status code (:meth:`infra.api.deps.Farm.submit`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery import Celery

from infra import keys
from infra.broker.lanes import enqueue
from infra.controls import ControlSpec
from infra.pools import OFFLINE_UPSCALERS, LoraSpec, PoolSpec
from infra.routing import Router
from infra.schemas import MAX_SEED, BatchAccepted, RenderRequest
from infra.state import catalog_index
from infra.state.durable import DurableAck
from infra.state.job_store import PUBLIC_TENANT, JobStore, NewJob
from infra.state.quota import Quotas, job_bytes, request_cost_s
from infra.submission.input_refs import InputResolver
from infra.video import with_video_defaults

#: Delete an idempotency claim only while it is still this submission's (KEYS[1], ARGV[1] = claim).
_UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SubmissionInFlight(Exception):
    """A submission with the same idempotency key is still being written: retry after
    ``retry_after_s`` seconds (the API answers 409 with ``Retry-After``)."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"a submission with this idempotency key is in flight; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


def new_id(shard: str | None = None) -> str:
    """A fresh job or batch id: 32 lowercase hex characters (UUID4's), the first two replaced by
    ``shard`` when given (:func:`infra.keys.shard`: a job gets its batch's shard, so on Redis
    Cluster a batch's keys and its jobs' keys share a slot)."""
    return new_ids(1, shard)[0]


def new_ids(n: int, shard: str | None) -> list[str]:
    """``n`` fresh ids shaped like :func:`new_id`'s (UUID4 version and variant bits, 32 lowercase
    hex characters, the first two replaced by ``shard`` unless it is None), from one ``os.urandom``
    call instead of one :func:`uuid.uuid4` per id (a 10,000-job batch costs a few milliseconds)."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = bytes(b & 0x0F | 0x40 for b in raw[6::16])  # version 4
    raw[8::16] = bytes(b & 0x3F | 0x80 for b in raw[8::16])  # RFC 4122 variant
    text = raw.hex()
    if shard is None:
        return [text[i:i + 32] for i in range(0, 32 * n, 32)]
    return [shard + text[i + 2:i + 32] for i in range(0, 32 * n, 32)]


def enroll_webhook(client: redis.Redis, batch_id: str) -> None:
    """Have the webhook dispatcher (:mod:`infra.api.webhooks.delivery`) watch ``batch_id``, whose
    batch record holds ``webhook_url``, until it ends: ``ZADD NX`` into ``rf:webhooks:pending``
    with score 0 (due at once). Call after the batch record is written."""
    client.zadd(keys.WEBHOOKS_PENDING, {batch_id: 0}, nx=True)


def resolve(request: RenderRequest, default_model: str) -> RenderRequest:
    """Fill what the farm assigns: the default model and a random seed (0…2³²−1) when absent."""
    updates: dict[str, Any] = {}
    if request.model is None:
        updates["model"] = default_model
    if request.seed is None:
        updates["seed"] = secrets.randbelow(MAX_SEED + 1)
    return request.model_copy(update=updates) if updates else request


class Submitter:
    """Creates batches: routes every request to a pool, records every job, then puts the jobs in
    their wait lanes, from which the dispatcher (:mod:`infra.broker.dispatch`) publishes them in fair order.

    Args:
        store: the job-state store.
        celery_app: the app whose broker receives the messages (the dispatcher's).
        default_model: model for requests that name none.
        pools: the declared pools (:mod:`infra.pools`); empty = one pool per model.
        upscalers: the upscalers a request may name while no pool is declared (``RENDERFARM_UPSCALERS``).
        loras: the adapters a request may name while no pool is declared (``RENDERFARM_LORAS``).
        controls: the ControlNets a request may name while no pool is declared (``RENDERFARM_CONTROLS``).
        on_enqueued: called with the pools that received jobs (the API wakes its dispatcher).
        quotas: per-tenant quotas on outstanding jobs, GPU-seconds and bytes of job records
            (None: counted, no limit).
        s_per_mpx_step: the cost rate of pools that declare none (:func:`infra.state.quota.job_cost_s`).
        drain_gpu_s_per_s: GPU-seconds the farm finishes per second (its live workers), for
                ``Retry-After`` over a quota.
        claim_s: seconds an idempotency key stays claimed by a submission in flight; a claim
            left by a crashed API frees itself after this (``RENDERFARM_IDEMPOTENCY_CLAIM_S``).
        durable: waits until Redis confirms the writes durable (``RENDERFARM_DURABLE_ACK``);
            None: no wait.
        inputs: resolves the requests' input images (URLs fetched, keys checked) before
            anything else; None: the requests' image references are taken as they are.
    """

    def __init__(self, store: JobStore, celery_app: Celery, default_model: str, client: redis.Redis,
                 idempotency_ttl_s: int = 24 * 3600, pools: Sequence[PoolSpec] = (),
                 on_enqueued: Callable[[set[str]], None] | None = None, quotas: Quotas | None = None,
                 s_per_mpx_step: float = 0.05, drain_gpu_s_per_s: Callable[[], float] | None = None,
                 claim_s: int = 30, durable: DurableAck | None = None,
                 upscalers: Sequence[str] = OFFLINE_UPSCALERS, loras: Sequence[LoraSpec] = (),
                 inputs: InputResolver | None = None, controls: Sequence[ControlSpec] = ()):
        self.store = store
        self.celery_app = celery_app
        self.default_model = default_model
        self.redis = client
        self.idempotency_ttl_s = idempotency_ttl_s
        self.router = Router(pools, upscalers, loras, controls)
        self.on_enqueued = on_enqueued
        self.quotas = quotas if quotas is not None else Quotas(client)
        self.s_per_mpx_step = s_per_mpx_step
        self.drain_gpu_s_per_s = drain_gpu_s_per_s
        self.claim_s = claim_s
        self.durable = durable
        self.inputs = inputs

    def _existing(self, key: str, value: str | None) -> BatchAccepted:
        """The batch an idempotency key names; :class:`SubmissionInFlight` while only claimed."""
        if value is None:  # the claim expired or was withdrawn between two reads: try again
            raise SubmissionInFlight(1)
        if value.startswith(keys.IDEM_CLAIM):
            raise SubmissionInFlight(max(1, min(self.claim_s, self.redis.ttl(key) or 1)))
        if self.durable is not None:
            self.durable.wait()  # a retry after a 503 (not yet durable) waits again
        return BatchAccepted(batch_id=value, job_ids=self.store.batch_job_ids(value))

    def _unclaim(self, key: str | None, claim: str) -> None:
        """Withdraw this submission's claim on its idempotency key (only while it is still ours)."""
        if key is not None:
            self.redis.eval(_UNCLAIM, 1, key, claim)

    def cost_s(self, request: RenderRequest, pool: str) -> float:
        """Estimated GPU-seconds of ``request`` on ``pool`` (its ``s_per_mpx_step``; a video's
        times its frames, :func:`infra.video.frames_factor`)."""
        spec = self.router.spec(pool)
        rate = spec.s_per_mpx_step if spec is not None and spec.s_per_mpx_step else self.s_per_mpx_step
        return request_cost_s(request, rate)

    def _new_jobs(self, batch_id: str, requests: Sequence[RenderRequest], pools: Sequence[str]) -> list[NewJob]:
        """The jobs of ``batch_id`` (ids in its shard) with their quota costs: estimated GPU-seconds
        (computed once per distinct pool, size, steps and strength in the batch), and the bytes of
        each record, measured on the request's JSON exactly as it will be stored."""
        costs: dict[tuple, float] = {}
        jobs = []
        for job_id, request, pool in zip(new_ids(len(requests), keys.shard(batch_id)), requests, pools):
            shape = (pool, request.width, request.height, request.num_inference_steps, request.effective_strength,
                     request.num_frames)
            cost = costs.get(shape)
            if cost is None:
                cost = costs[shape] = self.cost_s(request, pool)
            payload = request.model_dump_json()
            jobs.append(NewJob(job_id, request, pool, cost_s=cost, cost_bytes=job_bytes(payload), request_json=payload))
        return jobs

    def submit(self, requests: Sequence[RenderRequest], *, priority: str = "normal",
               idempotency_key: str | None = None, webhook_url: str | None = None,
               tenant: str = PUBLIC_TENANT) -> BatchAccepted:
        """Submit ``requests`` as one batch owned by ``tenant``; returns its id and the job ids in
        submission order.

        With an ``idempotency_key`` this tenant used in the last ``idempotency_ttl_s`` seconds,
        nothing is submitted and the first batch is returned again (keys are per tenant, so one
        tenant's key never returns another tenant's batch). The key is first claimed for
        ``claim_s`` seconds (``SET NX EX``), then set to the batch id in the batch's own MULTI/EXEC,
        so it never names a batch that does not exist; a duplicate arriving while the claim
        holds raises :class:`SubmissionInFlight` (409 with ``Retry-After``).

        Jobs whose metadata carries a ``catalog_key`` are entered in the tenant's catalog index
        (:mod:`infra.state.catalog_index`); a batch with a ``webhook_url`` is enrolled with the webhook
        dispatcher (:func:`enroll_webhook`).

        ``priority`` is ``high``, ``normal`` or ``low``; the dispatcher ages it and shares each
        pool fairly between tenants.

        Raises:
            InputError: an input image refused (413, 415 or 422 in the API), naming its job and
                field; nothing is recorded or enqueued.
            NoPoolError: some request no declared pool can serve (its model, or its size over
                the pool's ``max_pixels``); nothing is recorded or enqueued.
            NotDurable: Redis did not confirm the batch durable in time (the batch exists: a
                retry with the same idempotency key returns it).
            SubmissionInFlight: another submission with this idempotency key is in flight.
            QuotaExceeded: the tenant's outstanding jobs, GPU-seconds or bytes of job records
                would exceed its quota (429), or this request alone does (413); nothing is recorded
                or enqueued.
        """
        if self.inputs is not None:
            requests = self.inputs.resolve(requests)
        resolved = [resolve(request, self.default_model) for request in requests]
        pools = self.router.route_all(resolved)
        resolved = [with_video_defaults(request, self.router.family(pool, request.model or ""))
                    for request, pool in zip(resolved, pools, strict=True)]
        key = keys.idempotency(tenant, idempotency_key) if idempotency_key is not None else None
        if key is not None and (first := self.redis.get(key)):
            return self._existing(key, first)  # before any quota
        batch_id = new_id(keys.idempotency_shard(tenant, idempotency_key) if idempotency_key is not None else None)
        jobs = self._new_jobs(batch_id, resolved, pools)
        gpu_s = sum(j.cost_s or 0.0 for j in jobs)
        nbytes = sum(j.cost_bytes or 0 for j in jobs)
        drain = self.drain_gpu_s_per_s() if self.drain_gpu_s_per_s is not None else 1.0
        claim = keys.IDEM_CLAIM + batch_id
        if key is not None and not self.redis.set(key, claim, nx=True, ex=self.claim_s):
            return self._existing(key, self.redis.get(key))
        try:
            self.quotas.reserve(tenant, len(jobs), gpu_s, nbytes, batch_id=batch_id, drain_gpu_s_per_s=drain)
        except BaseException:
            self._unclaim(key, claim)
            raise
        try:
            extra = {"webhook_url": webhook_url} if webhook_url else None
            catalog_index.record(self.redis, tenant, batch_id, jobs)  # before the records: see its module
            self.store.create_batch(batch_id, jobs, priority=priority, extra=extra, tenant=tenant,
                                    idempotency=(key, self.idempotency_ttl_s) if key is not None else None)
        except BaseException:
            self._unclaim(key, claim)
            if not self.store.batch_meta(batch_id):
                self.quotas.release(tenant, len(jobs), gpu_s, nbytes, batch_id=batch_id)
            raise
        self.quotas.recorded(tenant, len(jobs), gpu_s, nbytes, batch_id=batch_id)
        if webhook_url:
            enroll_webhook(self.redis, batch_id)
        enqueue(self.redis, [(j.job_id, j.pool) for j in jobs], tenant=tenant, priority=priority,
                ttl_s=self.store.job_ttl_s, costs=[j.cost_s for j in jobs])
        if self.durable is not None:
            self.durable.wait()  # the records, the idempotency key and the lane entries
        if self.on_enqueued is not None:
            self.on_enqueued({j.pool for j in jobs})
        return BatchAccepted(batch_id=batch_id, job_ids=[j.job_id for j in jobs])
