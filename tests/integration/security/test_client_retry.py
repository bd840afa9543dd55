"""RenderClient's retry policy against a real API: a 429 is waited out for its ``Retry-After``,
an API that is down when a call starts is reconnected to, and only safe requests are repeated."""

from __future__ import annotations

import time

import httpx
import pytest

from infra.localstack import ApiServer, free_port
from infra.schemas import RenderRequest
from producer.client import RenderClient, RenderFarmError, RetryPolicy

pytestmark = pytest.mark.integration


@pytest.fixture
def requests(job_body):
    """``requests(n)``: n valid requests for a model no worker serves (they stay queued)."""
    return lambda n, start=0: [RenderRequest(**{**job_body, "prompt": f"retry {i}"}) for i in range(start, start + n)]


def test_a_429_is_waited_out_for_its_retry_after_and_submits_once(tight_api, make_tenant, store, requests):
    tenant = make_tenant("retry-429", tight_api.url)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    with RenderClient(api_url=tight_api.url, api_key=tenant.key, sleep=sleep) as client:
        first = client.submit_batch(requests(5))                # the whole job burst (5)
        second = client.submit_batch(requests(2, start=5))      # 429 until 2 tokens refill
    assert waits and all(w >= 1 for w in waits[:1]), waits                # Retry-After, whole seconds
    assert len(first.job_ids) == 5 and len(second.job_ids) == 2
    # one batch per call: the waits did not submit anything twice
    assert [j.job_id for j in store.get_jobs(second.job_ids)] == second.job_ids
    assert client.retry.attempts == RetryPolicy().attempts


def test_without_retries_the_429_reaches_the_caller(tight_api, make_tenant, requests):
    tenant = make_tenant("retry-off", tight_api.url)
    with RenderClient(api_url=tight_api.url, api_key=tenant.key, retry=RetryPolicy(attempts=1)) as client:
        client.submit_batch(requests(5))
        with pytest.raises(RenderFarmError) as info:
            client.submit_batch(requests(1, start=5))
    assert info.value.status_code == 429 and info.value.retry_after is not None


def test_an_api_that_comes_back_is_reconnected_to(farm_env, run_dir, requests):
    """The API is down when the call starts (connection refused); it starts during the client's
    first backoff, and the same call then succeeds."""
    port = free_port()
    api = ApiServer(port, farm_env, name="api-retry", run_dir=run_dir)
    waits: list[float] = []

    def start_api_while_waiting(seconds: float) -> None:
        waits.append(seconds)
        if not api.running:
            api.start().wait_ready()

    try:
        with RenderClient(api_url=api.url, sleep=start_api_while_waiting) as client:
            accepted = client.submit_batch(requests(1))
            assert client.job(accepted.job_ids[0]).state == "queued"  # no worker serves its model
    finally:
        api.stop()
    assert waits[0] == RetryPolicy().backoff_s


@pytest.mark.parametrize("exc, idempotent, expected", [
    (RenderFarmError(429, "slow down", 1.0), False, True),     # nothing was accepted
    (RenderFarmError(503, "restarting"), True, True),
    (RenderFarmError(503, "restarting"), False, False),        # a POST /v1/jobs may have been accepted
    (RenderFarmError(422, "bad"), True, False),                # the request's own fault
    (httpx.ConnectError("refused"), False, True),              # never reached the API
    (httpx.ReadTimeout("lost"), False, False),                 # reached it: the answer was lost
    (httpx.ReadTimeout("lost"), True, True),
])
def test_what_is_retried(exc, idempotent, expected):
    assert RetryPolicy().should_retry(exc, idempotent) is expected
