"""Tenant isolation: a tenant cannot read, cancel or fetch another tenant's jobs, batches or
images; it gets the same 404 as for an id that never existed."""

from __future__ import annotations

import secrets

import httpx
import pytest

pytestmark = pytest.mark.integration


def _shape(response: httpx.Response, real_id: str) -> tuple[int, str]:
    """Status and detail with the id blanked, to compare "someone else's" with "unknown"."""
    return response.status_code, response.json()["detail"].replace(real_id, "ID")


def test_another_tenants_job_is_a_404_like_an_unknown_one(tenant_a, tenant_b, store, job_body):
    accepted = tenant_a.http.post("/v1/jobs", json=job_body)
    assert accepted.status_code == 202
    job_id, batch_id = accepted.json()["job_id"], accepted.json()["batch_id"]
    unknown = secrets.token_hex(16)
    for method, path in [("GET", "/v1/jobs/{}"), ("DELETE", "/v1/jobs/{}")]:
        theirs = tenant_b.http.request(method, path.format(job_id))
        nobody = tenant_b.http.request(method, path.format(unknown))
        assert _shape(theirs, job_id) == _shape(nobody, unknown) and theirs.status_code == 404
    for method, path in [("GET", "/v1/batches/{}"), ("DELETE", "/v1/batches/{}")]:
        theirs = tenant_b.http.request(method, path.format(batch_id))
        nobody = tenant_b.http.request(method, path.format(unknown))
        assert _shape(theirs, batch_id) == _shape(nobody, unknown) and theirs.status_code == 404
    # tenant_b's cancel attempts changed nothing; tenant_a still sees and owns her job
    assert store.get_job(job_id).state == "queued"
    mine = tenant_a.http.get(f"/v1/jobs/{job_id}")
    assert mine.status_code == 200 and mine.json()["request"]["prompt"] == job_body["prompt"]
    assert tenant_a.http.get(f"/v1/batches/{batch_id}").json()["total"] == 1
    assert store.get_job(job_id, tenant_a.name) is not None and store.get_job(job_id, tenant_b.name) is None


def test_another_tenant_cannot_fetch_the_image(tenant_a, tenant_b, store, s3_server, farm_env, job_body,
                                               finish_as_worker):
    accepted = tenant_a.http.post("/v1/batches", json={"jobs": [job_body, {**job_body, "seed": 6}]}).json()
    key = f"{accepted['batch_id']}/{accepted['job_ids'][0]}.png"
    s3_server.client().put_object(Bucket=farm_env["RENDERFARM_S3_BUCKET"], Key=key, Body=b"\x89PNG\r\n\x1a\n",
                                  ContentType="image/png")
    finish_as_worker(accepted["job_ids"][0], key)
    mine = tenant_a.http.get(f"/v1/jobs/{accepted['job_ids'][0]}").json()
    assert mine["state"] == "succeeded" and httpx.get(mine["result"]["url"]).content == b"\x89PNG\r\n\x1a\n"
    page = tenant_a.http.get(f"/v1/batches/{accepted['batch_id']}").json()
    assert page["counts"]["succeeded"] == 1 and page["jobs"][0]["result"]["url"]
    # tenant_b learns nothing: no status, no URL, no batch page
    assert tenant_b.http.get(f"/v1/jobs/{accepted['job_ids'][0]}").status_code == 404
    assert tenant_b.http.get(f"/v1/batches/{accepted['batch_id']}", params={"limit": 10}).status_code == 404
    # and a URL without a valid signature does not open the object
    bucket_url = f"{farm_env['RENDERFARM_S3_ENDPOINT_URL']}/{farm_env['RENDERFARM_S3_BUCKET']}/{key}"
    assert httpx.get(bucket_url).status_code == 403


def test_cancel_is_scoped_to_the_owner(tenant_a, tenant_b, store, job_body):
    accepted = tenant_a.http.post("/v1/batches", json={"jobs": [job_body] * 3}).json()
    assert tenant_b.http.delete(f"/v1/batches/{accepted['batch_id']}").status_code == 404
    assert [store.get_job(j).state for j in accepted["job_ids"]] == ["queued"] * 3
    canceled = tenant_a.http.delete(f"/v1/batches/{accepted['batch_id']}")
    assert canceled.status_code == 200 and canceled.json()["canceled"] == 3


def test_idempotency_keys_are_per_tenant(tenant_a, tenant_b, job_body):
    body = {"jobs": [job_body], "idempotency_key": f"nightly-{secrets.token_hex(4)}"}
    a1 = tenant_a.http.post("/v1/batches", json=body).json()
    a2 = tenant_a.http.post("/v1/batches", json=body).json()
    b1 = tenant_b.http.post("/v1/batches", json=body).json()
    assert a1 == a2
    assert b1["batch_id"] != a1["batch_id"] and set(b1["job_ids"]).isdisjoint(a1["job_ids"])
    assert tenant_b.http.get(f"/v1/batches/{a1['batch_id']}").status_code == 404


def test_workers_and_queues_are_farm_wide(tenant_a, tenant_b):
    for tenant in (tenant_a, tenant_b):
        assert tenant.http.get("/v1/workers").status_code == 200
        queues = tenant.http.get("/v1/queues")
        assert queues.status_code == 200 and isinstance(queues.json(), list)


def test_anonymous_requests_are_tenant_public_when_auth_is_off(api_server, farm_env, make_tenant, job_body):
    url = farm_env["RENDERFARM_API_URL"]
    keyed = make_tenant("carol", url)
    carol_job = keyed.http.post("/v1/jobs", json=job_body).json()["job_id"]
    public_job = httpx.post(url + "/v1/jobs", json=job_body).json()["job_id"]
    assert httpx.get(f"{url}/v1/jobs/{carol_job}").status_code == 404
    assert keyed.http.get(f"/v1/jobs/{public_job}").status_code == 404
    assert httpx.get(f"{url}/v1/jobs/{public_job}").status_code == 200
    assert keyed.http.get(f"/v1/jobs/{carol_job}").status_code == 200
