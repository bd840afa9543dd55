"""Idempotency keys on a real status API and redis-server: the key is written in the batch's own
MULTI/EXEC, a duplicate arriving while the first submission is in flight answers 409 with
``Retry-After``, and the claim of a submission that died mid-write frees itself."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from infra import keys

pytestmark = pytest.mark.integration
JOBS = 2000  # large enough that the first submission is still being written when the others arrive


def _body(key: str, n: int = JOBS) -> dict:
    return {
        "idempotency_key": key,
        "jobs": [
            {"prompt": f"idem {i}", "model": "tiny", "width": 64, "height": 64, "num_inference_steps": 2, "seed": i}
            for i in range(n)
        ],
    }


@pytest.fixture
def r(redis_server, api_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url, decode_responses=True)


def test_concurrent_identical_posts_make_one_batch(api_server, r):
    body = _body("concurrent-1")
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def post() -> None:
        start.wait()
        resp = httpx.post(f"{api_server.url}/v1/batches", json=body, timeout=120)
        with lock:
            answers.append(resp)

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(a.status_code for a in answers)
    assert set(codes) <= {202, 409}, codes
    accepted = [a.json() for a in answers if a.status_code == 202]
    assert {a["batch_id"] for a in accepted} and len({a["batch_id"] for a in accepted}) == 1
    assert all(a["job_ids"] == accepted[0]["job_ids"] and len(a["job_ids"]) == JOBS for a in accepted)
    for a in answers:
        if a.status_code == 409:
            assert int(a.headers["Retry-After"]) >= 1
    # the key names the batch, which exists with every job; a retry now gets the same batch
    batch_id = accepted[0]["batch_id"]
    assert r.get(keys.idempotency("public", "concurrent-1")) == batch_id
    assert r.llen(keys.batch_jobs(batch_id)) == JOBS
    again = httpx.post(f"{api_server.url}/v1/batches", json=body, timeout=120)
    assert again.status_code == 202 and again.json() == accepted[0]
    print(f"\nconcurrent identical POSTs: {codes}")


def test_claim_of_a_killed_submission_frees_itself(api_server, r):
    """A claim with no batch (what an API killed between its claim and its MULTI/EXEC leaves)
    answers 409 until it expires; then the same request creates the batch."""
    key = keys.idempotency("public", "killed-1")
    r.set(key, keys.IDEM_CLAIM + "0" * 32, ex=2)
    body = _body("killed-1", 3)
    busy = httpx.post(f"{api_server.url}/v1/batches", json=body)
    assert busy.status_code == 409 and 1 <= int(busy.headers["Retry-After"]) <= 2
    time.sleep(2.2)
    ok = httpx.post(f"{api_server.url}/v1/batches", json=body)
    assert ok.status_code == 202 and len(ok.json()["job_ids"]) == 3
    assert r.get(key) == ok.json()["batch_id"] and r.ttl(key) > 3600
    assert httpx.post(f"{api_server.url}/v1/batches", json=body).json() == ok.json()
