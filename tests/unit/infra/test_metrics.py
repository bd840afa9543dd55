"""Farm metrics (infra/state/metrics.py, infra/api/prometheus.py): what a worker records per batch reaches the API's
/metrics as Prometheus histograms, counters and gauges, and the dashboard's throughput and
images/s read back what was recorded.

The unit tests use their own Redis database (3) of the session redis-server, so they never add
to the counts that the integration test reads from the farm's database 0.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infra import keys
from infra.api import prometheus as read_side
from infra.schemas import RenderRequest
from infra.state import metrics as write_side
from infra.state.job_store import JobStore, NewJob
from infra.submission.submitter import new_id

DB = 3


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label items): value}`` of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def types(text: str) -> dict[str, str]:
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


@pytest.fixture
def r(redis_db):
    return redis_db(DB)


def _started_batch(r, n: int, pool: str = "p1", wait_s: float = 0.0) -> list[str]:
    store = JobStore(r)
    jobs = [NewJob(new_id(), RenderRequest(prompt=f"p{i}", model="tiny", seed=i), pool) for i in range(n)]
    store.create_batch(new_id(), jobs)
    if wait_s:  # pretend the jobs were submitted wait_s earlier
        for job in jobs:
            created = float(r.hget(keys.job(job.job_id), "created_at"))
            r.hset(keys.job(job.job_id), "created_at", repr(created - wait_s))
    started = store.start_many([j.job_id for j in jobs], "w1")
    return [job_id for job_id, s in started.items() if not isinstance(s, str)]


def test_histogram_bucket_index_uses_le_semantics():
    h = write_side.Histogram("x", "x", "x", (1, 2, 4))
    assert [h.bucket(v) for v in (0, 1, 1.5, 2, 4, 4.01, math.inf)] == [0, 0, 1, 1, 2, 3, 3]


def test_one_batch_gives_exact_histograms_and_counters(r):
    job_ids = _started_batch(r, 3, wait_s=40.0)
    write_side.record_batch(r, job_ids, worker="w1", renders=[(2, 1.0), (1, 0.2)], succeeded=2, failed=1,
                            batch_seconds=1.5)
    text = read_side.exposition(r)[0].decode()
    m = parse(text)
    pool = (("pool", "p1"),)

    def bucket(name: str, le: str) -> float:
        return m[(f"{name}_bucket", tuple(sorted({"pool": "p1", "le": le}.items())))]

    # batch size: one batch of 3
    assert m[("renderfarm_batch_size_count", pool)] == 1
    assert m[("renderfarm_batch_size_sum", pool)] == 3
    assert bucket("renderfarm_batch_size", "2.0") == 0 and bucket("renderfarm_batch_size", "4.0") == 1
    # render seconds per image: two images at 0.5 s, one at 0.2 s
    assert m[("renderfarm_render_seconds_per_image_count", pool)] == 3
    assert m[("renderfarm_render_seconds_per_image_sum", pool)] == pytest.approx(1.2)
    assert bucket("renderfarm_render_seconds_per_image", "0.25") == 1
    assert bucket("renderfarm_render_seconds_per_image", "0.5") == 3
    assert bucket("renderfarm_render_seconds_per_image", "+Inf") == 3
    # the worker's wall time on the batch (render + the farm's own work): one batch of 1.5 s
    assert m[("renderfarm_batch_seconds_count", pool)] == 1
    assert m[("renderfarm_batch_seconds_sum", pool)] == pytest.approx(1.5)
    assert bucket("renderfarm_batch_seconds", "1.0") == 0 and bucket("renderfarm_batch_seconds", "2.5") == 1
    # queue wait: started_at − created_at ≈ 40 s for each job
    assert m[("renderfarm_queue_wait_seconds_count", pool)] == 3
    assert m[("renderfarm_queue_wait_seconds_sum", pool)] == pytest.approx(120, abs=3)
    assert bucket("renderfarm_queue_wait_seconds", "30.0") == 0
    assert bucket("renderfarm_queue_wait_seconds", "60.0") == 3
    # images by state
    for state, n in (("succeeded", 2), ("failed", 1), ("canceled", 0)):
        assert m[("renderfarm_images_total", (("pool", "p1"), ("state", state)))] == n
    # a pool seen before has its gauges at 0 (no worker, nothing queued in the broker)
    assert m[("renderfarm_outstanding_jobs", pool)] == 0
    assert m[("renderfarm_live_workers", pool)] == 0


def test_families_and_types_exist_without_any_data(r):
    assert types(read_side.exposition(r)[0].decode()) == {
        "renderfarm_queue_wait_seconds": "histogram", "renderfarm_render_seconds_per_image": "histogram",
        "renderfarm_batch_size": "histogram", "renderfarm_batch_seconds": "histogram", "renderfarm_images": "counter",
        "renderfarm_outstanding_jobs": "gauge", "renderfarm_live_workers": "gauge",
        "renderfarm_recompiles": "counter", "renderfarm_compiled_renders": "counter",
        "renderfarm_eager_renders": "counter", "renderfarm_warmup_seconds": "gauge",
        "renderfarm_worker_warming": "gauge", "renderfarm_worker_state": "gauge"}


def test_warm_up_and_recompiles_reach_metrics_from_the_heartbeats(r):
    """What each worker's heartbeat says (worker.main's describe) is on /metrics per worker: a
    warming worker as warming, a ready one with its warm-up seconds, its recompile count and its
    compiled and eager render counts."""
    from infra.state import registry

    registry.heartbeat(r, "p1@a", {"pool": "p1", "state": "warming", "warmup": {"done": 1, "total": 4,
                                                                                "eta_s": 30.0, "report": None}}, 60)
    registry.heartbeat(r, "p1@c", {"pool": "p1", "state": "loading", "warmup": {"done": 0, "total": None}}, 60)
    registry.heartbeat(r, "p1@b", {"pool": "p1", "state": "ready", "recompiles": 2, "eager_renders": 3,
                                   "compiled_renders": 5,
                                   "warmup": {"done": 4, "total": 4, "eta_s": 0, "report": {"seconds": 81.5}}}, 60)
    m = parse(read_side.exposition(r)[0].decode())
    a, b = (("pool", "p1"), ("worker", "p1@a")), (("pool", "p1"), ("worker", "p1@b"))
    assert m[("renderfarm_worker_warming", a)] == 1 and m[("renderfarm_worker_warming", b)] == 0
    assert m[("renderfarm_warmup_seconds", b)] == 81.5 and ("renderfarm_warmup_seconds", a) not in m
    assert m[("renderfarm_recompiles_total", b)] == 2 and m[("renderfarm_eager_renders_total", b)] == 3
    assert m[("renderfarm_compiled_renders_total", b)] == 5 and ("renderfarm_compiled_renders_total", a) not in m
    assert ("renderfarm_recompiles_total", a) not in m  # not counted before its warm-up ends
    c = (("pool", "p1"), ("worker", "p1@c"))
    assert m[("renderfarm_worker_warming", c)] == 1  # starting: loading counts as not ready
    assert m[("renderfarm_worker_state", tuple(sorted((*c, ("state", "loading")))))] == 1
    assert m[("renderfarm_worker_state", tuple(sorted((*a, ("state", "warming")))))] == 1
    assert m[("renderfarm_worker_state", tuple(sorted((*b, ("state", "ready")))))] == 1
    assert ("renderfarm_worker_state", tuple(sorted((*b, ("state", "warming"))))) not in m


def test_batches_add_up_and_cancellations_count(r):
    for _ in range(3):
        write_side.record_batch(r, _started_batch(r, 2), worker="w1", renders=[(2, 0.1)], succeeded=2)
    write_side.count_images(r, ["p1", "p1", "p2", None], "canceled")
    m = parse(read_side.exposition(r)[0].decode())
    assert m[("renderfarm_batch_size_count", (("pool", "p1"),))] == 3
    assert m[("renderfarm_render_seconds_per_image_count", (("pool", "p1"),))] == 6
    assert m[("renderfarm_images_total", (("pool", "p1"), ("state", "succeeded")))] == 6
    assert m[("renderfarm_images_total", (("pool", "p1"), ("state", "canceled")))] == 2
    assert m[("renderfarm_images_total", (("pool", "p2"), ("state", "canceled")))] == 1
    with pytest.raises(ValueError):
        write_side.count_images(r, ["p1"], "lost")


def test_throughput_and_worker_rates_read_the_minute_buckets(r):
    write_side.record_batch(r, _started_batch(r, 4), worker="w1", renders=[(4, 0.4)], succeeded=4)
    series = read_side.throughput(r, minutes=60)
    assert len(series["pools"]["p1"]) == 60 and series["pools"]["p1"][-1] == 4
    assert series["start"] == (int(series["now"]) // 60 - 59) * 60
    workers = read_side.with_rates(r, [{"name": "w1", "started_at": time.time() - 30},
                                          {"name": "idle", "started_at": time.time() - 30}])
    assert 4 / 35 < workers[0]["images_per_s"] <= 4 / 25
    assert workers[1]["images_per_s"] == 0


def test_a_metrics_write_never_fails_the_batch(caplog):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0),
                       decode_responses=True)  # nothing listens
    write_side.record_batch(dead, ["a" * 32], worker="w1", succeeded=1)
    write_side.count_images(dead, ["p1"], "canceled")
    assert "not recorded" in caplog.text and "not counted" in caplog.text


# ---- end to end ---------------------------------------------------------------------------------
def _scrape(api_url: str) -> dict[tuple[str, tuple], float]:
    return parse(httpx.get(f"{api_url}/metrics", timeout=10).text)


def _idle(api_url: str, pool: str) -> bool:
    rows = httpx.get(f"{api_url}/v1/queues", timeout=10).json()
    return all(r["outstanding"] == 0 for r in rows if r["pool"] == pool)


@pytest.mark.integration
def test_a_rendered_batch_shows_in_metrics_throughput_and_workers(api_server, workers, farm_env):
    from producer import RenderClient

    api_url, pool, n = farm_env["RENDERFARM_API_URL"], "tiny", 5
    deadline = time.monotonic() + 300
    while not _idle(api_url, pool) and time.monotonic() < deadline:  # earlier tests' work done
        time.sleep(0.5)
    time.sleep(1.0)  # the last batch's metrics write follows its jobs' states
    before = _scrape(api_url)
    with RenderClient() as client:
        batch = client.submit_batch([RenderRequest(prompt=f"a lantern {i}", model="tiny", width=64, height=64,
                                                   num_inference_steps=2, seed=i) for i in range(n)])
        assert all(s.state == "succeeded" for s in client.wait(batch.batch_id, timeout=300))

    label = (("pool", pool),)

    def delta(name: str, labels: tuple = label) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    succeeded = (("pool", pool), ("state", "succeeded"))
    deadline = time.monotonic() + 30
    while True:  # metrics land right after the batch's last job
        after = _scrape(api_url)
        if delta("renderfarm_images_total", succeeded) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert delta("renderfarm_images_total", succeeded) == n
    assert delta("renderfarm_images_total", (("pool", pool), ("state", "failed"))) == 0
    assert delta("renderfarm_queue_wait_seconds_count") == n
    assert delta("renderfarm_render_seconds_per_image_count") == n
    assert delta("renderfarm_render_seconds_per_image_sum") > 0
    assert delta("renderfarm_batch_size_sum") == n
    assert 1 <= delta("renderfarm_batch_size_count") <= n
    assert after[("renderfarm_live_workers", label)] == len(workers)
    # the gauge settles once the batch's messages are acknowledged and the workers' next
    # heartbeats no longer list the jobs as running
    deadline = time.monotonic() + 30
    while _scrape(api_url)[("renderfarm_outstanding_jobs", label)] != 0:
        assert time.monotonic() < deadline, "outstanding jobs of an idle pool did not return to 0"
        time.sleep(0.5)

    series = httpx.get(f"{api_url}/v1/throughput", params={"minutes": 5}, timeout=10).json()
    assert sum(series["pools"][pool]) >= n
    rates = {w["name"]: w["images_per_s"] for w in httpx.get(f"{api_url}/v1/workers", timeout=10).json()}
    assert any(rate > 0 for rate in rates.values()), rates
    recent = httpx.get(f"{api_url}/v1/batches", params={"limit": 5}, timeout=10).json()
    assert recent[0]["batch_id"] == batch.batch_id and recent[0]["done"] and recent[0]["jobs"] == []
    assert recent[0]["counts"]["succeeded"] == n and recent[0]["progress"] == 1.0
