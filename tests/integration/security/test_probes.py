"""Probes and the scrape: readiness depends on Redis only (an S3 outage is
``degraded``, still 200), ``/livez`` touches nothing, ``/metrics`` needs the scrape token or an
admin tenant's key once auth is on, and ``/healthz`` is cheap and tells an anonymous caller only
its status: one evaluation serves every probe for ``RENDERFARM_HEALTH_CACHE_S`` (counted in the
Redis server's own command statistics), and worker names go only to the scrape token or an admin."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from infra.api.auth import KeyStore
from infra.localstack import RedisServer, free_port
from infra.state import registry

from .conftest import start_api

pytestmark = pytest.mark.integration

TOKEN = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def scraped_api(farm_env, run_dir):
    server = start_api(farm_env, run_dir, "api-scraped", RENDERFARM_AUTH_REQUIRED="true",
                       RENDERFARM_METRICS_TOKEN=TOKEN, RENDERFARM_ADMIN_TENANTS="ops, probe-admin")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_s3_api(farm_env, run_dir):
    """An API whose S3 endpoint is a closed port: S3 is down for it from the start."""
    server = start_api(farm_env, run_dir, "api-no-s3", RENDERFARM_S3_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
                       RENDERFARM_HEALTH_S3_CACHE_S="30")
    yield server
    server.stop()


class HungS3:
    """A TCP server that accepts connections and never answers (an S3 server still starting, or
    wedged); :attr:`accepted` counts the connections it took."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, name="hung-s3", daemon=True).start()

    @property
    def accepted(self) -> int:
        return len(self.held)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self.held.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(scope="module")
def hung_s3() -> Iterator[HungS3]:
    server = HungS3()
    yield server
    server.close()


@pytest.fixture(scope="module")
def hung_s3_api(farm_env, run_dir, hung_s3):
    """An API whose S3 endpoint is :class:`HungS3`; its S3 check's answer is kept 3 s."""
    server = start_api(farm_env, run_dir, "api-hung-s3", RENDERFARM_S3_ENDPOINT_URL=hung_s3.url,
                       RENDERFARM_HEALTH_S3_CACHE_S="3")
    yield server
    server.stop()


def test_metrics_need_the_scrape_token_or_an_admin_key(secure_api, scraped_api, make_tenant):
    # auth on, no token configured: only an admin could scrape, and there is none
    assert httpx.get(secure_api.url + "/metrics").status_code == 401
    tenant = make_tenant("probe-tenant", scraped_api.url)
    admin = make_tenant("probe-admin", scraped_api.url)
    assert httpx.get(scraped_api.url + "/metrics").status_code == 401
    assert tenant.http.get("/metrics").status_code == 401
    wrong = httpx.get(scraped_api.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}x"})
    assert wrong.status_code == 401 and TOKEN not in wrong.text
    by_token = httpx.get(scraped_api.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert by_token.status_code == 200 and "renderfarm_outstanding_jobs" in by_token.text
    by_admin = admin.http.get("/metrics")
    assert by_admin.status_code == 200 and by_admin.text == by_token.text  # one cached answer for both


def test_liveness_and_readiness(secure_api):
    assert httpx.get(secure_api.url + "/livez").json() == {"status": "ok"}
    health = httpx.get(secure_api.url + "/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # anonymous: the status alone


def test_an_s3_outage_degrades_but_keeps_the_api_ready(no_s3_api):
    health = httpx.get(no_s3_api.url + "/healthz", timeout=60)
    body = health.json()
    assert health.status_code == 200 and body["status"] == "degraded", body
    assert body["checks"]["redis"] == "ok" and body["checks"]["s3"] != "ok"
    # the failing check is cached: probes do not each wait for S3
    again = [httpx.get(no_s3_api.url + "/healthz", timeout=60) for _ in range(5)]
    assert all(r.status_code == 200 and r.json() == body for r in again)
    # and the API still accepts work
    accepted = httpx.post(no_s3_api.url + "/v1/jobs", json={"prompt": "p", "model": "security-unserved",
                                                            "width": 64, "height": 64, "num_inference_steps": 2})
    assert accepted.status_code == 202, accepted.text


def test_a_hung_s3_is_reported_within_the_probe_timeout(hung_s3, hung_s3_api):
    """A fresh S3 check against a hung S3 is one ``HeadBucket`` (one connection: no retries), its
    read timeout fires, and ``/healthz`` answers ``degraded`` before the chart's readinessProbe
    gives up (``timeoutSeconds: 5``). That 5 s is the kubelet's deadline, the behaviour itself,
    not a speed: one check waits ``PROBE_TIMEOUT_S`` (2 s) to read; a probe that retried S3, or
    waited out the transfer client's 60 s read timeout, would take three times that or more."""
    # answers are reused (the S3 check for 3 s here): ask until one is computed afresh, which the
    # hung server sees as a new connection
    deadline = time.monotonic() + 60
    while True:
        before = hung_s3.accepted
        started = time.monotonic()
        health = httpx.get(hung_s3_api.url + "/healthz", timeout=60)
        took = time.monotonic() - started
        if hung_s3.accepted > before:
            break
        assert time.monotonic() < deadline, "no /healthz checked S3 afresh in 60 s"
        time.sleep(0.2)
    assert hung_s3.accepted == before + 1, "one HeadBucket, no retry"
    body = health.json()
    assert health.status_code == 200 and body["status"] == "degraded", body
    assert body["checks"]["s3"].startswith("ReadTimeoutError: Read timeout on endpoint URL"), body
    assert took < 5.0, f"/healthz took {took:.1f} s with S3 hung"


@pytest.fixture(scope="module")
def own_redis(run_dir, tmp_path_factory):
    """A redis-server of this module alone, so that its command statistics count only what the
    probed API sends."""
    with RedisServer(free_port(), dir=tmp_path_factory.mktemp("redis-probes"), run_dir=run_dir) as server:
        yield server


@pytest.fixture(scope="module")
def probed_api(farm_env, run_dir, own_redis):
    """An API with auth on, an admin tenant and a scrape token, on ``own_redis``, whose registry
    holds a worker with its breaker open and a healthy one. Its reaper and webhook deliverer are
    off and its one /healthz answer lives an hour, so that every Redis command counted below comes
    from /healthz or from nothing."""
    r = own_redis.client()
    registry.heartbeat(r, "w-broken", {"pool": "tiny", "healthy": False}, ttl_s=3600)
    registry.heartbeat(r, "w-fine", {"pool": "tiny", "healthy": True}, ttl_s=3600)
    server = start_api(farm_env, run_dir, "api-probed", RENDERFARM_REDIS_URL=own_redis.url,
                       RENDERFARM_AUTH_REQUIRED="true", RENDERFARM_METRICS_TOKEN=TOKEN,
                       RENDERFARM_ADMIN_TENANTS="probe-ops", RENDERFARM_HEALTH_CACHE_S="3600",
                       RENDERFARM_HEARTBEAT_TTL_S="3600", RENDERFARM_REAPER_ENABLED="false",
                       RENDERFARM_WEBHOOKS_ENABLED="false")
    yield server
    server.stop()


def _calls(client, *commands: str) -> dict[str, int]:
    """How many times redis-server has run each command (INFO commandstats)."""
    stats = client.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands}


def test_healthz_shows_worker_names_only_to_the_token_or_an_admin(probed_api, own_redis):
    keys = KeyStore(own_redis.client())
    _, admin = keys.create("probe-ops")
    _, tenant = keys.create("probe-someone")
    anonymous = httpx.get(probed_api.url + "/healthz")
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    assert "w-broken" not in anonymous.text
    plain = httpx.get(probed_api.url + "/healthz", headers={"X-API-Key": tenant})
    assert plain.json() == {"status": "ok"}
    full = {"status": "ok", "checks": {"redis": "ok", "s3": "ok"}, "unhealthy_workers": ["w-broken"]}
    assert httpx.get(probed_api.url + "/healthz", headers={"X-API-Key": admin}).json() == full
    assert httpx.get(probed_api.url + "/healthz", headers={"Authorization": f"Bearer {TOKEN}"}).json() == full
    wrong = httpx.get(probed_api.url + "/healthz", headers={"Authorization": f"Bearer {TOKEN}x"})
    assert wrong.json() == {"status": "ok"}


def test_repeated_probes_within_the_interval_do_not_reach_redis(probed_api, own_redis):
    r = own_redis.client()
    read = ("ping", "time", "zrangebyscore", "hgetall")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    httpx.get(probed_api.url + "/healthz")  # the interval's evaluation (or one already made)
    httpx.get(probed_api.url + "/healthz", headers=bearer)  # and its worker list
    before = _calls(r, *read)
    assert before["ping"] >= 1 and before["zrangebyscore"] >= 1  # these count /healthz's reads
    for _ in range(10):
        assert httpx.get(probed_api.url + "/healthz").json() == {"status": "ok"}
        assert httpx.get(probed_api.url + "/healthz", headers=bearer).json()["unhealthy_workers"] == ["w-broken"]
    assert _calls(r, *read) == before
    # the probe path writes nothing: gone workers' names are pruned by the reaper, not here
    assert _calls(r, "zremrangebyscore") == {"zremrangebyscore": 0}


def test_the_scrape_token_reads_queue_depths_and_nothing_else(scraped_api):
    """KEDA's metrics-api trigger sends the scrape token (the chart's TriggerAuthentication, as a
    bearer token): with auth on, it reads /v1/queues and /v1/queues/<pool>, and no tenant route."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    one = httpx.get(scraped_api.url + "/v1/queues/tiny", headers=bearer)
    assert one.status_code == 200 and one.json()["pool"] == "tiny" and "outstanding" in one.json()
    assert httpx.get(scraped_api.url + "/v1/queues", headers=bearer).status_code == 200
    assert httpx.get(scraped_api.url + "/v1/queues/tiny").status_code == 401
    assert httpx.get(scraped_api.url + "/v1/queues/tiny", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code \
        == 401
    for path in ("/v1/workers", "/v1/jobs/0123456789abcdef0123456789abcdef", "/v1/queuesx"):
        assert httpx.get(scraped_api.url + path, headers=bearer).status_code == 401, path
    submit = httpx.post(scraped_api.url + "/v1/jobs", headers=bearer, json={"prompt": "a cat", "model": "tiny"})
    assert submit.status_code == 401
