"""Per-tenant quotas (issue 14, item 13): outstanding jobs and estimated GPU-seconds, 429 with
``Retry-After`` over them, 413 for a request larger than the quota itself; ending work gives
the quota back; another tenant is not affected."""

from __future__ import annotations

import time

import pytest

from infra import keys
from infra.schemas import JobError
from infra.state.quota import Quotas

from .conftest import UNSERVED_MODEL, start_api

pytestmark = pytest.mark.integration

# 0.05 s per megapixel-step (the default rate): a 512² 150-step job is ~1.97 GPU-seconds.
BIG = {"prompt": "p", "model": UNSERVED_MODEL, "width": 512, "height": 512, "num_inference_steps": 150, "seed": 1}
HOLDS_DB = 12  # no API or reaper runs on it
SMALL = {"prompt": "p", "model": UNSERVED_MODEL, "width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def quota_api(farm_env, run_dir):
    server = start_api(farm_env, run_dir, "api-quota", RENDERFARM_AUTH_REQUIRED="true",
                       RENDERFARM_DEFAULT_MODEL=UNSERVED_MODEL, RENDERFARM_QUOTA_OUTSTANDING_JOBS="5",
                       RENDERFARM_QUOTA_GPU_SECONDS="5")
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
    jobs, gpu_s = Quotas(redis_server.client()).usage("quota-c")
    assert jobs == 3 and gpu_s == pytest.approx(2 * 0.05 * 0.262144 * 150 + 0.05 * 64 * 64 / 1e6 * 2)
    # a failed job gives its share back; a dead-letter retry takes it again
    job_id = two.json()["job_ids"][0]
    started = store.start_many([job_id], "quota-worker")[job_id]
    assert store.fail(started, JobError(type="ValueError", message="x")) == "failed"
    assert Quotas(redis_server.client()).usage("quota-c")[0] == 2
    assert c.http.post(f"/v1/dead-letter/{job_id}/retry").status_code == 202
    assert Quotas(redis_server.client()).usage("quota-c")[0] == 3


def test_a_reservation_whose_batch_never_came_is_given_back(redis_db):
    """The API killed between the reservation and the batch's MULTI/EXEC (fault scenario i):
    the hold outlives its lifetime, and the reaper's pass gives it back; a hold whose batch was
    recorded is only dropped.

    On a database of its own: the session farm's API reaper sweeps database 0's holds too, and
    would give the abandoned hold back before this test's own sweep could count it."""
    r = redis_db(HOLDS_DB)
    quotas = Quotas(r, max_jobs=100, hold_s=1)
    quotas.reserve("quota-held", 7, 1.5, batch_id="0a" + "1" * 30)  # its batch never written
    quotas.reserve("quota-held", 3, 0.5, batch_id="0b" + "2" * 30)  # "written" below
    exists = lambda batch_id: batch_id.startswith("0b")  # noqa: E731
    assert quotas.usage("quota-held") == (10, 2.0)
    assert quotas.reclaim_abandoned(exists) == 0  # not expired yet: a submission may be in flight
    assert quotas.usage("quota-held") == (10, 2.0)
    time.sleep(2.1)  # the hold's deadline is in whole Redis seconds
    assert quotas.reclaim_abandoned(exists) == 1
    assert quotas.usage("quota-held") == (3, 0.5)
    assert quotas.reclaim_abandoned(exists) == 0  # each hold is given back once
    assert not r.sismember(keys.QUOTA_HOLDERS, "quota-held")  # no holds left to sweep
    # a recorded batch drops its hold at once, and a failed write gives its reservation back
    quotas.reserve("quota-held", 4, 1.0, batch_id="0c" + "3" * 30)
    quotas.recorded("quota-held", 4, 1.0, batch_id="0c" + "3" * 30)
    quotas.release("quota-held", 3, 0.5, batch_id="0b" + "2" * 30)  # its hold is gone: nothing given twice
    assert quotas.usage("quota-held") == (7, 1.5)
    assert not r.zcard(keys.quota_holds("quota-held"))
