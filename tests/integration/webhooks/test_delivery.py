"""Webhook delivery on batch completion (infra/api/webhooks/delivery.py) through two API replicas and a local
receiver: one signed POST per finished batch, retries with backoff, the SSRF policy re-checked
at delivery time, and giving up after the last attempt."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from infra import keys
from infra.api.webhooks.delivery import WebhookDispatcher
from infra.api.webhooks.signing import tenant_secret, verify_signature
from infra.schemas import JobError, JobResult, RenderRequest
from infra.state.job_store import JobStore, NewJob
from infra.submission.submitter import enroll_webhook

from .conftest import UNSERVED_MODEL

pytestmark = pytest.mark.integration
JOB = {"prompt": "a lighthouse", "model": UNSERVED_MODEL, "width": 64, "height": 64, "num_inference_steps": 2}


def _submit(api, n: int, url: str) -> tuple[str, list[str]]:
    r = httpx.post(f"{api.url}/v1/batches", json={"jobs": [JOB] * n, "webhook_url": url}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["batch_id"], r.json()["job_ids"]


def _end(store: JobStore, job_ids: list[str], states: list[str]) -> None:
    """Finish queued jobs as a worker (or a cancel) would: ``succeeded``, ``failed`` or ``canceled``."""
    for job_id, state in zip(job_ids, states):
        if state == "canceled":
            assert store.cancel(job_id)
            continue
        started = store.start_many([job_id], "pytest-webhooks")[job_id]
        if state == "succeeded":
            assert store.succeed(started, JobResult(key=f"{started.batch_id}/{job_id}.png", width=64, height=64,
                                                    seed=started.request.seed, content_type="image/png", bytes=8))
        else:
            assert store.fail(started, JobError(type="ValueError", message="poison"))  # no retry: it fails


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def test_one_signed_post_per_finished_batch_across_two_replicas(webhook_apis, webhook_store, receiver):
    path = f"/hook/{uuid.uuid4().hex[:8]}"
    plans = {1: ["succeeded"], 2: ["succeeded", "failed"], 3: ["succeeded", "canceled", "succeeded"]}
    batches = {}
    for n, states in plans.items():
        batch_id, job_ids = _submit(webhook_apis[n % 2], n, receiver.url(path))
        batches[batch_id] = states
        _end(webhook_store, job_ids, states)
    unfinished, (still_queued, *_) = _submit(webhook_apis[0], 2, receiver.url(path))
    _end(webhook_store, [still_queued], ["succeeded"])  # one of its two jobs is still queued

    calls = _wait_for(lambda: len(receiver.calls_to(path)) >= 3 and receiver.calls_to(path))
    time.sleep(2.0)  # ten more polls of both replicas: no second POST, none for the unfinished batch
    calls = receiver.calls_to(path)
    assert len(calls) == 3
    seen = {}
    for call in calls:
        h = call.headers
        assert verify_signature(tenant_secret(webhook_store.r, "public"), h, call.body)
        assert h["webhook-id"] == json.loads(call.body)["batch_id"]
        assert h["content-type"] == "application/json" and h["x-renderfarm-attempt"] == "1"
        body = json.loads(call.body)
        assert body["event"] == "batch.finished" and h["x-renderfarm-delivery"] == body["batch_id"]
        seen[body["batch_id"]] = body
    assert set(seen) == set(batches) and unfinished not in seen
    for batch_id, states in batches.items():
        body = seen[batch_id]
        assert body["total"] == len(states) and body["finished_at"] and body["created_at"]
        assert body["counts"] == {s: states.count(s) for s in ("queued", "running", "succeeded", "failed", "canceled")}
        assert webhook_store.r.hget(keys.webhook(batch_id), "status") == "delivered"
    assert not webhook_store.r.zscore(keys.WEBHOOKS_PENDING, next(iter(batches)))


def test_a_receiver_failing_twice_gets_it_on_the_third_attempt(webhook_apis, webhook_store, receiver):
    path = f"/flaky/{uuid.uuid4().hex[:8]}"
    receiver.fail_first[path] = 2
    batch_id, job_ids = _submit(webhook_apis[0], 1, receiver.url(path))
    _end(webhook_store, job_ids, ["succeeded"])
    calls = _wait_for(lambda: len(receiver.calls_to(path)) >= 3 and receiver.calls_to(path))
    time.sleep(1.0)
    calls = receiver.calls_to(path)
    assert [c.headers["x-renderfarm-attempt"] for c in calls] == ["1", "2", "3"]
    assert len({c.body for c in calls}) == 1  # the same body every attempt, freshly signed each time
    assert all(verify_signature(tenant_secret(webhook_store.r, "public"), c.headers, c.body) for c in calls)
    gaps = [b.at - a.at for a, b in zip(calls, calls[1:])]
    assert gaps[0] >= 0.3 * 0.9 and gaps[1] >= 0.6 * 0.9, gaps  # backoff 0.3 s, doubling
    state = webhook_store.r.hgetall(keys.webhook(batch_id))
    assert state["status"] == "delivered" and state["attempts"] == "3" and state["response_status"] == "204"


# ---- the dispatcher in-process, on its own Redis database -----------------------------------
@pytest.fixture
def store6(redis_server) -> JobStore:
    client = redis_server.client(db=6)
    client.flushdb()
    return JobStore(client)


def _ended_batch(store: JobStore, url: str) -> str:
    batch_id = uuid.uuid4().hex
    job = NewJob(uuid.uuid4().hex, RenderRequest(**JOB, seed=1), UNSERVED_MODEL)
    store.create_batch(batch_id, [job], extra={"webhook_url": url})
    enroll_webhook(store.r, batch_id)
    store.cancel(job.job_id)
    return batch_id


def test_the_policy_is_checked_again_at_delivery(store6, receiver):
    path = f"/ssrf/{uuid.uuid4().hex[:8]}"
    batch_id = _ended_batch(store6, receiver.url(path))  # accepted by an API that allowed private hosts
    dispatcher = WebhookDispatcher(store6.r, allow_private=False, backoff_s=0.05)
    try:
        assert dispatcher.poll(wait=True) == [batch_id]
    finally:
        dispatcher.stop()
    state = store6.r.hgetall(keys.webhook(batch_id))
    assert state["status"] == "failed" and "loopback" in state["last_error"] and state["attempts"] == "1"
    assert receiver.calls_to(path) == [] and store6.r.zcard(keys.WEBHOOKS_PENDING) == 0


def test_gives_up_after_the_last_attempt_and_a_second_dispatcher_never_resends(store6, receiver):
    path = f"/down/{uuid.uuid4().hex[:8]}"
    receiver.fail_first[path] = 100
    batch_id = _ended_batch(store6, receiver.url(path))
    one = WebhookDispatcher(store6.r, allow_private=True, max_attempts=2, backoff_s=1.0)
    two = WebhookDispatcher(store6.r, allow_private=True, max_attempts=2, backoff_s=1.0)
    try:
        assert one.poll(wait=True) == [batch_id]
        assert two.poll(wait=True) == []        # not due yet: the retry waits its backoff
        time.sleep(1.1)
        assert two.poll(wait=True) == [batch_id]
        assert one.deliver(batch_id) is None    # recorded as given up: nobody sends it again
    finally:
        one.stop()
        two.stop()
    state = store6.r.hgetall(keys.webhook(batch_id))
    assert state["status"] == "failed" and state["last_error"] == "HTTP 500" and state["attempts"] == "2"
    assert len(receiver.calls_to(path)) == 2 and store6.r.zcard(keys.WEBHOOKS_PENDING) == 0


def test_one_tenants_unfinished_batches_do_not_block_another_and_each_tenant_signs_with_its_own(store6, receiver):
    """1,200 unfinished webhook batches of one tenant (more than one poll's window of 1,000) do
    not keep another tenant's ended batch from being delivered at the next poll; the delivery is
    signed with that tenant's own secret, which the flooding tenant's secret does not verify."""
    path = f"/fair/{uuid.uuid4().hex[:8]}"
    for i in range(1200):
        batch_id = uuid.uuid4().hex
        store6.create_batch(batch_id, [NewJob(uuid.uuid4().hex, RenderRequest(**JOB, seed=i), UNSERVED_MODEL)],
                            extra={"webhook_url": receiver.url("/never")}, tenant="flood")
        enroll_webhook(store6.r, batch_id)
    calm = "f" * 8 + uuid.uuid4().hex[8:]  # sorts after every flooding batch of the same score
    job = NewJob(uuid.uuid4().hex, RenderRequest(**JOB, seed=1), UNSERVED_MODEL)
    store6.create_batch(calm, [job], extra={"webhook_url": receiver.url(path)}, tenant="calm")
    enroll_webhook(store6.r, calm)
    store6.cancel(job.job_id)
    dispatcher = WebhookDispatcher(store6.r, allow_private=True, poll_s=0.2, recheck_s=60, batch_limit=1000)
    try:
        started = [b for _ in range(2) for b in dispatcher.poll(wait=True)]
    finally:
        dispatcher.stop()
    assert started == [calm]
    (call,) = receiver.calls_to(path)
    calm_secret, flood_secret = tenant_secret(store6.r, "calm"), tenant_secret(store6.r, "flood")
    assert calm_secret != flood_secret
    assert verify_signature(calm_secret, call.headers, call.body)
    assert not verify_signature(flood_secret, call.headers, call.body)
    assert receiver.calls_to("/never") == []
