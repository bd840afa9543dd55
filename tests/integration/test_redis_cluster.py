"""The farm with its job-state store on a Redis Cluster: three ``redis-server --cluster-enabled
yes`` masters on this machine (``redis-cli --cluster create``), the Celery broker on a plain
redis-server of its own (kombu's Redis transport cannot run on a cluster), a status API and a
``null``-model worker, configured by ``RENDERFARM_STATE_REDIS_URL=redis+cluster://…``.

The farm path on it: two tenants' batches rendered with their images, a batch canceled while it
waits in a pool without workers (and pruned from its lanes), a poison request in the tenant's
dead-letter page and retried, a lost worker's job requeued by the API's reaper, and the queue
depths. Any command or script whose keys span slots would fail here with CROSSSLOT.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra import keys
from infra.api.auth import KeyStore
from infra.localstack import ApiServer, RedisServer, WorkerProcess, free_port, start_workers
from infra.state import shards
from infra.state.connect import state_client
from infra.state.job_store import JobStore
from infra.state.quota import Quotas

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")]
POISON = "poison-pill-cluster"
TIMEOUT_S = 120.0


def _cluster_ok(port: int) -> bool:
    out = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                         timeout=10).stdout
    return "cluster_state:ok" in out


@pytest.fixture(scope="module")
def cluster(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Three cluster masters on free ports, their slots assigned, ``cluster_state:ok`` on each."""
    base = tmp_path_factory.mktemp("cluster")
    nodes = []
    for i in range(3):
        port = free_port(offset_free=10000)  # the cluster bus listens on port + 10000
        while port > 55535:
            port = free_port(offset_free=10000)
        nodes.append(RedisServer(port, dir=base / f"node{i}", name=f"redis-cluster-{i}", run_dir=run_dir,
                                 extra_args=["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                             "--cluster-node-timeout", "5000"]))
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_ready()
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while not all(_cluster_ok(n.port) for n in nodes):
            assert time.monotonic() < deadline, "the cluster never reached cluster_state:ok"
            time.sleep(0.2)
        yield [n.port for n in nodes]
    finally:
        for node in reversed(nodes):
            node.stop()


@pytest.fixture(scope="module")
def broker(run_dir: Path) -> Iterator[RedisServer]:
    with RedisServer(free_port(), name="redis-broker", run_dir=run_dir) as server:
        yield server


@pytest.fixture(scope="module")
def env(farm_env, cluster, broker) -> dict[str, str]:
    return {**farm_env, "RENDERFARM_REDIS_URL": broker.url,
            "RENDERFARM_STATE_REDIS_URL": f"redis+cluster://127.0.0.1:{cluster[0]}",
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5",
            "RENDERFARM_REAPER_INTERVAL_S": "0.5", "RENDERFARM_TEST_POISON_PROMPT": POISON}


@pytest.fixture(scope="module")
def state(env) -> Iterator:
    client = state_client(env["RENDERFARM_STATE_REDIS_URL"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-cluster", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def worker(api, env, run_dir) -> Iterator[WorkerProcess]:
    proc = WorkerProcess("null", env, "cluster-null", 8, run_dir=run_dir)
    try:
        start_workers([proc])
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tenants(api, state) -> Iterator[dict[str, httpx.Client]]:
    store = KeyStore(state)
    clients = {name: httpx.Client(base_url=api.url, headers={"X-API-Key": store.create(name)[1]}, timeout=60)
               for name in ("alice", "bob")}
    yield clients
    for client in clients.values():
        client.close()


def job(i: int, prompt: str = "cluster test", model: str = "null") -> dict:
    return {"prompt": f"{prompt} {i}", "model": model, "width": 64, "height": 64, "num_inference_steps": 1, "seed": i}


def submit(client: httpx.Client, requests: list[dict], **extra) -> dict:
    r = client.post("/v1/batches", json={"jobs": requests, **extra})
    assert r.status_code == 202, r.text
    return r.json()


def wait_done(client: httpx.Client, batch_id: str) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        status = client.get(f"/v1/batches/{batch_id}", params={"limit": 100}).json()
        if status["done"]:
            return status
        assert time.monotonic() < deadline, status["counts"]
        time.sleep(0.3)


def test_two_tenants_batches_render_with_their_images(tenants, worker, state):
    accepted = {"alice": submit(tenants["alice"], [job(i) for i in range(25)], idempotency_key="alice-1"),
                "bob": submit(tenants["bob"], [job(100 + i) for i in range(25)])}
    # the idempotency key returns the same batch (its key shares the batch's slot)
    again = submit(tenants["alice"], [job(i) for i in range(25)], idempotency_key="alice-1")
    assert again["batch_id"] == accepted["alice"]["batch_id"]
    for tenant, batch in accepted.items():
        assert all(keys.shard(j) == keys.shard(batch["batch_id"]) for j in batch["job_ids"])
        status = wait_done(tenants[tenant], batch["batch_id"])
        assert status["counts"]["succeeded"] == 25, status["counts"]
        for item in status["jobs"]:
            image = httpx.get(item["result"]["url"], timeout=60)  # presigned GET of the object in S3
            assert image.status_code == 200 and image.content[:8] == b"\x89PNG\r\n\x1a\n", image.status_code
    # a tenant never sees the other's batch
    assert tenants["bob"].get(f"/v1/batches/{accepted['alice']['batch_id']}").status_code == 404
    store = JobStore(state)
    assert not shards.members(state, keys.leases) and not shards.members(state, keys.pending)
    assert {b.batch_id for b in store.recent_batches("alice")} == {accepted["alice"]["batch_id"]}
    # every ended job gave its quota back to its shard's counter: the tenant's own hash still holds
    # the 25 jobs (and their bytes) reserved, the shards −25, nothing outstanding
    for tenant in ("alice", "bob"):
        assert state.hget(keys.quota(tenant), "jobs") == "25"
        assert int(state.hget(keys.quota(tenant), "bytes")) > 25 * 2560  # each record's bytes were counted
        assert [round(x, 6) for x in Quotas(state).usage(tenant)] == [0, 0, 0]
    throughput = tenants["alice"].get("/v1/throughput", params={"minutes": 5}).json()
    assert sum(throughput["pools"]["null"]) == 50, throughput  # the worker's metrics were recorded


def test_cancel_a_batch_waiting_in_a_pool_without_workers(tenants, worker):
    batch = submit(tenants["bob"], [job(i, model="tiny") for i in range(10)])  # pool "tiny": no worker
    r = tenants["bob"].delete(f"/v1/batches/{batch['batch_id']}")
    assert r.status_code == 200, r.text
    status = wait_done(tenants["bob"], batch["batch_id"])
    assert status["counts"]["canceled"] == 10
    deadline = time.monotonic() + TIMEOUT_S
    while (row := tenants["bob"].get("/v1/queues/tiny").json())["queued"]:  # the dispatcher prunes its lanes
        assert time.monotonic() < deadline, row
        time.sleep(0.3)
    rows = {row["pool"]: row for row in tenants["bob"].get("/v1/queues").json()}
    assert rows["null"]["workers"] == 1 and rows["null"]["outstanding"] == 0, rows
    assert rows.get("tiny", {"outstanding": 0})["outstanding"] == 0, rows  # an idle pool may drop out of the list


def test_poison_request_is_a_dead_letter_of_its_tenant(tenants, worker):
    batch = submit(tenants["alice"], [job(0, "fine"), job(1, POISON), job(2, "fine")])
    status = wait_done(tenants["alice"], batch["batch_id"])
    assert status["counts"]["succeeded"] == 2 and status["counts"]["failed"] == 1, status["counts"]
    poisoned = batch["job_ids"][1]
    page = tenants["alice"].get("/v1/dead-letter").json()
    assert [j["job_id"] for j in page["jobs"]] == [poisoned]
    assert tenants["bob"].get("/v1/dead-letter").json()["jobs"] == []
    assert tenants["alice"].post(f"/v1/dead-letter/{poisoned}/retry").status_code == 202
    deadline = time.monotonic() + TIMEOUT_S
    while (now := tenants["alice"].get(f"/v1/jobs/{poisoned}").json())["state"] != "failed" or now["attempts"] < 2:
        assert time.monotonic() < deadline, now
        time.sleep(0.3)
    assert [j["job_id"] for j in tenants["alice"].get("/v1/dead-letter").json()["jobs"]] == [poisoned]


def test_the_reaper_requeues_a_lost_workers_job(tenants, worker, state, broker):
    batch = submit(tenants["bob"], [job(0, model="tiny")])  # waits: no worker of pool "tiny"
    job_id = batch["job_ids"][0]
    ghost = JobStore(state, lease_s=0.5)
    assert ghost.start_many([job_id], "ghost-worker")[job_id].attempt == 1  # a worker that then dies
    deadline = time.monotonic() + TIMEOUT_S
    while (now := tenants["bob"].get(f"/v1/jobs/{job_id}").json())["state"] != "queued":
        assert time.monotonic() < deadline, now
        time.sleep(0.3)
    assert job_id not in shards.members(state, keys.leases)
    assert state.hget(keys.job(job_id), "last_error").find("WorkerLost") >= 0
    # republished on the broker's own Redis (just after the requeue the state already shows)
    while broker.client().llen(keys.queue("tiny")) < 1:
        assert time.monotonic() < deadline, "the requeued job was not republished on the broker"
        time.sleep(0.1)
    assert tenants["bob"].delete(f"/v1/jobs/{job_id}").status_code == 200


def test_no_process_met_a_redis_error(api, worker):
    """Every farm process ran the steps above without an error from Redis Cluster (a command its
    client refuses in a pipeline, a CROSSSLOT, a script touching another slot's key)."""
    for proc in (api, worker):
        tail = proc.log_tail(100_000)
        for needle in ("RedisClusterException", "CROSSSLOT", "Traceback"):
            assert needle not in tail, f"{proc.name}: {needle}"
