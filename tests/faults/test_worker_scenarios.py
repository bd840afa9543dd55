"""Fault scenarios of the worker itself: a hung render, wrong S3 credentials, and a
request that kills its worker. Same farm, helpers and table as ``test_scenarios.py``; each
records one row and accounts for every job (nothing lost, nothing run twice). Recovery seconds:

- j: from the hung worker's exit (its render watchdog, ``RENDERFARM_RENDER_STALL_S``) until
  every job it held had succeeded on the healthy worker;
- k: – (no outage: the worker with the wrong secret finds its credentials refused before it
  takes any job, and its breaker is open from its first heartbeat);
- m: from the first crash until the killer was dead-lettered (the crashes, the lease expiries
  and the supervisor's restarts in between: bisection across attempts at work).
"""

from __future__ import annotations

import time

import httpx
import pytest

from infra import keys
from worker.faults import HANG_ENV, KILL_ENV
from worker.watchdog import EXIT_STALLED

from .farm import LEASE_S, TERMINAL, request

pytestmark = pytest.mark.faults


def _running_on(farm, worker_name: str, job_ids) -> list[str]:
    return [j for j, (state, worker, _) in zip(job_ids, farm.states(job_ids)) if state == "running"
            and worker == worker_name]


def _used(farm, job_id: str) -> int:
    """Attempts charged to the job (``attempts - attempt_base``)."""
    attempts, base = farm.redis.hmget(keys.job(job_id), "attempts", "attempt_base")
    return int(attempts or 0) - int(base or 0)


def _assert_clean(row: dict, **expected) -> None:
    assert row["lost"] == 0 and row["run_twice"] == 0, row
    for key, value in expected.items():
        assert row[key] == value, row


def test_j_a_hung_render_beside_a_healthy_worker(fault_farm):
    """The hung worker's render waits forever at its first step (``RENDERFARM_TEST_HANG_PROMPT``
    matches every prompt, as a wedged driver would hang any render). Its watchdog gives up after
    3 s without a step: the worker deregisters and exits 70, its leases expire, and the reaper
    hands its jobs to the healthy worker, where they succeed (the hang was the worker's, not the
    jobs'), their lost attempt refunded."""
    farm = fault_farm
    (hung,) = farm.add_workers(1, batch_size=8, step_delay_s=0.1,
                               **{HANG_ENV: "fault test", "RENDERFARM_RENDER_STALL_S": "3"})
    job_ids = farm.submit([request(i, steps=4) for i in range(40)])
    held = farm.wait_for(lambda: _running_on(farm, hung.worker_name, job_ids), timeout=60)
    (healthy,) = farm.add_workers(1, batch_size=8, step_delay_s=0.05)
    code = hung.proc.wait(timeout=60)
    exited = time.monotonic()
    assert code == EXIT_STALLED, hung.log_tail(40)
    assert farm.registry_entry(hung.worker_name) == {}  # deregistered: nothing of it looks alive
    farm.wait_for(lambda: all(s == "succeeded" for s, _, _ in farm.states(held)), timeout=LEASE_S + 60)
    recovery = time.monotonic() - exited
    farm.wait(job_ids, timeout=120)
    row = farm.account("j. a hung render beside a healthy worker", job_ids, recovery, held_by_hung=len(held),
                       exit_code=code)
    _assert_clean(row, succeeded=40, failed=0, objects=40)
    assert "watchdog: render of a group of" in hung.log_tail(60)
    statuses = farm.statuses(job_ids)
    assert all(s.worker == healthy.worker_name for s in statuses), statuses
    assert all(_used(farm, j) == 1 for j in job_ids)  # the hung attempt was not charged
    assert healthy.running


def test_k_wrong_s3_secret_beside_a_healthy_worker(fault_farm):
    """A worker whose S3 secret is wrong finds it out before taking any job (a HEAD of the
    bucket answers 403): its breaker opens at once, it consumes nothing, and every job succeeds
    on the healthy worker at its first attempt. The same error met at upload time releases the
    job without spending its attempt and opens the breaker (``tests/unit/worker/test_runner.py``)."""
    farm = fault_farm
    (bad,) = farm.add_workers(1, batch_size=8, step_delay_s=0.05, AWS_SECRET_ACCESS_KEY="not-the-secret")
    entry = farm.registry_entry(bad.worker_name)
    assert entry["healthy"] is False and entry["breaker"]["open"], entry
    assert "S3 credentials refused" in entry["breaker"]["reason"], entry
    job_ids = farm.submit([request(i, steps=4) for i in range(40)])
    (healthy,) = farm.add_workers(1, batch_size=8, step_delay_s=0.05)
    farm.wait(job_ids, timeout=120)
    row = farm.account("k. wrong S3 secret beside a healthy worker", job_ids, None,
                       breaker_reason=entry["breaker"]["reason"][:60])
    _assert_clean(row, succeeded=40, failed=0, objects=40)
    statuses = farm.statuses(job_ids)
    assert all(s.worker == healthy.worker_name and s.attempts == 1 for s in statuses), statuses
    assert bad.running and farm.registry_entry(bad.worker_name)["healthy"] is False


def _until_terminal(farm, job_ids, timeout: float) -> int:
    """Restart any dead worker (as a supervisor would) until every job is terminal; returns the restarts."""
    restarts = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(state in TERMINAL for state, _, _ in farm.states(job_ids)):
            return restarts
        for worker in farm.workers:
            if not worker.running:
                worker.start()
                restarts += 1
        time.sleep(0.2)
    raise TimeoutError(f"jobs not terminal within {timeout}s: {farm.states(job_ids)}")


def test_m_a_request_that_kills_its_worker_in_a_batch_of_8(fault_farm):
    """One request of 8 ends its worker's process (``os._exit(137)``, ``RENDERFARM_TEST_KILL_PROMPT``)
    whenever it is rendered, on any worker. Two workers, restarted when they die. Bisection across
    attempts: the batch of 8 dies together (no attempt charged), its jobs come back as suspects
    rendered in halves (4, then 2), then the killer alone, which spends its 3 attempts and is
    dead-lettered; the 7 others succeed. A dead-letter retry is accepted once, then refused.

    The workers are overlapped (the default): before a suspect group renders, the groups rendered
    before it are stored, so that its crash costs them nothing (no job renders twice)."""
    farm = fault_farm
    requests = [request(i) for i in range(8)]
    requests[5] = request(5, prompt="KILLER request")
    farm.add_workers(2, batch_size=8, step_delay_s=0.05, **{KILL_ENV: "KILLER"})  # ready before they can die
    job_ids = farm.submit(requests)
    killer = job_ids[5]
    first_crash = farm.wait_for(lambda: time.monotonic() if any(not w.running for w in farm.workers) else None,
                                timeout=60, interval=0.05)
    restarts = _until_terminal(farm, job_ids, timeout=300)
    recovery = time.monotonic() - first_crash
    row = farm.account("m. a request that kills its worker, in a batch of 8", job_ids, recovery,
                       worker_restarts=restarts, killer_attempts=farm.store.get_job(killer).attempts)
    _assert_clean(row, succeeded=7, failed=1, objects=7)
    status = farm.store.get_job(killer)
    assert status.state == "failed" and status.error.type == "WorkerLost", status
    assert "while rendering it alone" in status.error.message, status.error
    assert farm.redis.hget(keys.job(killer), "kills") == "3" and _used(farm, killer) == 3
    assert all(_used(farm, j) == 1 for j in job_ids if j != killer)  # no innocent lost an attempt
    assert restarts >= 3  # lost with the 8 (and with smaller groups, as they fall), then alone three times
    retry = httpx.post(f"{farm.api.url}/v1/dead-letter/{killer}/retry", timeout=30)
    assert retry.status_code == 202, retry.text
    _until_terminal(farm, [killer], timeout=120)
    assert farm.store.get_job(killer).state == "failed"
    refused = httpx.post(f"{farm.api.url}/v1/dead-letter/{killer}/retry", timeout=30)
    assert refused.status_code == 409 and "killed its worker" in refused.json()["detail"], refused.text
