"""Scenario o of the fault table: tenant B probes tenant A's ids through every route.

A owns a batch with a succeeded job (an image in the bucket), a failed job (a dead letter), a
queued job that a worker reports as its current job, and a catalog key. B sends each of A's ids
to every route that takes an id, and the same route an unknown id, a malformed id and A's id
with a key suffix (``{id}:jobs``, ``{id}:counts``: once a 500). Every pair must answer
byte for byte the same: status, content type and body. Listings (dead letters, gallery,
batches, workers, catalog lookup, A1111 progress) must not hold any of A's ids, and B's
dead-letter paging must not count A's failures. Nothing B does changes A's jobs.

Then A cancels its queued job, and the scenario's row of the fault table
(:mod:`tests.fault_table`) accounts for A's three jobs from their records, the bucket and the
run counters, as the scenarios of ``tests/faults`` do: lost and run twice must be 0. No worker
renders here (A's jobs are finished through the store), so a job's starts (``attempts``) count as
its runs beside the workers' counters.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from infra.schemas import CATALOG_KEY_FIELD, JobError
from infra.state import registry
from tests.fault_table import account_row, record_row
from worker.faults import read_counters

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def owned(tenant_a, store, s3_server, farm_env, job_body, finish_as_worker, redis_server):
    """A's batch: job 0 succeeded with an image, job 1 failed (dead letter), job 2 queued and
    held by a (registered) worker; and A's catalog key."""
    catalog_key = secrets.token_hex(32)
    jobs = [{**job_body, "seed": 1, "metadata": {CATALOG_KEY_FIELD: catalog_key}}, {**job_body, "seed": 2},
            {**job_body, "seed": 3}]
    accepted = tenant_a.http.post("/v1/batches", json={"jobs": jobs})
    assert accepted.status_code == 202, accepted.text
    batch_id, job_ids = accepted.json()["batch_id"], accepted.json()["job_ids"]
    key = f"{batch_id}/{job_ids[0]}.png"
    s3_server.client().put_object(Bucket=farm_env["RENDERFARM_S3_BUCKET"], Key=key, Body=b"\x89PNG\r\n\x1a\n",
                                  ContentType="image/png")
    finish_as_worker(job_ids[0], key)
    started = store.start_many([job_ids[1]], "probe-worker")[job_ids[1]]
    assert store.fail(started, JobError(type="ValueError", message="a's own failure")) == "failed"
    registry.heartbeat(redis_server.client(), "probe-worker", {"pool": "probe", "current_jobs": [job_ids[2]],
                                                               "reserved_jobs": job_ids}, ttl_s=300)
    return {"batch_id": batch_id, "job_ids": job_ids, "catalog_key": catalog_key}


def _same(a: httpx.Response, b: httpx.Response) -> bool:
    return (a.status_code, a.headers.get("content-type"), a.content) == (
        b.status_code, b.headers.get("content-type"), b.content)


def _probes(batch_id: str, job_id: str) -> list[tuple[str, str]]:
    """Every (method, path) of the API that takes a batch or job id, for these ids."""
    return [
        ("GET", f"/v1/jobs/{job_id}"), ("DELETE", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/batches/{batch_id}"), ("DELETE", f"/v1/batches/{batch_id}"),
        ("GET", f"/v1/batches/{batch_id}?offset=0&limit=1000"),
        ("GET", f"/v1/batches/{batch_id}:jobs"), ("GET", f"/v1/batches/{batch_id}:counts"),
        ("GET", f"/v1/batches/{batch_id}:jobs?limit=0"), ("DELETE", f"/v1/batches/{batch_id}:counts"),
        ("GET", f"/v1/gallery/{job_id}"), ("POST", f"/v1/dead-letter/{job_id}/retry"),
        ("GET", f"/v1/jobs/{job_id}:x"), ("GET", f"/v1/jobs/{job_id.upper()}"),
    ]


def test_every_probe_of_another_tenants_ids_looks_like_an_unknown_id(tenant_a, tenant_b, owned, store, s3_server,
                                                                    farm_env, redis_server):
    unknown_batch, unknown_job = secrets.token_hex(16), secrets.token_hex(16)
    before = {j: store.get_job(j).state for j in owned["job_ids"]}
    pairs, leaks = 0, []
    for job_id in owned["job_ids"]:
        theirs = _probes(owned["batch_id"], job_id)
        nobody = _probes(unknown_batch, unknown_job)
        malformed = _probes("x" * 32, "0" * 31 + "g")
        for (method, path), (_, unknown_path), (_, bad_path) in zip(theirs, nobody, malformed):
            got = tenant_b.http.request(method, path)
            ref = tenant_b.http.request(method, unknown_path)
            bad = tenant_b.http.request(method, bad_path)
            pairs += 1
            assert got.status_code < 500, (method, path, got.status_code, got.text)
            if not (_same(got, ref) and _same(bad, ref)):
                leaks.append((method, path, got.status_code, got.text, ref.status_code, ref.text, bad.status_code))
    assert not leaks, leaks
    # the same probes of an unknown batch by the batch's owner are the same 404s (no 500 for
    # "{id}:counts" of the public tenant either: the id shape is checked first)
    assert tenant_a.http.get(f"/v1/batches/{owned['batch_id']}:counts").status_code == 404

    # listings: none of A's ids, nothing counted from A's failures
    a_ids = {owned["batch_id"], *owned["job_ids"]}
    for path in ("/v1/dead-letter?limit=1", "/v1/gallery", "/v1/batches", "/sdapi/v1/progress", "/v1/workers"):
        page = tenant_b.http.get(path)
        assert page.status_code == 200 and not any(i in page.text for i in a_ids), (path, page.text)
    assert tenant_b.http.get("/v1/dead-letter", params={"limit": 1}).json()["next_offset"] is None
    lookup = tenant_b.http.post("/v1/catalog/lookup", json={"keys": [owned["catalog_key"]]})
    assert lookup.status_code == 200 and lookup.json()["entries"][owned["catalog_key"]] is None
    # B's worker listing hides A's job ids; A sees its own
    b_worker = next(w for w in tenant_b.http.get("/v1/workers").json() if w["name"] == "probe-worker")
    a_worker = next(w for w in tenant_a.http.get("/v1/workers").json() if w["name"] == "probe-worker")
    assert b_worker["current_jobs"] == [] and b_worker["reserved_jobs"] == []
    assert a_worker["current_jobs"] == [owned["job_ids"][2]] and set(a_worker["reserved_jobs"]) == a_ids - {
        owned["batch_id"]}

    # nothing B did changed A's jobs; A still sees them all
    assert {j: store.get_job(j).state for j in owned["job_ids"]} == before
    assert tenant_a.http.get(f"/v1/batches/{owned['batch_id']}").json()["total"] == 3
    dead = tenant_a.http.get("/v1/dead-letter").json()
    assert [j["job_id"] for j in dead["jobs"]] == [owned["job_ids"][1]]

    # the row: A cancels its queued job, then every job is accounted for
    assert tenant_a.http.delete(f"/v1/jobs/{owned['job_ids'][2]}").status_code == 200
    job_ids = owned["job_ids"]
    statuses = store.get_jobs(job_ids)
    listing = s3_server.client().list_objects_v2(Bucket=farm_env["RENDERFARM_S3_BUCKET"],
                                                 Prefix=f"{owned['batch_id']}/")
    bucket_keys = {o["Key"] for o in listing.get("Contents", [])}
    r = redis_server.client()
    renders, writes = read_counters(r)
    runs = {s.job_id: max(renders.get(s.job_id, 0), s.attempts) for s in statuses if s is not None}
    row = account_row("o. tenant B probes tenant A's ids through every route", job_ids, statuses, bucket_keys,
                      runs, writes, None, probes=pairs * 3, unlike_unknown=len(leaks))
    record_row(row)
    assert (row["succeeded"], row["failed"], row["canceled"]) == (1, 1, 1), row
    assert row["lost"] == 0 and row["run_twice"] == 0 and row["unlike_unknown"] == 0, row
