"""Pools, priorities and the autoscaling signal on real processes: a status API with declared
pools (its own Redis database of the session's redis-server), and ``null``-model workers.

Pools: ``null-small`` (≤ 64×64, one fast worker, batch 8), ``null-big`` (≤ 128×128, one slow
worker: 0.5 s per step, batch 4) and ``null-huge`` (≤ 256×256, no worker until a test starts
one). All serve the model ``null``, so the size alone picks the pool.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from infra import keys
from infra.api.auth import KeyStore
from infra.broker.app import make_celery
from infra.broker.dispatch import broker_depth
from infra.broker.lanes import backlog
from infra.localstack import ApiServer, WorkerProcess, free_port, start_workers
from infra.settings import Settings

pytestmark = pytest.mark.integration
DB = 3
POOLS = [
    {"name": "null-small", "model": "null", "device_class": "cpu", "max_pixels": 64 * 64, "max_batch": 8,
     "queue": "renderfarm.null-small"},
    {"name": "null-big", "model": "null", "device_class": "cpu", "max_pixels": 128 * 128, "max_batch": 4,
     "queue": "renderfarm.null-big"},
    {"name": "null-huge", "model": "null", "device_class": "cpu", "max_pixels": 256 * 256, "max_batch": 8,
     "queue": "renderfarm.null-huge"},
]


def job(i: int, size: int = 64, steps: int = 1) -> dict:
    return {"prompt": f"pool test {i}", "model": "null", "width": size, "height": size,
            "num_inference_steps": steps, "seed": i}


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps(POOLS),
            "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5", "RENDERFARM_PRIORITY_AGING_S": "1"}


@pytest.fixture(scope="module")
def r(redis_server, env):
    client = redis_server.client(DB)
    yield client
    client.flushdb()


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-pools", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def workers(api, env, run_dir) -> Iterator[dict[str, WorkerProcess]]:
    procs = {
        "null-small": WorkerProcess("null", env, "pools-small", 8, extra_args=["--pool", "null-small"],
                                    run_dir=run_dir),
        # the serial worker: "running" is exactly the batch it renders (an overlapped worker also
        # holds the started batches waiting for its render thread), so the depth test below can
        # place every job in one column
        "null-big": WorkerProcess("null", {**env, "RENDERFARM_TEST_STEP_DELAY_S": "0.5",
                                           "RENDERFARM_WORKER_OVERLAP": "false"}, "pools-big", 4,
                                  extra_args=["--pool", "null-big"], run_dir=run_dir),
    }
    try:
        start_workers(list(procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def tenants(api, r) -> Iterator[dict[str, httpx.Client]]:
    keys = KeyStore(r)
    clients = {name: httpx.Client(base_url=api.url, headers={"X-API-Key": keys.create(name)[1]}, timeout=60)
               for name in ("alice", "bob", "carol")}
    yield clients
    for client in clients.values():
        client.close()


def _farm_state(r) -> tuple:
    jobs = sum(1 for _ in r.scan_iter(match="rf:job:*", count=1000))
    return jobs, sum(n for n, _ in backlog(r).values()), sum(broker_depth(r, p["name"]) for p in POOLS)


def _jobs(client: httpx.Client, batch_id: str) -> list[dict]:
    out, offset = [], 0
    while offset is not None:
        page = client.get(f"/v1/batches/{batch_id}", params={"offset": offset, "limit": 1000}).json()
        out += page["jobs"]
        offset = page["next_offset"]
    return out


def _wait_done(client: httpx.Client, batch_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/batches/{batch_id}", params={"limit": 0}).json()
        if status["done"]:
            return status
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not done after {timeout}s: {status['counts']}")


def test_a_request_no_pool_can_serve_is_422_and_nothing_is_recorded(api, r):
    before = _farm_state(r)
    one = httpx.post(f"{api.url}/v1/jobs", json={"prompt": "x", "model": "tiny", "width": 64, "height": 64})
    assert one.status_code == 422
    detail = one.json()["detail"][0]
    assert detail["loc"] == ["body", "model"] and detail["type"] == "no_pool_for_model"
    assert "no declared pool serves model 'tiny'" in detail["msg"]
    many = httpx.post(f"{api.url}/v1/batches", json={"jobs": [job(1), job(2, size=512)]})
    assert many.status_code == 422
    detail = many.json()["detail"]
    assert len(detail) == 1 and detail[0]["loc"] == ["body", "jobs", 1] and detail[0]["type"] == "over_max_pixels"
    assert "512×512 = 262,144 pixels is over max_pixels 65,536 of pool 'null-huge'" in detail[0]["msg"]
    assert _farm_state(r) == before


def test_a_job_for_a_pool_without_workers_waits_for_one_and_runs_when_it_comes(api, workers, env, run_dir, r):
    accepted = httpx.post(f"{api.url}/v1/batches", json={"jobs": [job(1), job(2, size=256)]}).json()
    small, huge = (httpx.get(f"{api.url}/v1/jobs/{j}").json() for j in accepted["job_ids"])
    assert small["pool"] == "null-small" and huge["pool"] == "null-huge"
    assert huge["state"] == "queued" and huge["waiting_for"] == "a worker of pool null-huge"
    row = httpx.get(f"{api.url}/v1/queues/null-huge").json()
    assert row["workers"] == 0 and row["queued"] == row["outstanding"] == 1 and row["oldest_wait_s"] > 0
    assert broker_depth(r, "null-huge") == 0          # waits in its lane: LLEN alone would read 0
    worker = WorkerProcess("null", env, "pools-huge", 8, extra_args=["--pool", "null-huge"], run_dir=run_dir)
    with worker:                                      # "scale from zero"
        worker.wait_ready()
        status = _wait_done(httpx.Client(base_url=api.url), accepted["batch_id"], timeout=60)
    assert status["counts"]["succeeded"] == 2
    assert httpx.get(f"{api.url}/v1/jobs/{accepted['job_ids'][1]}").json()["waiting_for"] is None


def test_another_tenants_ten_interactive_jobs_start_ahead_of_a_2000_job_catalog(workers, tenants):
    alice, bob = tenants["alice"], tenants["bob"]
    catalog = [alice.post("/v1/batches", json={"jobs": [job(i) for i in range(k, k + 1000)], "priority": p}).json()
               for k, p in ((0, "normal"), (1000, "low"))]
    interactive = bob.post("/v1/batches", json={"jobs": [job(i) for i in range(10)], "priority": "high"}).json()
    try:
        _wait_done(bob, interactive["batch_id"])
        bob_jobs = _jobs(bob, interactive["batch_id"])
        alice_starts = sorted(j["started_at"] for b in catalog for j in _jobs(alice, b["batch_id"]) if j["started_at"])
        positions = sorted(sum(s < j["started_at"] for s in alice_starts) for j in bob_jobs)
        print(f"\nbob's 10 high jobs started after {positions} of alice's 2,000 "
              f"({len(alice_starts)} of alice's had started when bob's last one finished)")
        # ahead of bob: what the worker had prefetched (16) and the broker queue held (2 × 8)
        # when he submitted, then a share of 2 of every 3 slots
        assert max(positions) <= 80, positions
    finally:
        for b in catalog:
            alice.delete(f"/v1/batches/{b['batch_id']}")


def test_low_jobs_make_progress_while_high_load_persists(workers, tenants):
    carol = tenants["carol"]
    batches = [carol.post("/v1/batches", json={"jobs": [job(i) for i in range(200)], "priority": "high"}).json()]
    low = carol.post("/v1/batches", json={"jobs": [job(i) for i in range(30)], "priority": "low"}).json()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:             # high keeps coming, faster than one worker renders
            batches.append(carol.post("/v1/batches", json={"jobs": [job(i) for i in range(40)],
                                                           "priority": "high"}).json())
            if carol.get(f"/v1/batches/{low['batch_id']}", params={"limit": 0}).json()["done"]:
                break
            time.sleep(0.5)
        low_jobs = _jobs(carol, low["batch_id"])
        assert all(j["state"] == "succeeded" for j in low_jobs), "low jobs starved"
        last_low = max(j["started_at"] for j in low_jobs)
        high = [j for b in batches for j in _jobs(carol, b["batch_id"])]
        overtaken = [j for j in high if j["created_at"] < last_low and (j["started_at"] or "9") > last_low]
        print(f"\n30 low jobs all started while {len(overtaken)} earlier-submitted high jobs still waited "
              f"({len(high)} high submitted)")
        assert overtaken
    finally:
        for b in batches:
            carol.delete(f"/v1/batches/{b['batch_id']}")


def test_outstanding_counts_what_workers_hold_where_llen_does_not(api, workers, env, r):
    """The slow worker renders one batch of 4 (running: acked only when done); a second consumer
    pulls 3 messages without acking them, as a worker's prefetch does (reserved: in kombu's
    ``unacked`` hash). Neither is in the broker list, so LLEN misses 7 of the 12 jobs."""
    accepted = httpx.post(f"{api.url}/v1/batches", json={"jobs": [job(i, size=128, steps=20) for i in range(12)]})
    batch_id = accepted.json()["batch_id"]
    app = make_celery(Settings(redis_url=env["RENDERFARM_REDIS_URL"]))
    try:
        deadline = time.monotonic() + 30
        row, depth = {}, 0
        # the worker took its batch of 4 from the 8 dispatched (2 × its batch size), and the API's
        # dispatcher has topped the Celery queue up to 8 again (every 0.2 s): only then are all 8
        # queued jobs in the broker list, which the counts below take as their start
        while time.monotonic() < deadline and not (row.get("running") == 4 and row.get("outstanding") == 12
                                                   and depth == 8):
            time.sleep(0.2)
            row = httpx.get(f"{api.url}/v1/queues/null-big").json()
            depth = broker_depth(r, "null-big")
        assert row["running"] == 4 and row["queued"] == 8 and row["outstanding"] == 12, str(row)
        assert depth == 8, depth
        with app.connection_for_read() as conn:
            held = [conn.default_channel.basic_get(keys.queue("null-big")) for _ in range(3)]
            assert all(m is not None for m in held)
            row = httpx.get(f"{api.url}/v1/queues/null-big").json()
            llen = broker_depth(r, "null-big")
            metrics = httpx.get(f"{api.url}/metrics").text
            listed = next(x for x in httpx.get(f"{api.url}/v1/queues").json() if x["pool"] == "null-big")
        # leaving the block closes the channel: kombu puts the 3 unacked messages back
        print(f"\nnull-big: {row}; broker LLEN {llen}")
        assert (row["queued"], row["reserved"], row["running"], row["outstanding"]) == (5, 3, 4, 12), row
        assert llen == 5 and listed["outstanding"] == 12 and row["oldest_wait_s"] > 0
        assert 'renderfarm_outstanding_jobs{pool="null-big"} 12.0' in metrics
        time.sleep(0.5)
        assert httpx.get(f"{api.url}/v1/queues/null-big").json()["outstanding"] == 12
    finally:
        app.close()
        httpx.delete(f"{api.url}/v1/batches/{batch_id}")
