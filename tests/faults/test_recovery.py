"""Recovery paths on real processes, beyond the table's scenarios: malformed messages,
cancellation of running jobs, timeouts, duplicate deliveries, idempotency, the dead-letter
routes and the circuit breaker.

Most tests share one farm (one worker that poisons prompts containing ``POISON``, with a
3-second job timeout and 0.1-second steps); the circuit breaker trips its worker, so it gets
its own.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import time

import httpx
import pytest

from infra.broker.app import TASK_NAME
from infra.broker.publish import publish_jobs
from infra.localstack import patched_environ
from infra.settings import Settings
from infra.storage.s3 import Storage
from worker.breaker import CircuitBreaker
from worker.faults import POISON_ENV

from .farm import FaultFarm, request

pytestmark = pytest.mark.faults
QUEUE = "renderfarm.null"


@pytest.fixture(scope="module")
def farm(fault_redis, fault_s3, run_dir, cache_dir):
    farm = FaultFarm("recovery", fault_redis, fault_s3, run_dir, cache_dir, RENDERFARM_JOB_TIMEOUT_S="3")
    try:
        farm.start()
        farm.add_workers(1, batch_size=8, step_delay_s=0.1, **{POISON_ENV: "POISON"})
        yield farm
    finally:
        farm.stop()


@pytest.fixture(scope="module")
def celery_app(farm):
    from infra.broker.app import make_celery

    app = make_celery(Settings(redis_url=farm.env["RENDERFARM_REDIS_URL"]))
    yield app
    app.close()


def _envelope(celery_app, **send) -> dict:
    """A real Celery message as kombu stores it in Redis, sent to a scratch queue and taken back."""
    celery_app.send_task(TASK_NAME, queue="scratch", routing_key="scratch", **send)
    return json.loads(celery_app.connection_for_write().default_channel.client.rpop("scratch"))


def test_malformed_messages_are_rejected_and_the_worker_lives(farm, celery_app):
    worker = farm.workers[0]
    pickled = _envelope(celery_app, kwargs={"job_id": "x"})
    pickled["content-type"] = "application/x-python-serialize"
    pickled["body"] = base64.b64encode(pickle.dumps(((), {"job_id": "x"}, {}))).decode()
    unknown = _envelope(celery_app, kwargs={"job_id": "x"})
    unknown["headers"]["task"] = "no.such.task"
    garbage = [
        "this is not JSON {{{",
        json.dumps({"hello": "world"}),
        json.dumps([1, 2, 3]),
        json.dumps(_envelope(celery_app, kwargs={"job_id": 12345})),
        json.dumps(_envelope(celery_app, kwargs={"job_id": "../../etc/passwd"})),
        json.dumps(_envelope(celery_app, args=["positional"])),
        json.dumps(pickled),
        json.dumps(unknown),
    ]
    for body in garbage:
        farm.redis.lpush(QUEUE, body)
    farm.wait_for(lambda: not farm.redis.llen(QUEUE), timeout=30)
    job_ids = farm.submit([request(i) for i in range(3)])
    assert [s.state for s in farm.wait(job_ids, timeout=30)] == ["succeeded"] * 3
    assert worker.running
    log_text = worker.log_tail(400)
    assert log_text.count("rejected malformed message from the broker") == 3  # not kombu envelopes
    assert log_text.count("rejected malformed message ") >= 3 + 3  # bad job ids and a missing one
    assert "Refusing to deserialize untrusted content of type pickle" in log_text  # Celery's own refusal
    assert "Received unregistered task of type 'no.such.task'" in log_text


def test_canceling_every_job_of_a_running_group_stops_it_between_steps(farm):
    """The group stops at the first progress write after the last cancel: the worker writes
    progress at most every 0.2 s (``progress_interval_s``), two or three of these 0.1 s steps, so
    it stops within three steps of the last progress it recorded, far from the 100th."""
    job_ids = farm.submit([request(i, steps=100) for i in range(4)])  # 10 s of steps
    farm.wait_for(lambda: all(s.state == "running" and s.progress > 0 for s in farm.statuses(job_ids)), timeout=30)
    for job_id in job_ids:
        assert farm.client.cancel(job_id)["canceled"]
    nxt = farm.submit([request(50)])
    assert farm.wait(nxt, timeout=30)[0].state == "succeeded"
    statuses = farm.statuses(job_ids)
    assert [s.state for s in statuses] == ["canceled"] * 4
    stopped = re.findall(r"stopped a group of 4: .* at step (\d+) of 100", farm.workers[0].log_tail(100))
    last_recorded = round(100 * max(s.progress for s in statuses))
    assert len(stopped) == 1 and 0 < int(stopped[0]) - last_recorded <= 3, (stopped, last_recorded)
    renders, writes = farm.counters()
    assert not any(renders.get(j) or writes.get(j) for j in job_ids)


def test_canceling_part_of_a_running_group_lets_the_rest_finish(farm):
    job_ids = farm.submit([request(i, steps=20) for i in range(4)])  # 2 s of steps
    farm.wait_for(lambda: all(s.state == "running" for s in farm.statuses(job_ids)), timeout=30)
    for job_id in job_ids[:2]:
        farm.client.cancel(job_id)
    statuses = farm.wait(job_ids, timeout=30)
    assert [s.state for s in statuses] == ["canceled", "canceled", "succeeded", "succeeded"]
    objects = farm.objects()
    assert all(s.result.key in objects for s in statuses[2:])
    assert not any(k.endswith(f"{j}.png") for k in objects for j in job_ids[:2])
    renders, writes = farm.counters()
    assert [writes.get(j, 0) for j in job_ids] == [0, 0, 1, 1]


def test_a_job_over_its_timeout_fails_with_timeout_error(farm):
    (slow,) = farm.submit([request(1, steps=60)])  # 6 s of steps, timeout 3 s
    status = farm.wait([slow], timeout=30)[0]
    assert status.state == "failed" and status.error.type == "TimeoutError" and status.attempts == 1
    assert "timeout of 3s" in status.error.message


def test_a_duplicate_message_is_harmless(farm, celery_app):
    (job_id,) = farm.submit([request(7, steps=10)])
    publish_jobs(celery_app, [(job_id, "null")])  # delivered twice while it runs
    assert farm.wait([job_id], timeout=30)[0].state == "succeeded"
    publish_jobs(celery_app, [(job_id, "null")])  # and once more after it finished
    farm.wait_for(lambda: f"skipping job {job_id}: succeeded" in farm.workers[0].log_tail(200), timeout=10)
    renders, writes = farm.counters()
    assert renders[job_id] == 1 and writes[job_id] == 1 and farm.store.get_job(job_id).attempts == 1


def test_the_final_object_is_written_once(farm):
    with patched_environ(farm.env):  # the farm's endpoint, bucket and credentials, for both of its clients
        storage = Storage(Settings())
    assert storage.put_once("once/a.png", b"first", "image/png", {}) is True
    assert storage.put_once("once/a.png", b"second", "image/png", {}) is False
    assert farm.s3.get_object(Bucket=farm.bucket, Key="once/a.png")["Body"].read() == b"first"


def test_idempotency_key_returns_the_first_batch(farm):
    first = farm.client.submit_batch([request(i) for i in range(3)], idempotency_key="nightly-42")
    again = farm.client.submit_batch([request(i) for i in range(5)], idempotency_key="nightly-42")
    other = farm.client.submit_batch([request(1)], idempotency_key="nightly-43")
    assert (again.batch_id, again.job_ids) == (first.batch_id, first.job_ids)
    assert other.batch_id != first.batch_id
    assert farm.client.batch(first.batch_id).total == 3
    farm.wait(first.job_ids + other.job_ids, timeout=30)


def test_dead_letter_list_and_retry(farm):
    (job_id,) = farm.submit([request(3, prompt="POISON again")])
    assert farm.wait([job_id], timeout=30)[0].state == "failed"
    api = farm.api.url
    listed = httpx.get(f"{api}/v1/dead-letter").json()
    entry = next(j for j in listed["jobs"] if j["job_id"] == job_id)
    assert entry["error"]["type"] == "RuntimeError" and entry["attempts"] == 1
    assert httpx.post(f"{api}/v1/dead-letter/{job_id}/retry").status_code == 202
    farm.wait_for(lambda: farm.store.get_job(job_id).attempts == 2 and farm.store.get_job(job_id).state == "failed",
                  timeout=30)  # it ran again (and, still poisoned, failed again)
    assert httpx.post(f"{api}/v1/dead-letter/deadbeef/retry").status_code == 404
    (ok,) = farm.submit([request(4)])
    farm.wait([ok], timeout=30)
    assert httpx.post(f"{api}/v1/dead-letter/{ok}/retry").status_code == 409


def test_circuit_breaker_unit():
    tripped = []
    breaker = CircuitBreaker(3, on_trip=lambda: tripped.append(1))
    for failed in (True, True, False, True, True):
        breaker.record(failed)
    assert not breaker.open
    breaker.record(True)
    assert breaker.open and tripped == [1]
    breaker.half_open()
    breaker.record(True)
    assert breaker.open and tripped == [1, 1]  # half-open: one more failure trips it again
    breaker.record(False)
    assert not breaker.open and breaker.consecutive_failures == 0


@pytest.mark.farm_settings(RENDERFARM_BREAKER_FAILURES="2", RENDERFARM_BREAKER_COOLDOWN_S="0")
def test_circuit_breaker_stops_a_worker_that_fails_every_batch(fault_farm):
    farm = fault_farm
    (worker,) = farm.add_workers(1, batch_size=8, step_delay_s=0.02, **{POISON_ENV: "fault"})  # poisons all
    for i in range(2):
        job_ids = farm.submit([request(i)])
        assert farm.wait(job_ids, timeout=30)[0].state == "failed"
    farm.wait_for(lambda: farm.registry_entry(worker.worker_name).get("healthy") is False, timeout=10)
    # /healthz reuses one answer for RENDERFARM_HEALTH_CACHE_S: wait for the next one to name it
    health = farm.wait_for(lambda: (h := httpx.get(f"{farm.api.url}/healthz")).json().get("unhealthy_workers") and h,
                           timeout=10)
    assert health.status_code == 200 and health.json()["unhealthy_workers"] == [worker.worker_name]
    waiting = farm.submit([request(i) for i in range(10, 13)])
    time.sleep(3.0)
    assert [s.state for s in farm.statuses(waiting)] == ["queued"] * 3  # nobody takes them
    renders, _ = farm.counters()
    assert not any(renders.get(j) for j in waiting) and worker.log_tail(200).count(" failed: RuntimeError") == 2
    assert worker.running and "circuit breaker open" in worker.log_tail(100)
