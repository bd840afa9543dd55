"""The dispatcher's order on a real redis-server (no workers): fair share between tenants,
priorities with aging, no double dispatch with two replicas; the queue depths it feeds; and
submission speed with the wait lanes."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter

import pytest

from infra import keys
from infra.background import server_time
from infra.broker.app import broker_keys, make_celery
from infra.broker.depths import queue_depths
from infra.broker.dispatch import Dispatcher, broker_depth
from infra.broker.lanes import enqueue
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state.job_store import JobStore, NewJob
from infra.submission.submitter import Submitter, new_id

DB = 4
POOL = "unit-pool"


@pytest.fixture
def r(redis_db):
    return redis_db(DB)


@pytest.fixture
def app(redis_server):
    celery = make_celery(Settings(redis_url=redis_server.db_url(DB)))
    yield celery
    celery.close()


def _submit(r, tenant: str, priority: str, n: int, pool: str = POOL) -> list[str]:
    """Record ``n`` queued jobs and put them in their lane, as the Submitter does."""
    store = JobStore(r)
    jobs = [NewJob(new_id(), RenderRequest(prompt="p", seed=1, model="null"), pool) for _ in range(n)]
    store.create_batch(new_id(), jobs, priority=priority, tenant=tenant)
    enqueue(r, [(j.job_id, pool) for j in jobs], tenant=tenant, priority=priority)
    return [j.job_id for j in jobs]


def _drain(dispatcher: Dispatcher, per_pass: int, *, now=None) -> list[str]:
    order = []
    while ids := dispatcher.pop(POOL, per_pass, now=now):
        order += ids
    return order


def test_another_tenants_ten_high_jobs_overtake_a_2000_job_backlog(r, app):
    catalog = _submit(r, "catalog", "normal", 1000) + _submit(r, "catalog", "low", 1000)
    dispatcher = Dispatcher(r, app, aging_s=300)
    first = dispatcher.pop(POOL, 16)             # the catalog alone, before the other tenant arrives
    interactive = _submit(r, "interactive", "high", 10)
    order = first + _drain(dispatcher, 16)
    assert sorted(order) == sorted(catalog + interactive)             # each job exactly once
    positions = [order.index(j) for j in interactive]
    print(f"\ninteractive jobs at dispatch positions {positions} of {len(order)}")
    assert max(positions) < 16 + 20                 # weights 4 (high) : 2 (normal) → 2 of every 3 slots
    # within the catalog tenant: normal before low (no aging yet), each lane first-in first-out
    rest = [j for j in order if j in set(catalog)]
    assert rest == catalog


def test_busy_tenants_share_by_priority_weight(r, app):
    normal = set(_submit(r, "a", "normal", 300))
    _submit(r, "b", "low", 300)
    order = Dispatcher(r, app, aging_s=0).pop(POOL, 300)
    share = Counter("normal" if j in normal else "low" for j in order)
    assert share["low"] > 0 and abs(share["normal"] / share["low"] - 2.0) < 0.1, share


def test_an_idle_tenant_banks_no_credit(r, app):
    dispatcher = Dispatcher(r, app, aging_s=0)
    _submit(r, "a", "normal", 1000)
    dispatcher.pop(POOL, 600)                           # "a" alone for a while
    late = set(_submit(r, "b", "normal", 100))
    window = dispatcher.pop(POOL, 40)
    assert 15 <= sum(j in late for j in window) <= 25   # an even share, not 40 in a row


def test_low_jobs_age_past_a_persistent_high_load(r, app):
    """Within a tenant, ``high`` comes first, but a ``low`` job that waited two aging periods
    competes as ``high`` and, older, goes first: it makes progress while high load persists."""
    def run(aging_s: float) -> tuple[int | None, int]:
        r.flushdb()
        low = set(_submit(r, "t", "low", 50))
        dispatcher = Dispatcher(r, app, aging_s=aging_s)
        start = server_time(r)
        done_low, first_tick_all_low = 0, None
        for tick in range(30):                          # 1 simulated second per tick
            _submit(r, "t", "high", 20)                 # more high arrives than is dispatched
            popped = dispatcher.pop(POOL, 10, now=start + tick)
            done_low += sum(j in low for j in popped)
            if done_low == len(low) and first_tick_all_low is None:
                first_tick_all_low = tick
        return first_tick_all_low, done_low

    assert run(aging_s=0) == (None, 0)                  # strict priority: low starves
    tick, done = run(aging_s=5)
    assert done == 50 and tick <= 10 + 5, tick          # eligible as high after 10 s, then oldest first


def test_popped_jobs_are_indexed_for_the_reaper_and_canceled_ones_dropped(r, app):
    ids = _submit(r, "t", "normal", 6)
    assert [r.zscore(keys.pending(keys.shard(j)), j) for j in ids] == [None] * 6  # in a lane: no message yet
    store = JobStore(r)
    store.cancel(ids[0])
    store.cancel(ids[3])
    popped = Dispatcher(r, app).pop(POOL, 10)
    assert popped == [ids[1], ids[2], ids[4], ids[5]]
    assert all(r.zscore(keys.pending(keys.shard(j)), j) is not None for j in popped)
    assert not r.sismember(keys.WAIT_POOLS, POOL)        # lanes empty: the pool leaves the index


def test_a_canceled_backlog_stops_counting_even_without_workers(r, app):
    """Scale from zero must not start a worker for canceled jobs."""
    canceled = _submit(r, "t", "low", 500)
    kept = _submit(r, "t", "normal", 3)
    store = JobStore(r)
    for job_id in canceled:
        store.cancel(job_id)
    assert queue_depths(r, [], pools=[])[0]["outstanding"] == 503
    assert Dispatcher(r, app).tick() == {}              # no worker: nothing published, dead heads dropped
    assert queue_depths(r, [], pools=[])[0]["outstanding"] == 3
    assert broker_depth(r, POOL) == 0 and r.llen(keys.lane(POOL, "t:normal")) == len(kept)


def test_two_replicas_never_dispatch_a_job_twice_nor_overfill(r, app):
    ids = set(_submit(r, "a", "normal", 400) + _submit(r, "b", "low", 200))
    replicas = [Dispatcher(r, app), Dispatcher(r, app)]
    consumed: list[str] = []
    peak = [0]
    stop = threading.Event()

    def replica(d: Dispatcher) -> None:
        while not stop.is_set():
            d.dispatch_pool(POOL, capacity=8)           # target: 16 messages in the broker queue
            peak[0] = max(peak[0], broker_depth(r, POOL))

    threads = [threading.Thread(target=replica, args=(d,)) for d in replicas]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(consumed) < len(ids) and time.monotonic() < deadline:   # a "worker": take 4 at a time
        for key in broker_keys(POOL):
            while (raw := r.rpop(key)) is not None:
                consumed.append(json.loads(base64.b64decode(json.loads(raw)["body"]))[1]["job_id"])
        time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join()
    assert len(consumed) == len(set(consumed)) == len(ids) and set(consumed) == ids
    assert peak[0] <= 16


def test_queue_depths_count_lanes_and_broker_and_the_oldest_wait(r, app):
    _submit(r, "t", "normal", 30)
    time.sleep(0.2)
    Dispatcher(r, app).dispatch_pool(POOL, capacity=5)  # 10 go to the broker, 20 stay in the lane
    row = next(x for x in queue_depths(r, [], pools=["idle-pool"]) if x["pool"] == POOL)
    assert broker_depth(r, POOL) == 10
    assert row["queued"] == row["outstanding"] == 30 and row["reserved"] == row["running"] == 0
    assert 0.2 <= row["oldest_wait_s"] < 30
    idle = next(x for x in queue_depths(r, [], pools=["idle-pool"]) if x["pool"] == "idle-pool")
    assert idle["outstanding"] == 0 and idle["oldest_wait_s"] == 0.0
    Dispatcher(r, app).dispatch_pool(POOL, capacity=50)  # the lane empties: the oldest job is a message now
    row = next(x for x in queue_depths(r, [], pools=[]) if x["pool"] == POOL)
    assert broker_depth(r, POOL) == row["queued"] == 30 and 0.2 <= row["oldest_wait_s"] < 30


@pytest.mark.parametrize("n,limit_s", [(1632, 1.0), (10_000, 2.0)])
def test_submission_stays_fast(r, app, n, limit_s):
    """Routing, records and lanes cost a few round trips, not one per job. The limit is on the
    submitting process's CPU time, best of three: on this shared machine (load ≫ cores) wall time
    mostly measures waiting for a core; both are printed. Putting 10,000 ids in the lanes costs
    ~0.1 s, where publishing 10,000 Celery messages (the path before the dispatcher) took ~8 s."""
    submitter = Submitter(JobStore(r), app, "null", r)
    requests = [RenderRequest(prompt=f"prompt {i}", width=64, height=64) for i in range(n)]
    submitter.submit(requests[:10])  # warm up the connection and scripts
    runs = []
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        accepted = submitter.submit(requests, tenant="bulk", priority="low")
        runs.append((time.process_time() - c0, time.perf_counter() - w0))
        assert len(accepted.job_ids) == n
    cpu, wall = min(runs)
    t0 = time.perf_counter()
    enqueue(r, [(j, POOL) for j in accepted.job_ids], tenant="again", priority="low")
    lanes = time.perf_counter() - t0
    print(f"\nsubmitted {n} jobs: best {cpu:.3f}s CPU, {wall:.3f}s wall (lanes alone {lanes:.3f}s)")
    assert cpu < limit_s and lanes < limit_s / 4
    assert queue_depths(r, [], pools=[])[0]["queued"] == 3 * n + 10


def test_tenants_share_by_gpu_seconds_not_job_count(r, app):
    """A tenant whose jobs cost 10× the GPU-seconds gets ~1/10 of the jobs
    (an equal share of accelerator time), not half of them."""
    store = JobStore(r)
    ids = {}
    for tenant, cost in (("heavy", 10.0), ("light", 1.0)):
        jobs = [NewJob(new_id(), RenderRequest(prompt="p", seed=1, model="null"), POOL, cost_s=cost)
                for _ in range(300)]
        store.create_batch(new_id(), jobs, tenant=tenant)
        enqueue(r, [(j.job_id, POOL) for j in jobs], tenant=tenant, priority="normal", costs=[j.cost_s for j in jobs])
        ids[tenant] = {j.job_id for j in jobs}
    order = Dispatcher(r, app, aging_s=0).pop(POOL, 220)
    heavy = sum(j in ids["heavy"] for j in order)
    light = sum(j in ids["light"] for j in order)
    assert heavy > 0 and abs(light / heavy - 10.0) < 1.5, (heavy, light)
