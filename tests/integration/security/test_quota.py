"""Per-tenant quotas: outstanding jobs, estimated GPU-seconds and bytes of
job records, 429 with ``Retry-After`` over them, 413 for a request larger than the quota itself;
ending work gives the quota back; another tenant is not affected."""

from __future__ import annotations

import time

import pytest

from infra import keys
from infra.schemas import JobError, RenderRequest
from infra.state.job_store import JobStore, NewJob
from infra.state.quota import Quotas, Usage, job_bytes
from infra.submission.submitter import new_id

from .conftest import UNSERVED_MODEL, start_api

pytestmark = pytest.mark.integration

# 0.05 s per megapixel-step (the default rate): a 512² 150-step job is ~1.97 GPU-seconds.
BIG = {"prompt": "p", "model": UNSERVED_MODEL, "width": 512, "height": 512, "num_inference_steps": 150, "seed": 1}
HOLDS_DB = 12  # no API or reaper runs on it
SMALL = {"prompt": "p", "model": UNSERVED_MODEL, "width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}
#: SMALL with 32 × 1,000 characters of metadata: a record of ~38 KB (infra.state.quota.job_bytes).
LARGE = {**SMALL, "metadata": {f"k{i:02d}": "m" * 1000 for i in range(32)}}
QUOTA_BYTES = 100_000  # two LARGE jobs and a SMALL one fit, three LARGE do not


@pytest.fixture(scope="module")
def quota_api(farm_env, run_dir):
    server = start_api(farm_env, run_dir, "api-quota", RENDERFARM_AUTH_REQUIRED="true",
                       RENDERFARM_DEFAULT_MODEL=UNSERVED_MODEL, RENDERFARM_QUOTA_OUTSTANDING_JOBS="5",
                       RENDERFARM_QUOTA_GPU_SECONDS="5", RENDERFARM_QUOTA_OUTSTANDING_BYTES=str(QUOTA_BYTES))
    yield server
    server.stop()


def test_outstanding_jobs_quota(quota_api, make_tenant, redis_server):
    a, b = make_tenant("quota-a", quota_api.url), make_tenant("quota-b", quota_api.url)
    assert a.http.post("/v1/batches", json={"jobs": [SMALL] * 6}).status_code == 413
    first = a.http.post("/v1/batches", json={"jobs": [SMALL] * 4})
    assert first.status_code == 202
    over = a.http.post("/v1/batches", json={"jobs": [SMALL] * 2})
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1, over.text
    assert "quota" in over.json()["detail"]
    assert b.http.post("/v1/batches", json={"jobs": [SMALL] * 5}).status_code == 202  # b is not affected
    assert Quotas(redis_server.client()).usage("quota-a")[0] == 4
    # ending work gives the quota back
    assert a.http.delete(f"/v1/batches/{first.json()['batch_id']}").json()["canceled"] == 4
    assert Quotas(redis_server.client()).usage("quota-a")[0] == 0
    assert a.http.post("/v1/batches", json={"jobs": [SMALL] * 5}).status_code == 202


def test_gpu_seconds_quota_counts_pixels_and_steps(quota_api, make_tenant, store, redis_server):
    c = make_tenant("quota-c", quota_api.url)
    assert c.http.post("/v1/batches", json={"jobs": [BIG] * 3}).status_code == 413  # 5.9 s > 5 s alone
    two = c.http.post("/v1/batches", json={"jobs": [BIG] * 2})
    assert two.status_code == 202
    assert c.http.post("/v1/jobs", json=BIG).status_code == 429  # 3.9 + 2.0 > 5
    assert c.http.post("/v1/jobs", json=SMALL).status_code == 202  # 64² × 2 steps is ~0.0004 s
    usage = Quotas(redis_server.client()).usage("quota-c")
    assert usage.jobs == 3 and usage.gpu_s == pytest.approx(2 * 0.05 * 0.262144 * 150 + 0.05 * 64 * 64 / 1e6 * 2)
    # a failed job gives its share back; a dead-letter retry takes it again
    job_id = two.json()["job_ids"][0]
    started = store.start_many([job_id], "quota-worker")[job_id]
    assert store.fail(started, JobError(type="ValueError", message="x")) == "failed"
    assert Quotas(redis_server.client()).usage("quota-c")[0] == 2
    assert c.http.post(f"/v1/dead-letter/{job_id}/retry").status_code == 202
    assert Quotas(redis_server.client()).usage("quota-c")[0] == 3


def test_bytes_quota_counts_what_each_record_stores(quota_api, make_tenant, store, redis_server):
    d, e = make_tenant("quota-d", quota_api.url), make_tenant("quota-e", quota_api.url)
    large = job_bytes(RenderRequest.model_validate(LARGE).model_dump_json())
    small = job_bytes(RenderRequest.model_validate(SMALL).model_dump_json())
    assert 2 * large + small <= QUOTA_BYTES < 3 * large
    alone = d.http.post("/v1/batches", json={"jobs": [LARGE] * 3})
    assert alone.status_code == 413 and "bytes" in alone.json()["detail"], alone.text
    two = d.http.post("/v1/batches", json={"jobs": [LARGE] * 2})
    assert two.status_code == 202, two.text
    for job_id in two.json()["job_ids"]:  # measured on the record as stored, and kept with it
        request, cost = store.r.hmget(keys.job(job_id), "request", "cost_bytes")
        assert int(cost) == job_bytes(request) == large
    over = d.http.post("/v1/jobs", json=LARGE)
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1, over.text
    assert "bytes" in over.json()["detail"]
    assert d.http.post("/v1/jobs", json=SMALL).status_code == 202  # 3 jobs, far below the job quota
    assert e.http.post("/v1/batches", json={"jobs": [LARGE] * 2}).status_code == 202  # e is not affected
    quotas = Quotas(redis_server.client())
    assert quotas.usage("quota-d")[::2] == (3, 2 * large + small)
    assert quotas.usage("quota-e")[::2] == (2, 2 * large)
    # canceling gives the record's bytes back, exactly
    canceled, kept = two.json()["job_ids"]
    assert d.http.delete(f"/v1/jobs/{canceled}").status_code == 200
    assert quotas.usage("quota-d")[::2] == (2, large + small)
    assert d.http.post("/v1/jobs", json=LARGE).status_code == 202
    # a failed job gives them back too; a dead-letter retry takes them again
    started = store.start_many([kept], "quota-worker")[kept]
    assert store.fail(started, JobError(type="ValueError", message="x")) == "failed"
    assert quotas.usage("quota-d")[::2] == (2, large + small)
    assert d.http.post(f"/v1/dead-letter/{kept}/retry").status_code == 202
    assert quotas.usage("quota-d")[::2] == (3, 2 * large + small)
    assert d.http.post("/v1/jobs", json=LARGE).status_code == 429  # the retry's bytes count again
    assert quotas.usage("quota-e")[::2] == (2, 2 * large)


def test_a_record_from_before_the_byte_quota_gives_back_no_bytes(redis_db):
    """A job recorded without ``cost_bytes`` (before this quota) reserved no bytes, and gives
    none back; one with it gives back exactly its own."""
    r = redis_db(HOLDS_DB)
    store, quotas = JobStore(r), Quotas(r)
    request = RenderRequest.model_validate(LARGE)
    cost = job_bytes(request.model_dump_json())
    batch_id = new_id()
    old = NewJob(new_id(keys.shard(batch_id)), request, "p", cost_s=1.0)
    new = NewJob(new_id(keys.shard(batch_id)), request, "p", cost_s=1.0, cost_bytes=cost)
    quotas.reserve("quota-legacy", 2, 2.0, cost)
    store.create_batch(batch_id, [old, new], tenant="quota-legacy")
    assert r.hget(keys.job(old.job_id), "cost_bytes") is None
    assert store.cancel(old.job_id)
    assert quotas.usage("quota-legacy") == Usage(1, 1.0, cost)
    assert store.cancel(new.job_id)
    assert quotas.usage("quota-legacy") == Usage(0, 0.0, 0)


def test_a_reservation_whose_batch_never_came_is_given_back(redis_db):
    """The API killed between the reservation and the batch's MULTI/EXEC (fault scenario i):
    the hold outlives its lifetime, and the reaper's pass gives it back; a hold whose batch was
    recorded is only dropped.

    On a database of its own: the session farm's API reaper sweeps database 0's holds too, and
    would give the abandoned hold back before this test's own sweep could count it."""
    r = redis_db(HOLDS_DB)
    quotas = Quotas(r, max_jobs=100, hold_s=2)
    quotas.reserve("quota-held", 7, 1.5, 70_000, batch_id="0a" + "1" * 30)  # its batch never written
    quotas.reserve("quota-held", 3, 0.5, 30_000, batch_id="0b" + "2" * 30)  # "written" below
    # a hold as reserved before the byte quota ("batch|jobs|gpu_s"), also abandoned
    r.hincrby(keys.quota("quota-held"), "jobs", 2)
    r.hincrbyfloat(keys.quota("quota-held"), "gpu_s", 0.25)
    r.zadd(keys.quota_holds("quota-held"), {"0d" + "4" * 30 + "|2|0.25": 0})
    exists = lambda batch_id: batch_id.startswith("0b")  # noqa: E731
    assert quotas.usage("quota-held") == Usage(12, 2.25, 100_000)
    assert quotas.reclaim_abandoned(exists) == 1  # the old hold's deadline (0) is past
    assert quotas.usage("quota-held") == Usage(10, 2.0, 100_000)
    assert quotas.reclaim_abandoned(exists) == 0  # not expired yet: a submission may be in flight
    assert quotas.usage("quota-held") == Usage(10, 2.0, 100_000)
    time.sleep(2.2)  # past the holds' 2 s lifetime
    assert quotas.reclaim_abandoned(exists) == 1
    assert quotas.usage("quota-held") == Usage(3, 0.5, 30_000)
    assert quotas.reclaim_abandoned(exists) == 0  # each hold is given back once
    assert not r.sismember(keys.QUOTA_HOLDERS, "quota-held")  # no holds left to sweep
    # a recorded batch drops its hold at once, and a failed write gives its reservation back
    quotas.reserve("quota-held", 4, 1.0, 40_000, batch_id="0c" + "3" * 30)
    quotas.recorded("quota-held", 4, 1.0, 40_000, batch_id="0c" + "3" * 30)
    quotas.release("quota-held", 3, 0.5, 30_000, batch_id="0b" + "2" * 30)  # its hold is gone: nothing given twice
    assert quotas.usage("quota-held") == Usage(7, 1.5, 70_000)
    assert not r.zcard(keys.quota_holds("quota-held"))
    quotas.reserve("quota-held", 1, 0.5, 5_000, batch_id="0e" + "5" * 30)
    quotas.release("quota-held", 1, 0.5, 5_000, batch_id="0e" + "5" * 30)  # its batch's write failed
    assert quotas.usage("quota-held") == Usage(7, 1.5, 70_000)
