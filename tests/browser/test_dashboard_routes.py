"""The dashboard's server side without a browser: the page and its Content-Security-Policy, and
the read routes it polls (``/v1/batches``, ``/v1/throughput``), through the ASGI app on its own
Redis database (4) of the session redis-server. No worker runs: jobs stay queued."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from fastapi.testclient import TestClient

from infra.api.server import create_app
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state.job_store import JobStore, NewJob
from infra.submission.submitter import new_id

DB = 4


@pytest.fixture
def api(redis_server, redis_db):
    redis_db(DB)
    # the page presigns a gallery URL, which needs credentials but no S3 server: without these it
    # would depend on an earlier test of the same process having set the session farm's
    settings = Settings(redis_url=redis_server.db_url(DB), s3_endpoint_url="http://127.0.0.1:9", reaper_enabled=False,
                        aws_access_key_id="dashboard-test", aws_secret_access_key="dashboard-test-secret")
    with TestClient(create_app(settings)) as client:
        yield client


def _jobs(n: int, prompt: str = "a kite") -> dict:
    return {"jobs": [RenderRequest(prompt=f"{prompt} {i}", model="tiny", width=64, height=64).model_dump(
        mode="json", exclude_none=True) for i in range(n)]}


def test_page_runs_only_its_own_inlined_script(api):
    response = api.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html, csp = response.text, response.headers["content-security-policy"]
    assert "<title>renderfarm dashboard</title>" in html and 'src="dashboard.js"' not in html
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    assert len(scripts) == 1 and "textContent" in scripts[0]
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in csp and "default-src 'none'" in csp
    assert "innerHTML" not in scripts[0] and "insertAdjacentHTML" not in scripts[0]


def test_recent_batches_are_newest_first_and_per_tenant(api, redis_server):
    ids = [api.post("/v1/batches", json=_jobs(n)).json()["batch_id"] for n in (1, 2, 3)]
    JobStore(redis_server.client(DB)).create_batch(new_id(), [NewJob(new_id(), RenderRequest(prompt="x"), "tiny")],
                                                   tenant="acme")
    listed = api.get("/v1/batches", params={"limit": 2}).json()
    assert [b["batch_id"] for b in listed] == [ids[2], ids[1]]
    assert listed[0]["total"] == 3 and listed[0]["counts"]["queued"] == 3 and listed[0]["jobs"] == []
    assert listed[0]["progress"] == 0 and not listed[0]["done"]
    assert [b["batch_id"] for b in api.get("/v1/batches").json()] == ids[::-1]  # not acme's
    assert api.get("/v1/batches", params={"limit": 0}).status_code == 422


def test_a_batch_page_of_zero_jobs_reads_no_jobs(api):
    batch_id = api.post("/v1/batches", json=_jobs(3)).json()["batch_id"]
    body = api.get(f"/v1/batches/{batch_id}", params={"limit": 0}).json()
    assert body["total"] == 3 and body["jobs"] == []


def test_cancellations_count_as_canceled_images(api):
    batch_id = api.post("/v1/batches", json=_jobs(2)).json()["batch_id"]
    job_id = api.post("/v1/jobs", json=_jobs(1)["jobs"][0]).json()["job_id"]
    assert api.delete(f"/v1/batches/{batch_id}").json()["canceled"] == 2
    assert api.delete(f"/v1/jobs/{job_id}").json()["canceled"] is True
    assert api.delete(f"/v1/jobs/{job_id}").json()["canceled"] is False  # counted once
    text = api.get("/metrics").text
    assert 'renderfarm_images_total{pool="tiny",state="canceled"} 3.0' in text
    assert 'renderfarm_outstanding_jobs{pool="tiny"}' in text


def test_throughput_route_covers_the_asked_minutes(api):
    body = api.get("/v1/throughput", params={"minutes": 10}).json()
    assert body["minute_s"] == 60 and body["pools"] == {} and body["start"] <= body["now"] < body["start"] + 600
    assert api.get("/v1/throughput", params={"minutes": 0}).status_code == 422
