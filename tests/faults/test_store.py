"""The job-state store's transitions and the reaper, on a real redis-server (no workers).

Fencing, monotonic terminal states, consistent counters, attempt budget and dead letters,
lease expiry, lost messages, orphaned unacked messages, and several reapers at once.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from infra import keys
from infra.broker.app import make_celery
from infra.broker.publish import publish_jobs
from infra.broker.reaper import Reaper, queued_job_ids
from infra.schemas import JOB_STATES, JobError, JobResult
from infra.settings import Settings
from infra.state import shards
from infra.state.job_store import CANCELED, HELD, STALE, JobStore, NewJob, StartedJob

from .farm import request

pytestmark = pytest.mark.faults
RESULT = JobResult(key="k", width=64, height=64, seed=1, content_type="image/png", bytes=3)
ERROR = JobError(type="RuntimeError", message="boom")


DB = 15  # the fault farms use databases 1…14


@pytest.fixture
def r(fault_redis):
    client = fault_redis.client(db=DB)
    client.flushdb()
    return client


@pytest.fixture
def app(fault_redis):
    celery = make_celery(Settings(redis_url=fault_redis.db_url(DB)))
    yield celery
    celery.close()


def _store(r, **kw) -> JobStore:
    return JobStore(r, **{"lease_s": 5.0, **kw})


def _batch(store: JobStore, n: int, batch_id: str = "b1") -> list[str]:
    ids = [f"{batch_id}j{i}" for i in range(n)]
    store.create_batch(batch_id, [NewJob(j, request(i), "null") for i, j in enumerate(ids)])
    return ids


def _counts_add_up(store: JobStore, batch_id: str = "b1") -> None:
    counts = store.r.hgetall(keys.batch_counts(batch_id))
    total = int(store.batch_meta(batch_id)["total"])
    states = [s.state for s in store.get_jobs(store.batch_job_ids(batch_id))]
    assert {s: int(counts.get(s, 0)) for s in JOB_STATES} == {s: states.count(s) for s in JOB_STATES}
    assert sum(int(counts.get(s, 0)) for s in JOB_STATES) == total
    progress = sum(1.0 if s.state in ("succeeded", "failed", "canceled") else s.progress
                   for s in store.get_jobs(store.batch_job_ids(batch_id)))
    assert float(counts["done"]) == pytest.approx(progress, abs=1e-6)


def _expire(store: JobStore, job_id: str) -> None:
    """Make a running job's lease (its score in the lease index) run out now (as if its worker died long ago)."""
    store.r.zadd(keys.leases(keys.shard(job_id)), {job_id: 1})


def test_fencing_and_monotonic_terminal_states(r):
    store = _store(r)
    (a,) = _batch(store, 1)
    first = store.start_many([a], "w1")[a]
    assert store.start_many([a], "w2")[a] == "running"  # a live lease is never taken over
    _expire(store, a)
    second = store.start_many([a], "w2")[a]  # an expired one is
    assert (first.attempt, second.attempt) == (1, 2)
    assert store.progress_many([(first, 0.5)]) == {a: STALE}
    assert not store.succeed(first, RESULT) and store.fail(first, ERROR) is None
    assert store.progress_many([(second, 0.5)]) == {a: HELD}
    assert store.succeed(second, RESULT)
    assert not store.cancel(a) and not store.succeed(second, RESULT) and store.fail(second, ERROR) is None
    assert store.start_many([a], "w3")[a] == "succeeded"
    assert store.get_job(a).state == "succeeded" and store.get_job(a).worker == "w2"
    assert r.zscore(keys.leases(keys.shard(a)), a) is None and r.zscore(keys.pending(keys.shard(a)), a) is None
    _counts_add_up(store)


def test_succeed_many_is_fenced_per_job(r):
    """One pipelined round trip records a group; each job's write stays fenced on its own."""
    store = _store(r)
    a, b, c = _batch(store, 3)
    started = store.start_many([a, b, c], "w1")
    _expire(store, b)
    taken = store.start_many([b], "w2")[b]  # b's attempt 1 is stale now
    assert store.cancel(c)
    assert store.succeed_many([(started[a], RESULT), (started[b], RESULT), (started[c], RESULT)]) == {
        a: True, b: False, c: False}
    assert [s.state for s in store.get_jobs([a, b, c])] == ["succeeded", "running", "canceled"]
    assert store.succeed_many([(taken, RESULT)]) == {b: True} and store.succeed_many([]) == {}
    _counts_add_up(store)


def test_a_group_spanning_batches_and_tenants_ends_as_one_job_after_another_would(r):
    """The group scripts write each shared key once per call (a shard's lease and pending index, a
    batch's counters, a tenant's quota): the counters, indexes, quotas and TTLs end as the jobs'
    writes one after another leave them, and each job is still fenced on its own."""
    store = _store(r, job_ttl_s=100)
    ids = {}
    for b, tenant in (("b1", "t1"), ("b2", "t2")):
        ids[b] = [f"{b}j{i}" for i in range(6)]
        store.create_batch(b, [NewJob(j, request(i), "null", cost_s=1.5, cost_bytes=100 + i)
                               for i, j in enumerate(ids[b])], tenant=tenant)
    everyone = ids["b1"] + ids["b2"]
    assert len({keys.shard(j) for j in everyone}) > 1  # several script calls, one per shard
    started = store.start_many(everyone, "w1")
    assert all(isinstance(s, StartedJob) and s.attempt == 1 and s.epoch for s in started.values())
    assert store.start_many(everyone[:2], "w2") == dict.fromkeys(everyone[:2], "running")
    assert all(r.zscore(keys.leases(keys.shard(j)), j) and r.zscore(keys.pending(keys.shard(j)), j) is None
               for j in everyone)
    jobs = [started[j] for j in everyone]  # type: ignore[misc]
    assert store.mark_rendering(jobs) == dict.fromkeys(everyone, HELD)
    assert store.progress_many((job, 0.5) for job in jobs) == dict.fromkeys(everyone, HELD)
    assert {r.hget(keys.job(j), "group_n") for j in everyone} == {str(len(everyone))}
    _counts_add_up(store, "b1")
    _counts_add_up(store, "b2")
    late = ids["b2"][-1]
    assert store.cancel(late)
    stale = StartedJob(everyone[0], "b1", 0, jobs[0].request, "t1", jobs[0].epoch)  # another attempt's token
    assert store.succeed_many([(stale, RESULT)]) == {everyone[0]: False}
    assert store.succeed_many([(job, RESULT) for job in jobs]) == {j: j != late for j in everyone}
    assert [s.state for s in store.get_jobs(everyone)] == ["succeeded"] * 11 + ["canceled"]
    for b, tenant in (("b1", "t1"), ("b2", "t2")):
        _counts_add_up(store, b)
        quota = r.hgetall(keys.quota(tenant))
        assert int(quota["jobs"]) == -6 and float(quota["gpu_s"]) == pytest.approx(-9.0)
        assert int(quota["bytes"]) == -sum(100 + i for i in range(6))
        assert all(95 <= r.ttl(k) <= 100 for k in (keys.batch(b), keys.batch_counts(b), keys.batch_jobs(b)))
    assert all(95 <= r.ttl(keys.job(j)) <= 100 for j in everyone)
    assert not any(r.zscore(keys.leases(keys.shard(j)), j) for j in everyone)


def test_one_creation_call_writes_each_job_its_own_fields_whatever_the_job_before_it_had(r):
    """The creation script reuses one field table across a call's jobs: a job without costs after
    one with both gets neither, and each job keeps its own pool and request."""
    store = _store(r)
    costs = [(1.5, 100), (None, None), (None, 7), (2.0, None), (0.5, 9)]
    jobs = [NewJob(f"mix{i}", request(i), f"pool-{i}", cost_s=cs, cost_bytes=cb) for i, (cs, cb) in enumerate(costs)]
    store.create_batch("bmix", jobs)
    for job, (cs, cb) in zip(jobs, costs):
        record = r.hgetall(keys.job(job.job_id))
        assert record["pool"] == job.pool and record["request"] == job.request.model_dump_json()
        assert record.get("cost_s") == (None if cs is None else repr(cs))
        assert record.get("cost_bytes") == (None if cb is None else str(cb))
        assert record["batch_id"] == "bmix" and record["state"] == "queued" and record["attempts"] == "0"


def test_cancel_is_signalled_to_the_running_attempt(r):
    store = _store(r)
    a, b = _batch(store, 2)
    started = store.start_many([a, b], "w1")
    assert store.cancel(a)
    assert store.progress_many([(started[a], 0.3), (started[b], 0.3)]) == {a: CANCELED, b: HELD}
    assert store.renew_leases([started[a], started[b]]) == {a: CANCELED, b: HELD}
    assert not store.succeed(started[a], RESULT) and store.get_job(a).state == "canceled"
    _counts_add_up(store)


def test_counters_stay_consistent_under_random_transitions(r):
    store = _store(r, max_attempts=2)
    ids = _batch(store, 30)
    rng = random.Random(4)
    held: dict[str, StartedJob] = {}
    for _ in range(400):
        job_id = rng.choice(ids)
        op = rng.choice(["start", "progress", "succeed", "fail", "retryfail", "cancel", "expire", "release", "retry"])
        if op == "start":
            got = store.start_many([job_id], "w")[job_id]
            if isinstance(got, StartedJob):
                held[job_id] = got
        elif op == "expire" and job_id in held:
            _expire(store, job_id)
            store.requeue_expired([job_id])
        elif op == "retry":
            store.retry(job_id)
        elif op == "cancel":
            store.cancel(job_id)
        elif job_id in held:
            job = held[job_id]
            if op == "progress":
                store.progress_many([(job, rng.random())])
            elif op == "succeed":
                store.succeed(job, RESULT)
            elif op == "fail":
                store.fail(job, ERROR)
            elif op == "retryfail":
                store.fail(job, ERROR, retry=True)
            elif op == "release":
                store.release([job])
        _counts_add_up(store)
    states = {j: store.get_job(j).state for j in ids}
    assert shards.members(r, keys.leases) == {j for j, s in states.items() if s == "running"}
    assert shards.members(r, keys.pending) == {j for j, s in states.items() if s == "queued"}
    assert shards.members(r, keys.dead) == {j for j, s in states.items() if s == "failed"}


def test_attempt_budget_dead_letter_and_retry(r):
    store = _store(r, max_attempts=3)
    (a,) = _batch(store, 1)
    for attempt in (1, 2, 3):
        job = store.start_many([a], f"w{attempt}")[a]
        assert job.attempt == attempt
        store.mark_rendering([job])  # lost while rendering it alone: the attempt is charged
        _expire(store, a)
        moved = store.requeue_expired([a])
        assert moved == ({a: ("queued", "null")} if attempt < 3 else {a: ("failed", "")})
    status = store.get_job(a)
    assert status.state == "failed" and status.error.type == "WorkerLost" and "w3" in status.error.message
    more, dead = store.dead_letters()
    assert not more and [j.job_id for j in dead] == [a]
    assert store.dead_letters(tenant="someone-else")[1] == []
    assert store.retry(a) == "null" and store.retry(a) is None
    status = store.get_job(a)
    assert status.state == "queued" and status.error is None and r.zscore(keys.dead(keys.shard(a)), a) is None
    job = store.start_many([a], "w4")[a]
    assert job.attempt == 4  # the fencing counter keeps counting; the budget starts again
    assert store.fail(job, ERROR, retry=True) == "queued"  # a transient error spends an attempt only
    job = store.start_many([a], "w5")[a]
    assert store.fail(job, ERROR) == "failed"  # a request's own error fails at once
    assert store.get_job(a).error == ERROR
    _counts_add_up(store)


def test_release_does_not_spend_an_attempt(r):
    store = _store(r, max_attempts=1)
    (a,) = _batch(store, 1)
    job = store.start_many([a], "w1")[a]
    assert store.release([job]) == [(a, "null")]
    assert store.get_job(a).state == "queued"
    job = store.start_many([a], "w2")[a]
    store.mark_rendering([job])
    _expire(store, a)
    assert store.requeue_expired([a]) == {a: ("failed", "")}  # the budget of 1 was not spent by the release


def test_reaper_requeues_expired_leases_once_with_several_reapers(r, app):
    store = _store(r)
    ids = _batch(store, 60)
    started = store.start_many(ids, "dead-worker")
    for job_id in ids:
        _expire(store, job_id)
    reapers = [Reaper(_store(r), app, interval_s=0.05, republish_after_s=3600) for _ in range(4)]
    barrier = threading.Barrier(len(reapers))
    reports = []

    def run(reaper: Reaper) -> None:
        barrier.wait()
        for _ in range(20):
            reports.append(reaper.sweep())

    threads = [threading.Thread(target=run, args=(rp,)) for rp in reapers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    requeued = [j for rep in reports for j in rep.requeued]
    assert sorted(requeued) == sorted(ids)  # each job exactly once
    assert sum(r.llen(k) for k in r.scan_iter("renderfarm.null*")) == 60  # one message per job
    assert queued_job_ids(r) == set(ids)
    assert all(s.state == "queued" and s.attempts == 1 for s in store.get_jobs(ids))
    assert any(rep.skipped for rep in reports)  # the lock kept the sweeps apart
    assert all(store.progress_many([(started[j], 0.5)])[j] == STALE for j in ids[:3])
    _counts_add_up(store)


def test_reaper_republishes_a_lost_message_once(r, app):
    store = _store(r)
    ids = _batch(store, 5)  # recorded, but the publish "failed": no message anywhere
    publish_jobs(app, [(ids[0], "null")])  # except for this one
    reaper = Reaper(store, app, interval_s=0.05, republish_after_s=0.5)
    assert reaper.sweep().republished == []  # too young to be called lost
    time.sleep(0.6)
    assert sorted(reaper.sweep().republished) == sorted(ids[1:])
    time.sleep(0.6)
    assert reaper.sweep().republished == []  # now in the queue: never twice
    assert sum(r.llen(k) for k in r.scan_iter("renderfarm.null*")) == 5


def test_reaper_removes_orphaned_unacked_messages(r, app):
    store = _store(r)
    done, waiting, fresh = _batch(store, 3)
    store.succeed(store.start_many([done], "w")[done], RESULT)
    for tag, job_id, delivered in (("t1", done, time.time()), ("t2", waiting, 1.0), ("t3", fresh, time.time()),
                                   ("t4", "not-ours", 1.0)):
        message = {"headers": {"id": job_id}, "body": ""} if job_id != "not-ours" else {"x": 1}
        r.hset(keys.UNACKED, tag, json.dumps([message, "", "renderfarm.null"]))
        r.zadd(keys.UNACKED_INDEX, {tag: delivered})
    report = Reaper(store, app, republish_after_s=3600).sweep()
    assert report.orphans_removed == 2
    assert sorted(r.hkeys(keys.UNACKED)) == ["t3", "t4"]  # a fresh delivery and a foreign message stay


def test_unacked_messages_go_back_to_the_queue_when_the_consumer_closes(r, app):
    """What a worker's warm shutdown relies on for the messages it received but never started:
    kombu's Redis channel restores its unacknowledged messages when it closes."""
    publish_jobs(app, [(f"j{i}", "null") for i in range(3)])
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("renderfarm.null", no_ack=False)
        received = [queue.get(timeout=5) for _ in range(3)]
        assert r.hlen(keys.UNACKED) == 3 and queued_job_ids(r) == set()
        queue.close()
    assert sorted(message_job_id_of(m) for m in received) == ["j0", "j1", "j2"]
    assert r.hlen(keys.UNACKED) == 0 and queued_job_ids(r) == {"j0", "j1", "j2"}


def message_job_id_of(message) -> str:
    return message.headers["id"]


def test_dead_letters_are_paged_per_tenant(r):
    """A tenant's dead-letter page holds only its own failures, however many other tenants'
    failures are newer, and ``more`` follows its own count (the index's shards merged)."""
    store = _store(r)
    mine = [f"m{i}" for i in range(3)]
    theirs = [f"t{i}" for i in range(50)]
    store.create_batch("bm", [NewJob(j, request(i), "null") for i, j in enumerate(mine)], tenant="alice")
    store.create_batch("bt", [NewJob(j, request(i), "null") for i, j in enumerate(theirs)], tenant="bob")
    for job_id in mine + theirs:  # bob's failures are the newest
        assert store.fail(store.start_many([job_id], "w")[job_id], ERROR) == "failed"
    more, page = store.dead_letters(limit=3, tenant="alice")
    assert not more and sorted(j.job_id for j in page) == mine
    more, page = store.dead_letters(limit=2, tenant="alice")
    assert more and len(page) == 2
    more, page = store.dead_letters(offset=2, limit=2, tenant="alice")
    assert not more and len(page) == 1
    assert shards.card(r, lambda s: keys.dead_of("bob", s)) == 50 and shards.card(r, keys.dead) == 53
    # a retry takes the id out of both indexes
    assert store.retry(mine[0]) == "null"
    assert r.zscore(keys.dead_of("alice", keys.shard(mine[0])), mine[0]) is None
    assert mine[0] not in shards.members(r, keys.dead)


def test_records_never_expire_while_queued_or_running_and_ttl_restarts_at_each_end(r):
    """A job queued or running longer than the TTL is still there; each move to
    a terminal state sets the TTL afresh; the batch's keys expire only after its last job ended,
    and a dead-letter retry makes them persistent again."""
    store = _store(r, job_ttl_s=100)
    a, b = _batch(store, 2)
    batch_keys = [keys.batch("b1"), keys.batch_counts("b1"), keys.batch_jobs("b1")]
    assert [r.ttl(k) for k in [keys.job(a), keys.job(b), *batch_keys]] == [-1] * 5
    ja = store.start_many([a], "w")[a]
    assert r.ttl(keys.job(a)) == -1
    assert store.succeed(ja, RESULT)
    assert 95 <= r.ttl(keys.job(a)) <= 100 and r.ttl(keys.job(b)) == -1
    assert [r.ttl(k) for k in batch_keys] == [-1] * 3  # b is still queued
    r.expire(keys.job(a), 5)  # time passes for a
    jb = store.start_many([b], "w")[b]
    assert store.fail(jb, ERROR) == "failed"
    assert 95 <= r.ttl(keys.job(b)) <= 100 and all(95 <= r.ttl(k) <= 100 for k in batch_keys)
    assert store.retry(b) == "null"  # queued again: neither it nor its batch may expire
    assert r.ttl(keys.job(b)) == -1 and [r.ttl(k) for k in batch_keys] == [-1] * 3
    assert store.cancel(b)
    assert 95 <= r.ttl(keys.job(b)) <= 100 and all(95 <= r.ttl(k) <= 100 for k in batch_keys)


def _restart_hard(server) -> None:
    """``kill -9`` of redis-server and a restart from its AOF (a new run_id: a new epoch)."""
    server.kill()
    server.start().wait_ready()


def test_epoch_fences_a_stale_attempt_after_a_redis_rollback(fault_redis, r):
    """Redis restarted without the start of attempt 1 (a rollback: kill -9 before the fsync, a
    failover to a replica that had not received it): a new worker starts attempt 1 again, and
    the stale worker's success with the same attempt number is refused by its epoch."""
    store = _store(r)
    (job_id,) = _batch(store, 1)
    before = {k: r.dump(k) for k in (keys.job(job_id), keys.batch_counts("b1"))}
    stale = store.start_many([job_id], "w-stale")[job_id]
    assert isinstance(stale, StartedJob) and stale.attempt == 1 and len(stale.epoch) == 40
    _restart_hard(fault_redis)
    for key, dumped in before.items():  # what the lost writes leave: the job still queued, attempt 0
        r.restore(key, 0, dumped, replace=True)
    r.zrem(keys.leases(keys.shard(job_id)), job_id)
    fresh = store.start_many([job_id], "w-fresh")[job_id]
    assert fresh.attempt == stale.attempt == 1 and fresh.epoch != stale.epoch
    assert store.succeed(stale, RESULT) is False
    assert store.succeed_many([(stale, RESULT)]) == {job_id: False}  # the worker's group write, too
    assert store.progress_many([(stale, 0.5)]) == {job_id: STALE}
    assert store.succeed_many([(fresh, RESULT)]) == {job_id: True}
    assert store.get_job(job_id).worker == "w-fresh"
    _counts_add_up(store)


def test_epoch_survives_a_restart_without_rollback(fault_redis, r):
    """A job started before a restart that lost nothing: its worker's writes still count (the
    epoch compared is the one stored with the attempt, not the server's current run_id)."""
    store = _store(r, lease_s=60.0)
    (job_id,) = _batch(store, 1)
    started = store.start_many([job_id], "w1")[job_id]
    time.sleep(1.5)  # appendfsync everysec: on disk
    _restart_hard(fault_redis)
    assert store.progress_many([(started, 0.5)]) == {job_id: HELD}
    assert store.succeed(started, RESULT) is True


def test_durable_ack_modes(fault_redis, r):
    """What each ``RENDERFARM_DURABLE_ACK`` mode confirms on this redis-server (AOF on, everysec)."""
    from infra.state.durable import DurableAck, NotDurable, redis_version

    assert DurableAck(r, "off").wait() == "off"
    local = DurableAck(r, "local", fallback_s=0.1)
    assert local.wait() == ("waitaof" if redis_version(r) >= (7, 2) else "everysec-sleep")
    with pytest.raises(NotDurable):  # no replica here
        DurableAck(r, "replicas", timeout_ms=100).wait()
    with pytest.raises(ValueError):
        DurableAck(r, "sometimes")
