"""Probes and the scrape (issue 14, item 15): readiness depends on Redis only (an S3 outage is
``degraded``, still 200), ``/livez`` touches nothing, and ``/metrics`` needs the scrape token or
an admin tenant's key once auth is on."""

from __future__ import annotations

import secrets

import httpx
import pytest

from infra.localstack import free_port

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
    assert health.status_code == 200 and health.json()["status"] == "ok"


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
