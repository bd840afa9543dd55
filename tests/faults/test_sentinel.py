"""Losing the Redis machine, not the farm: the farm on a Sentinel group (one primary, two
replicas, three sentinels; :mod:`tests.faults.sentinel`), every process configured with one
``sentinel://`` URL, and the primary killed with SIGKILL.

Rows of the fault table (recovery seconds: from the ``kill -9`` until the farm completed a job
again on the promoted replica, Sentinel's detection and failover included):

- s1: the primary killed mid-run, under load; nothing restarted by hand;
- s2: the primary killed right after a burst of 202s with ``RENDERFARM_DURABLE_ACK=replicas``:
  every acknowledged job is on a replica before its 202, so every one finishes;
- s3: one of the three sentinels killed mid-run: nothing changes;
- s4: the primary partitioned (SIGSTOP) while a replica is promoted, then back as a replica;
- s5: the primary killed while both replicas lag, with each durable-ack mode: what ``local``
  acknowledged is lost, ``replicas`` acknowledged nothing it could lose;
- s6: ``renderfarm up --redis-url sentinel://…`` through a failover (its supervisor restarts nothing).

Runs twice are counted by the workers in the same Redis (``RENDERFARM_TEST_COUNTERS``), so a
counter write the promoted replica never received is not seen; the jobs' own states and the
bucket's objects are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from infra.localstack import SeaweedS3, free_port

from .farm import FaultFarm, request, wait_for
from .sentinel import SentinelGroupServers
from .up_stack import UpRun

pytestmark = [pytest.mark.faults, pytest.mark.long]

#: How long a worker may go unheard in these scenarios: its jobs' lease and its heartbeat's TTL.
#: Both must outlast the failover (Sentinel's detection, the election, the clients' reconnection),
#: or the reaper takes the worker for dead and a running batch is requeued and rendered again:
#: with the fault farm's 3 s heartbeat TTL, a loaded machine re-rendered 8 jobs of 200 in s2 (the
#: reaper "requeued 40 job(s) whose worker stopped renewing its lease"). 10 s keeps the margin
#: production has (RENDERFARM_LEASE_S and RENDERFARM_HEARTBEAT_TTL_S 20 s against the chart's 10 s
#: down-after-milliseconds) over this group's 1 s.
LEASE = {"RENDERFARM_LEASE_S": "10", "RENDERFARM_HEARTBEAT_TTL_S": "10"}


@pytest.fixture
def group(run_dir: Path, tmp_path: Path) -> Iterator[SentinelGroupServers]:
    servers = SentinelGroupServers(tmp_path / "sentinel", run_dir)
    try:
        yield servers.start()
    finally:
        servers.stop()


@pytest.fixture
def sentinel_farm(request, group: SentinelGroupServers, fault_s3: SeaweedS3, run_dir: Path,
                  cache_dir: Path) -> Iterator[FaultFarm]:
    marker = request.node.get_closest_marker("farm_settings")
    if not fault_s3.running:
        fault_s3.start().wait_ready()
    farm = FaultFarm(request.node.name.removeprefix("test_")[:12].replace("_", "-"), group, fault_s3, run_dir,
                     cache_dir, **LEASE, **(marker.kwargs if marker else {}))
    try:
        yield farm.start()
    finally:
        farm.stop()


def _succeeded(farm: FaultFarm, job_ids) -> int | None:
    """Jobs succeeded, read from the current primary; None while no primary answers."""
    try:
        return sum(1 for state, _, _ in farm.states(job_ids) if state == "succeeded")
    except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
        return None


def _kill_primary_and_time_recovery(farm: FaultFarm, group: SentinelGroupServers, job_ids) -> dict:
    """SIGKILL the primary; wait until a job succeeds after it. Returns the row's columns:
    ``recovery_s``, ``succeeded_before_kill``, ``killed_port``, ``promoted_port`` (and keeps the
    farm's process ids at the kill in ``farm.pids_at_kill``)."""
    done = _succeeded(farm, job_ids) or 0
    farm.pids_at_kill = [p.pid for p in (farm.api, *farm.workers)]  # type: ignore[attr-defined]
    victim = group.current_primary()
    victim.kill()
    killed_at = time.monotonic()
    farm.wait_for(lambda: (_succeeded(farm, job_ids) or 0) > done, timeout=60)
    recovery = time.monotonic() - killed_at
    return {"recovery_s": recovery, "succeeded_before_kill": done, "killed_port": victim.port,
            "promoted_port": group.primary_port()}


def _assert_failed_over_and_clean(row: dict, farm: FaultFarm, submitted: int) -> None:
    """A replica was promoted while jobs were left, and every job finished once, on the same
    worker and API processes (none restarted by hand or by a supervisor)."""
    assert row["promoted_port"] != row["killed_port"] and row["succeeded_before_kill"] < submitted, row
    assert row["lost"] == 0 and row["run_twice"] == 0 and row["succeeded"] == submitted, row
    assert [p.pid if p.running else None for p in (farm.api, *farm.workers)] == farm.pids_at_kill, row


def test_s1_kill_9_the_primary_under_load(sentinel_farm, group):
    farm = sentinel_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.2)  # 0.8 s a batch: 96 jobs last several seconds
    job_ids = farm.submit([request(i, steps=4) for i in range(96)])
    farm.wait_for(lambda: (_succeeded(farm, job_ids) or 0) >= 16, timeout=60)
    failover = _kill_primary_and_time_recovery(farm, group, job_ids)
    farm.wait(job_ids, timeout=180)
    row = farm.account("s1. kill -9 the Sentinel group's primary under load", job_ids, **failover)
    _assert_failed_over_and_clean(row, farm, 96)
    assert row["recovery_s"] < 15, row  # Sentinel's 1 s detection, the failover, the farm's reconnects


@pytest.mark.farm_settings(RENDERFARM_DURABLE_ACK="replicas")
def test_s2_kill_9_the_primary_right_after_a_burst_of_202s(sentinel_farm, group):
    farm = sentinel_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.4)  # 1.6 s a batch: most jobs still queued at the kill
    accepted = farm.burst_of_202s()  # 4 clients × 5 batches × 10 jobs
    failover = _kill_primary_and_time_recovery(farm, group, accepted)
    missing = sum(1 for s in farm.statuses(accepted) if s is None)
    farm.wait(accepted, timeout=180)
    row = farm.account("s2. kill -9 the primary right after a burst of 202s (durable ack: replicas)", accepted,
                       missing_after_failover=missing, **failover)
    _assert_failed_over_and_clean(row, farm, 200)
    assert missing == 0, row


def test_s3_kill_one_sentinel_mid_run(sentinel_farm, group):
    farm = sentinel_farm
    farm.add_workers(1, batch_size=8, step_delay_s=0.1)
    job_ids = farm.submit([request(i) for i in range(48)])
    farm.wait_for(lambda: (_succeeded(farm, job_ids) or 0) >= 8, timeout=60)
    primary = group.primary_port()
    group.sentinels[0].kill()
    # Celery's own remote control reaches the worker through the same sentinel:// URL
    node = f"celery@{farm.workers[0].worker_name}"
    inspect = subprocess.run([sys.executable, "-m", "celery", "-A", "infra.broker.celery_app", "inspect", "ping",
                              "--destination", node, "--timeout", "30", "--json"], capture_output=True, text=True,
                             timeout=90, env={**os.environ, **farm.env, "RENDERFARM_ENV_FILE": ""})
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    assert json.loads(inspect.stdout) == {node: {"ok": "pong"}}
    statuses = farm.wait(job_ids, timeout=120)
    row = farm.account("s3. kill -9 one of three sentinels mid-run", job_ids, None)
    assert group.primary_port() == primary and all(s is not None and s.state == "succeeded" for s in statuses)
    assert row["lost"] == 0 and row["run_twice"] == 0, row


def test_s4_the_primary_partitioned_then_back_as_a_replica(sentinel_farm, group):
    """SIGSTOP the primary (a partition: its clients' connections hang rather than fail), let the
    sentinels promote a replica, then SIGCONT it: it comes back believing it is the primary until
    the sentinels turn it into the new primary's replica, which throws away whatever it accepted
    meanwhile."""
    farm = sentinel_farm
    farm.add_workers(2, batch_size=8, step_delay_s=0.2)
    job_ids = farm.submit([request(i, steps=4) for i in range(96)])
    farm.wait_for(lambda: (_succeeded(farm, job_ids) or 0) >= 16, timeout=60)
    done = _succeeded(farm, job_ids) or 0
    victim = group.current_primary()
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        farm.wait_for(lambda: group.primary_port() != victim.port, timeout=30)
        farm.wait_for(lambda: (_succeeded(farm, job_ids) or 0) > done, timeout=60)
        recovery = time.monotonic() - stopped_at
    finally:
        victim.send_signal(signal.SIGCONT)
    farm.wait_for(lambda: victim.client().info("replication")["role"] == "slave", timeout=30)
    farm.wait(job_ids, timeout=180)
    row = farm.account("s4. the primary partitioned (SIGSTOP), then back as a replica", job_ids, recovery,
                       succeeded_before_stop=done)
    assert row["lost"] == 0 and row["run_twice"] == 0 and row["succeeded"] == 96, row


@pytest.mark.parametrize("mode", ["local", "replicas"])
def test_s5_kill_9_the_primary_while_its_replicas_lag(mode, group, fault_s3, run_dir, cache_dir):
    """What each durable-ack mode promises when the replicas lag: both replicas stopped (SIGSTOP)
    and their replication links closed by the primary (``CLIENT KILL TYPE replica``), three
    batches submitted, the primary killed, the replicas resumed and one promoted. ``local``
    answered 202 for batches only the dead primary had: they are gone. ``replicas`` answered 503
    (no replica confirmed), and the client's retries with the same idempotency keys land on the
    promoted replica: nothing it was told was accepted is lost."""
    farm = FaultFarm(f"s5-{mode}", group, fault_s3, run_dir, cache_dir, **LEASE, RENDERFARM_DURABLE_ACK=mode,
                     RENDERFARM_DURABLE_ACK_TIMEOUT_MS="1000").start()
    try:
        for replica in group.replicas:
            replica.send_signal(signal.SIGSTOP)
        # and their links cut: a stopped replica's kernel would still buffer what the primary sends
        group.primary.client().client_kill_filter(_type="replica")
        bodies = [{"jobs": [request(100 * b + i).model_dump(mode="json", exclude_none=True) for i in range(10)],
                   "idempotency_key": f"s5-{mode}-{b}"} for b in range(3)]
        answers = [httpx.post(f"{farm.api.url}/v1/batches", json=body, timeout=60) for body in bodies]
        acknowledged = [j for a in answers if a.status_code == 202 for j in a.json()["job_ids"]]
        victim = group.primary
        victim.kill()
        for replica in group.replicas:
            replica.send_signal(signal.SIGCONT)
        farm.wait_for(lambda: group.primary_port() != victim.port, timeout=60)
        farm.add_workers(1, batch_size=8, step_delay_s=0.05)
        retried = [farm.wait_for(lambda body=body: _retry(farm, body), timeout=60) for body in bodies]
        lost = sum(1 for s in farm.statuses(acknowledged) if s is None)
        retried_ids = [j for r in retried for j in r.json()["job_ids"]]
        farm.wait(retried_ids, timeout=120)
        row = farm.account(f"s5. kill -9 the primary while both replicas lag (durable ack: {mode})", retried_ids,
                           None, first_codes=[a.status_code for a in answers], acknowledged=len(acknowledged),
                           acknowledged_then_lost=lost)
    finally:
        for replica in group.replicas:
            if replica.running:
                replica.send_signal(signal.SIGCONT)
        farm.stop()
    if mode == "local":  # 202s for what only the dead primary held: the loss this mode allows
        assert row["first_codes"] == [202] * 3 and lost == 30, row
    else:  # no 202 without a replica: nothing acknowledged, nothing lost, the retries land
        assert row["first_codes"] == [503] * 3 and lost == 0 and len(acknowledged) == 0, row
    assert row["succeeded"] == 30 and row["lost"] == 0 and row["run_twice"] == 0, row


def _retry(farm: FaultFarm, body: dict):
    """The client's retry of a batch with its idempotency key: the response once it is a 202."""
    try:
        answer = httpx.post(f"{farm.api.url}/v1/batches", json=body, timeout=30)
    except httpx.HTTPError:
        return None
    return answer if answer.status_code == 202 else None


def test_s6_renderfarm_up_on_a_sentinel_group_follows_a_failover(group, tmp_path, cache_dir):
    """``renderfarm up --redis-url sentinel://…``: the stack uses the group (starts no Redis of its
    own), and its API and worker follow a failover with nothing restarted by its supervisor."""
    up = UpRun(tmp_path, "up", tmp_path / "data", cache_dir, free_port(), free_port(), workers=1,
               redis_url=group.db_url(3), RENDERFARM_TEST_STEP_DELAY_S="0.2", **LEASE)
    try:
        up.start()
        assert "reused: already running" in up.output() and "sentinel://" in up.output()  # no Redis of its own
        job_ids = up.submit(48, 0)
        wait_for(lambda: up.succeeded(job_ids) >= 8, timeout=60)
        victim = group.current_primary()
        victim.kill()
        wait_for(lambda: up.succeeded(job_ids) == len(job_ids), timeout=180)
        after = up.output()
        row = up.account("s6. renderfarm up --redis-url sentinel://…, primary kill -9 mid-run", job_ids, None)
        assert up.interrupt() == 0, up.process.log_tail()
    finally:
        up.close()
    assert group.primary_port() != victim.port
    assert row["succeeded"] == len(job_ids) == row["fetched"] and row["lost"] == 0 and row["run_twice"] == 0, row
    assert "restarting in" not in after and "restarted" not in after, after[-3000:]  # the supervisor did nothing

