"""Limits: request body size (413), per-tenant token buckets for requests and jobs (429 with
Retry-After; a batch larger than the job burst is a 413)."""

from __future__ import annotations

import math
import secrets
import time

import httpx
import pytest

from infra.api.limits import Bucket, RateLimited, RateLimiter
from infra.schemas import BatchSubmission, RenderRequest
from infra.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def limiter(redis_server) -> RateLimiter:
    return RateLimiter(redis_server.client(), requests=Bucket("requests", 10.0, 5), jobs=Bucket("jobs", 100.0, 1000))


def test_bucket_allows_the_burst_then_refuses_with_the_wait(limiter):
    tenant = f"t{secrets.token_hex(4)}"
    left = [limiter.charge_request(tenant) for _ in range(5)]
    assert left == pytest.approx([4, 3, 2, 1, 0], abs=0.2)
    with pytest.raises(RateLimited) as info:
        limiter.charge_request(tenant)
    assert 0 < info.value.retry_after_s <= 0.1 + 1e-6 and info.value.retry_after_header == "1"
    assert info.value.response().status_code == 429 and info.value.response().headers["Retry-After"] == "1"
    time.sleep(0.25)  # 10 tokens/s refill: two more requests fit
    limiter.charge_request(tenant)
    limiter.charge_request(tenant)


def test_tenants_and_buckets_are_independent(redis_server):
    # a slow refill (one request token per 100 s), so that a loaded machine cannot refill a token
    # between the five charges and the sixth
    limiter = RateLimiter(redis_server.client(), requests=Bucket("requests", 0.01, 5),
                          jobs=Bucket("jobs", 100.0, 1000))
    a, b = f"a{secrets.token_hex(4)}", f"b{secrets.token_hex(4)}"
    for _ in range(5):
        limiter.charge_request(a)
    with pytest.raises(RateLimited):
        limiter.charge_request(a)
    limiter.charge_request(b)
    assert limiter.charge_jobs(a, 999) == pytest.approx(1, abs=0.5)


def test_cost_over_the_burst_can_never_succeed(limiter):
    with pytest.raises(RateLimited) as info:
        limiter.charge_jobs("big", 1001)
    assert info.value.retry_after_s is None and info.value.response().status_code == 413
    assert "split the submission" in str(info.value)


def test_rate_zero_means_unlimited(redis_server):
    free = RateLimiter(redis_server.client(), requests=Bucket("requests", 0, 1), jobs=Bucket("jobs", 0, 1))
    assert all(free.charge_jobs("free", 10**6) == math.inf for _ in range(3))


def test_bucket_state_expires(limiter, redis_server):
    tenant = f"e{secrets.token_hex(4)}"
    limiter.charge_request(tenant)
    ttl_ms = redis_server.client().pttl(f"rf:rl:{tenant}:requests")
    assert 0 < ttl_ms <= 1100 + 100  # one token to refill at 10/s, plus a second of slack


# -- over HTTP, on the tight API (2 requests/s, burst 10; 1 job/s, burst 5; 64 KiB bodies) -----------


def test_request_flood_gets_429_with_retry_after(tight_api, make_tenant):
    flooder = make_tenant(f"flood{secrets.token_hex(3)}", tight_api.url)
    other = make_tenant(f"calm{secrets.token_hex(3)}", tight_api.url)
    codes = [flooder.http.get("/v1/queues") for _ in range(30)]
    statuses = [r.status_code for r in codes]
    assert statuses[:9] == [200] * 9 and statuses[-1] == 429, statuses
    limited = codes[-1]
    assert int(limited.headers["Retry-After"]) >= 1 and "limit" in limited.json()["detail"]
    assert other.http.get("/v1/queues").status_code == 200
    assert all(httpx.get(tight_api.url + "/healthz").status_code == 200 for _ in range(12))
    time.sleep(int(limited.headers["Retry-After"]))
    assert flooder.http.get("/v1/queues").status_code == 200


def test_jobs_are_counted_per_job(tight_api, make_tenant, job_body):
    tenant = make_tenant(f"jobs{secrets.token_hex(3)}", tight_api.url)
    assert tenant.http.post("/v1/batches", json={"jobs": [job_body] * 5}).status_code == 202
    limited = tenant.http.post("/v1/jobs", json=job_body)
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    too_big = tenant.http.post("/v1/batches", json={"jobs": [job_body] * 6})
    assert too_big.status_code == 413 and "burst of 5 jobs" in too_big.json()["detail"]
    time.sleep(int(limited.headers["Retry-After"]) + 0.1)
    assert tenant.http.post("/v1/jobs", json=job_body).status_code == 202


def test_large_bodies_get_413(tight_api, make_tenant):
    tenant = make_tenant(f"body{secrets.token_hex(3)}", tight_api.url)
    big = b'{"prompt": "' + b"x" * (65 * 1024) + b'"}'
    declared = tenant.http.post("/v1/jobs", content=big, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    chunked = tenant.http.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    just_under = b'{"prompt": "' + b"x" * (60 * 1024) + b'"}'
    assert tenant.http.post("/v1/jobs", content=just_under,
                            headers={"Content-Type": "application/json"}).status_code == 422
    # without a key: a declared oversize body is refused on its Content-Length (413) and a
    # small one on the missing key (401); neither is read
    assert httpx.post(tight_api.url + "/v1/jobs", content=big).status_code == 413
    assert httpx.post(tight_api.url + "/v1/jobs", content=just_under).status_code == 401


def test_default_body_limit_fits_10000_typical_jobs():
    typical = RenderRequest(
        prompt="a photograph of an astronaut riding a horse on the moon, highly detailed, dramatic lighting",
        negative_prompt="blurry, low quality, watermark", model="stabilityai/sd-turbo", seed=4_000_000_000,
        metadata={"catalog_id": "sku-000123", "row": "123"})
    # as RenderClient.submit_batch sends it: unset optional fields (null) are left out
    body = BatchSubmission(jobs=[typical] * 10_000, idempotency_key="k" * 64)
    size = len(body.model_dump_json(exclude_none=True))
    limit = Settings().max_body_bytes
    assert size < 3_900_000 < limit and limit >= 4 * size  # ~3.7 MB; room for 4x longer prompts
