"""``renderfarm up`` survives its own parts: six faults under a real ``up`` with two workers and a
batch in flight, each ending with every job succeeded once and every image fetching.

Each scenario starts ``renderfarm up --model null --workers 2`` on its own data directory and
fixed ports, submits 96 jobs (12 batches of 8 on the workers, 0.4 s each), waits until 16 have
succeeded, and then:

- q: ``kill -9`` of its redis-server (the supervisor restarts it from its AOF, same port);
- r: ``kill -9`` of SeaweedFS (restarted on the same ports and volumes; ``/healthz`` says
  ``degraded`` meanwhile);
- s: ``kill -9`` of the status API (restarted on the same port; the workers never needed it);
- t: ``kill -9`` of ``renderfarm up`` itself, then a new ``up`` at once on the same data;
- u: SIGINT (Ctrl-C), then a new ``up`` at once on the same data and ports (the old stack's
  connections leave the ports in ``TIME_WAIT``, which must not count as "in use");
- v: SIGKILL of ``up``'s process group, then a new ``up`` at once.

Recovery (the table's seconds): from the fault until ``/healthz`` answers ``ok`` again and a job
has succeeded since the service came back (in q, r and s: since the supervisor's "answers again"
event; in t, u and v: since the fault), or every job has. In q, r and s the API's health answer is not cached
(``RENDERFARM_HEALTH_CACHE_S=0``), so the test sees every status the outage passes through.
Run twice and lost are counted as in the other scenarios (:func:`tests.fault_table.account_row`);
``fetched`` counts the images whose presigned URL, from ``GET /v1/jobs/{id}``, answers a PNG.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from infra.localstack import free_port

from .up_stack import UpRun

pytestmark = [pytest.mark.faults, pytest.mark.long]

JOBS = 96


def _start(tmp_path: Path, run: str, cache_dir: Path, ports: tuple[int, int], **settings: str) -> UpRun:
    return UpRun(tmp_path, run, tmp_path / "data", cache_dir, *ports, **settings).start()


def _in_flight(up: UpRun) -> list[str]:
    """Submit the scenario's jobs and wait until 16 have succeeded; returns their ids."""
    job_ids = up.submit(JOBS, 0)
    done = up.wait_until(lambda: (n := up.succeeded(job_ids)) >= 16 and n, timeout=120, interval=0.05)
    assert done < JOBS - 16, f"the batch ended before the fault ({done} of {JOBS} succeeded)"
    return job_ids


def _recovered(up: UpRun, job_ids: list[str], done_before: int) -> bool:
    """``/healthz`` says ``ok`` and a job has succeeded since ``done_before`` was read, or every
    job has (the workers never needed the API: the batch may end while it is away)."""
    done = up.succeeded(job_ids)
    return up.health().get("status") == "ok" and (done > done_before or done == len(job_ids))


def _assert_clean(row: dict) -> None:
    assert row["lost"] == 0 and row["run_twice"] == 0, row
    assert row["succeeded"] == JOBS and row["fetched"] == JOBS, row


@pytest.mark.parametrize("service", ["redis", "seaweedfs", "api"])
def test_kill_9_a_service_of_up_mid_batch(tmp_path, cache_dir, service):
    scenario = {"redis": "q. kill -9 redis-server under renderfarm up",
                "seaweedfs": "r. kill -9 SeaweedFS under renderfarm up",
                "api": "s. kill -9 the API under renderfarm up"}[service]
    up = _start(tmp_path, "run1", cache_dir, (free_port(), free_port()), RENDERFARM_HEALTH_CACHE_S="0")
    try:
        job_ids = _in_flight(up)
        os.kill(up.pids()[service], signal.SIGKILL)
        killed = time.monotonic()
        seen: set[str] = set()

        def back() -> bool:
            """The supervisor has seen the service die and answer again (each /healthz status
            on the way is kept: with no health cache, every poll is a fresh evaluation)."""
            health = up.health()
            seen.add(str(health.get("status", "no answer")))
            return any(f"{service} answers again after" in line for line in health.get("stack_events", []))

        up.wait_until(back, timeout=120, interval=0.1)
        done = up.succeeded(job_ids)
        up.wait_until(lambda: _recovered(up, job_ids, done), timeout=120)
        recovery = time.monotonic() - killed
        up.wait_terminal(job_ids)
        events = up.health().get("stack_events", [])
        row = up.account(scenario, job_ids, recovery, health_seen=sorted(seen))
    finally:
        up.close()
    _assert_clean(row)
    assert any(f"{service} killed by signal 9" in line for line in events), events
    assert any(f"{service} answers again after" in line for line in events), events
    assert f"{service} restarted (pid" in up.output(), up.process.log_tail(40)
    if service == "seaweedfs":
        assert "degraded" in seen, seen


@pytest.mark.parametrize("how", ["kill-up", "sigint", "killpg"])
def test_up_stopped_mid_batch_then_up_again_at_once(tmp_path, cache_dir, how):
    scenario = {"kill-up": "t. kill -9 renderfarm up, then up again",
                "sigint": "u. SIGINT renderfarm up, then up again at once",
                "killpg": "v. SIGKILL up's process group, then up again at once"}[how]
    ports = (free_port(), free_port())
    first = _start(tmp_path, "run1", cache_dir, ports)
    second = None
    try:
        job_ids = _in_flight(first)
        assert first.process.pid is not None
        done = first.succeeded(job_ids)
        stopped = time.monotonic()
        if how == "kill-up":
            os.kill(first.process.pid, signal.SIGKILL)
        elif how == "killpg":
            os.killpg(first.process.pid, signal.SIGKILL)
        else:
            assert first.interrupt() == 0, first.process.log_tail(40)
        first.close()
        second = _start(tmp_path, "run2", cache_dir, ports)
        second.wait_until(lambda: _recovered(second, job_ids, done), timeout=120)
        recovery = time.monotonic() - stopped
        second.wait_terminal(job_ids)
        row = second.account(scenario, job_ids, recovery)
    finally:
        first.close()
        if second is not None:
            second.close()
    _assert_clean(row)
    assert "is in use" not in second.output(), second.process.log_tail(40)
