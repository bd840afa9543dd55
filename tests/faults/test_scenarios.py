"""The fault-injection scenarios, on real processes, each accounting for every job.

Each test prints and records one row of the fault table (``test-artifacts/faults.json``):
jobs submitted, succeeded, failed, canceled, lost (not terminal at the end, or succeeded
without its object), run twice (a job rendered to completion, or its object written, more than
once: counted by the workers in Redis, see ``worker/faults.py``), and recovery seconds:

- a: from the ``kill -9`` until every job the dead worker held had succeeded elsewhere;
- b, c: from the service being back until the farm completed a job again;
- f: from SIGTERM until the worker had exited;
- d, e, g: no outage to recover from (–);
- h: from redis-server being back (after its ``kill -9``) until the farm completed a job again;
- n: from the ``kill -9`` of the worker under ``renderfarm up`` until its restart was announced;
- j, k, m (the worker's own faults): see ``test_worker_scenarios.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from infra import keys
from infra.localstack import ManagedProcess, free_port
from infra.localstack.services import cli_command
from infra.state import shards
from infra.state.durable import DurableAck
from tests.fault_table import record_row
from worker.faults import OOM_ENV, POISON_ENV

from .farm import FAULT_SETTINGS, LEASE_S, request

pytestmark = [pytest.mark.faults, pytest.mark.long]


def _running_on(farm, worker_name: str, job_ids, below: float = 1.0) -> list[str]:
    return [j for j, (state, worker, progress) in zip(job_ids, farm.states(job_ids))
            if state == "running" and worker == worker_name and progress < below]


def _succeeded(farm, job_ids) -> int:
    return sum(1 for state, _, _ in farm.states(job_ids) if state == "succeeded")


def _assert_clean(row: dict, **expected) -> None:
    assert row["lost"] == 0 and row["run_twice"] == 0, row
    for key, value in expected.items():
        assert row[key] == value, row


def test_a_kill_one_of_two_workers_mid_batch(fault_farm):
    farm = fault_farm
    victim, survivor = farm.add_workers(2, batch_size=8, step_delay_s=0.1)
    job_ids = farm.submit([request(i, steps=5) for i in range(200)])
    farm.wait_for(lambda: _running_on(farm, victim.worker_name, job_ids, below=0.5), timeout=60)
    reserved = farm.registry_entry(victim.worker_name).get("reserved_jobs", [])
    victim.kill()
    killed_at = time.monotonic()
    held = _running_on(farm, victim.worker_name, job_ids)
    affected = held + [j for j in reserved if j not in held]
    farm.wait_for(lambda: _succeeded(farm, affected) == len(affected), timeout=LEASE_S + 30, interval=0.05)
    recovery = time.monotonic() - killed_at
    farm.wait(job_ids, timeout=120)
    row = farm.account("a. kill -9 one of two workers mid-batch", job_ids, recovery, running_on_killed=len(held),
                       prefetched_by_killed=len(affected) - len(held))
    _assert_clean(row, succeeded=200, objects=200)
    assert held and recovery <= LEASE_S + 10, row
    retried = farm.statuses(held)
    assert all(s.attempts == 2 and s.worker == survivor.worker_name for s in retried), retried
    assert survivor.running


def test_b_restart_redis_mid_run(fault_farm, fault_redis):
    farm = fault_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.05)
    job_ids = farm.submit([request(i, steps=4) for i in range(120)])
    farm.wait_for(lambda: _succeeded(farm, job_ids) >= 24, timeout=60)
    fault_redis.stop()
    fault_redis.start().wait_ready()
    back = time.monotonic()
    done_at_restart = _succeeded(farm, job_ids)
    farm.wait_for(lambda: _succeeded(farm, job_ids) > done_at_restart, timeout=60)
    recovery = time.monotonic() - back
    farm.wait(job_ids, timeout=180)
    row = farm.account("b. restart redis-server (AOF on) mid-run", job_ids, recovery,
                       succeeded_before_restart=done_at_restart)
    _assert_clean(row, succeeded=120, objects=120, failed=0)
    assert all(w.running for w in farm.workers) and farm.api.running


def test_c_stop_seaweedfs_for_10s_mid_run(fault_farm, fault_s3):
    farm = fault_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.05)
    job_ids = farm.submit([request(i, steps=4) for i in range(80)])
    farm.wait_for(lambda: _succeeded(farm, job_ids) >= 16, timeout=60)
    fault_s3.stop()
    stopped = time.monotonic()
    time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped)))
    during = farm.states(job_ids)
    fault_s3.start().wait_ready()
    restarted = time.monotonic()
    # SeaweedFS answers before it accepts writes again (its volumes re-register with the master):
    # recovery is measured from the first write it accepts
    farm.s3.put_object(Bucket=farm.bucket, Key="probe/after-restart", Body=b"")
    back = time.monotonic()
    farm.s3.delete_object(Bucket=farm.bucket, Key="probe/after-restart")
    done_at_return = _succeeded(farm, job_ids)
    farm.wait_for(lambda: _succeeded(farm, job_ids) > done_at_return, timeout=90)
    recovery = time.monotonic() - back
    farm.wait(job_ids, timeout=180)
    row = farm.account("c. stop SeaweedFS for 10 s mid-run", job_ids, recovery, outage_s=round(restarted - stopped, 1),
                       writable_after_restart_s=round(back - restarted, 1),
                       failed_during_outage=sum(1 for state, _, _ in during if state == "failed"))
    _assert_clean(row, succeeded=80, objects=80, failed=0, failed_during_outage=0)
    assert all(s.attempts == 1 for s in farm.statuses(job_ids))  # no job even lost an attempt


def test_d_one_poison_request_in_a_batch_of_8(fault_farm):
    farm = fault_farm
    requests = [request(i) for i in range(8)]
    requests[5] = request(5, prompt="POISON pill")
    job_ids = farm.submit(requests)  # queued before the worker starts: it pulls all 8 as one batch
    (worker,) = farm.add_workers(1, batch_size=8, step_delay_s=0.05, **{POISON_ENV: "POISON"})
    statuses = farm.wait(job_ids, timeout=60)
    row = farm.account("d. one poison request in a batch of 8", job_ids, None)
    _assert_clean(row, succeeded=7, failed=1, objects=7)
    poisoned = statuses[5]
    assert poisoned.state == "failed" and poisoned.attempts == 1
    assert poisoned.error.type == "RuntimeError" and "POISON" in poisoned.error.message
    assert "group of 8 failed (RuntimeError" in worker.log_tail(200)
    assert worker.running and farm.registry_entry(worker.worker_name)["healthy"] is True
    after = farm.submit([request(100)])
    assert farm.wait(after, timeout=30)[0].state == "succeeded"


def test_e_injected_out_of_memory_splits_the_batch(fault_farm):
    farm = fault_farm
    job_ids = farm.submit([request(i) for i in range(16)])
    (worker,) = farm.add_workers(1, batch_size=8, step_delay_s=0.05, **{OOM_ENV: "2"})
    farm.wait(job_ids, timeout=60)
    row = farm.account("e. injected out-of-memory error", job_ids, None)
    _assert_clean(row, succeeded=16, failed=0, objects=16)
    log_text = worker.log_tail(300)
    # the shape that ran out of memory is capped (8 → 4 → 2), the worker's batch size is not lowered for good
    assert "out of memory on a group of 8; this shape now renders at most 4 at once" in log_text
    assert "out of memory on a group of 4; this shape now renders at most 2 at once" in log_text
    assert farm.registry_entry(worker.worker_name).get("batch_size") == 8
    assert worker.running


def test_f_sigterm_during_a_batch(fault_farm):
    farm = fault_farm
    victim, other = farm.add_workers(2, batch_size=8, step_delay_s=0.2)
    job_ids = farm.submit([request(i, steps=5) for i in range(64)])
    farm.wait_for(lambda: _running_on(farm, victim.worker_name, job_ids, below=0.5), timeout=60)
    held = _running_on(farm, victim.worker_name, job_ids)
    prefetched = [j for j in farm.registry_entry(victim.worker_name).get("reserved_jobs", []) if j not in held]
    victim.send_signal(signal.SIGTERM)
    signaled = time.monotonic()
    code = victim.proc.wait(timeout=60)
    exit_s = time.monotonic() - signaled
    farm.wait(job_ids, timeout=120)
    row = farm.account("f. SIGTERM during a batch", job_ids, exit_s, exit_code=code, batch_on_signal=len(held),
                       prefetched_on_signal=len(prefetched))
    _assert_clean(row, succeeded=64, objects=64)
    assert code == 0
    finished = farm.statuses(held)
    assert all(s.state == "succeeded" and s.worker == victim.worker_name for s in finished), finished
    assert all(s.attempts == 1 for s in farm.statuses(job_ids))  # nothing was retried, nothing ran twice
    assert all(s.worker == other.worker_name for s in farm.statuses(prefetched))  # given back, run elsewhere
    assert farm.registry_entry(victim.worker_name) == {}
    assert shards.card(farm.redis, keys.leases) == 0  # no lease left behind
    assert "stopped" in victim.log_tail(20)


def test_g_cancel_50_of_200_queued_jobs(fault_farm):
    farm = fault_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.1)
    job_ids = farm.submit([request(i, steps=4) for i in range(200)])
    doomed = job_ids[-50:]
    answers = []
    for job_id in doomed:
        assert farm.store.get_job(job_id).state == "queued"
        answers.append(farm.client.cancel(job_id))
    farm.wait(job_ids, timeout=120)
    row = farm.account("g. cancel 50 of 200 queued jobs", job_ids, None)
    _assert_clean(row, succeeded=150, canceled=50, failed=0, objects=150)
    assert all(a["canceled"] and a["state"] == "canceled" for a in answers)
    assert {s.job_id for s in farm.statuses(job_ids) if s.state == "canceled"} == set(doomed)
    renders, writes = farm.counters()
    assert not any(renders.get(j) or writes.get(j) for j in doomed)
    assert all(s.started_at is None and s.attempts == 0 for s in farm.statuses(doomed))


@pytest.mark.farm_settings(RENDERFARM_DURABLE_ACK="local")
def test_h_kill_9_redis_right_after_a_burst_of_202s(fault_farm, fault_redis):
    """redis-server (``--appendonly yes --appendfsync everysec``, the suite's) is killed with
    SIGKILL the moment the last of a burst of 202s arrives, and restarted from its AOF: every
    job the API accepted still exists and succeeds."""
    farm = fault_farm
    assert fault_redis.appendonly and fault_redis.appendfsync == "everysec"
    ack = "waitaof" if DurableAck(farm.redis, "local").has_waitaof() else "everysec-sleep"
    farm.add_workers(2, batch_size=8, step_delay_s=0.4)  # 1.6 s a batch: most jobs still queued at the kill
    accepted = farm.burst_of_202s()  # 4 clients × 5 batches × 10 jobs
    fault_redis.kill()  # right after the last 202: no SIGTERM flush
    fault_redis.start().wait_ready()
    back = time.monotonic()
    missing_after_restart = sum(1 for s in farm.statuses(accepted) if s is None)
    done_at_restart = _succeeded(farm, accepted)
    farm.wait_for(lambda: _succeeded(farm, accepted) > done_at_restart, timeout=60)
    recovery = time.monotonic() - back
    farm.wait(accepted, timeout=180)
    row = farm.account("h. kill -9 redis-server right after a burst of 202s", accepted, recovery, ack=ack,
                       succeeded_before_kill=done_at_restart, missing_after_restart=missing_after_restart)
    _assert_clean(row, succeeded=200, failed=0, objects=200, missing_after_restart=0)


def _up(tmp_path: Path, run: str, data: Path, cache_dir: Path) -> ManagedProcess:
    """``renderfarm up --workers 1 --model null`` with its data in ``data``; ready once it serves."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("RENDERFARM_", "AWS_"))}
    env.update(FAULT_SETTINGS, RENDERFARM_CACHE_DIR=str(cache_dir), RENDERFARM_ENV_FILE="", COLUMNS="200",
               RENDERFARM_TEST_STEP_DELAY_S="0.05")
    log = tmp_path / run / "up.log"
    return ManagedProcess("up", cli_command("up", "--workers", "1", "--model", "null", "--data-dir", str(data),
                                            "--api-port", str(free_port()), "--s3-port", str(free_port())),
                          env=env, run_dir=tmp_path / run, cwd=tmp_path,
                          ready=lambda: "Ctrl-C stops everything" in log.read_text(), ready_timeout=300)


def _submit_and_wait(api: str, n: int, base: int) -> list[str]:
    body = {"jobs": [request(base + i).model_dump(mode="json", exclude_none=True) for i in range(n)]}
    job_ids = httpx.post(f"{api}/v1/batches", json=body, timeout=60).json()["job_ids"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = [httpx.get(f"{api}/v1/jobs/{j}", timeout=10).json()["state"] for j in job_ids]
        if all(s in ("succeeded", "failed", "canceled") for s in states):
            break
        time.sleep(0.5)
    return job_ids


def test_n_kill_9_a_worker_under_up_then_restart_up(tmp_path, cache_dir):
    data = tmp_path / "data"
    with _up(tmp_path, "run1", data, cache_dir) as up:
        output = up.log_path.read_text()
        api = re.search(r"^export RENDERFARM_API_URL=(\S+)$", output, flags=re.M).group(1)
        worker_pid = int(re.search(r"^✓ null-1 .* pid (\d+)\s*$", output, flags=re.M).group(1))
        first = _submit_and_wait(api, 8, 0)
        os.kill(worker_pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 120
        while "null-1 restarted" not in up.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        recovery = time.monotonic() - killed
        assert "null-1 restarted" in up.log_path.read_text(), up.log_tail()
        assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200  # the stack kept serving
        second = _submit_and_wait(api, 8, 100)  # rendered by the restarted worker
        up.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=120) == 0, up.log_tail()
    job_ids = first + second
    with _up(tmp_path, "run2", data, cache_dir) as up:
        output = up.log_path.read_text()
        api = re.search(r"^export RENDERFARM_API_URL=(\S+)$", output, flags=re.M).group(1)
        statuses = [httpx.get(f"{api}/v1/jobs/{j}", timeout=10).json() for j in job_ids]
        fetched = sum(1 for s in statuses if s.get("state") == "succeeded" and s["result"].get("url")
                      and httpx.get(s["result"]["url"], timeout=30).content[:4] == b"\x89PNG")
        counts = {state: sum(1 for s in statuses if s.get("state") == state)
                  for state in ("succeeded", "failed", "canceled")}
        row = {"scenario": "n. kill -9 a worker under renderfarm up; up stopped and started again",
               "submitted": len(job_ids), **counts, "lost": len(job_ids) - fetched,
               # run twice here: jobs that needed more than one attempt (no job was in flight at the kill)
               "run_twice": sum(1 for s in statuses if (s.get("attempts") or 0) > 1), "recovery_s": round(recovery, 1),
               "fetched_after_restart": fetched}
        record_row(row)
        up.send_signal(signal.SIGTERM)
        up.proc.wait(timeout=120)
    assert row["lost"] == 0 and row["succeeded"] == 16 and row["run_twice"] == 0, row
