"""Broker shards on real processes: a pool whose Celery queue lives on a Redis of its own.

Scenario w: two pools of null-model workers, ``null-a`` on the farm's broker and ``null-b`` on
the broker shard ``shard-b`` (a second redis-server, ``RENDERFARM_BROKERS``). Pool b's messages
must be on the shard only, the API's queue depths must read them there, one of pool b's two
workers is killed mid-batch and the reaper must send its jobs back through the shard to the
other, and the shard's orphaned ``unacked`` entries must be swept. Celery's tools reach the
shard's workers through ``RENDERFARM_CELERY_BROKER``. Recovery: from the ``kill -9`` until every
job the dead worker held had succeeded elsewhere (as in scenario a).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from infra import keys
from infra.localstack import RedisServer, free_port
from infra.schemas import RenderRequest

from .farm import LEASE_S, FaultFarm

pytestmark = [pytest.mark.faults, pytest.mark.long]
POOLS = [{"name": "null-a", "model": "null", "max_pixels": 64 * 64, "max_batch": 8},
         {"name": "null-b", "model": "null", "max_pixels": 128 * 128, "max_batch": 8, "broker": "shard-b"}]


def _request(i: int, size: int) -> RenderRequest:
    return RenderRequest(prompt=f"shard test {i}", model="null", width=size, height=size, num_inference_steps=5,
                         seed=i)


@pytest.fixture
def shard(run_dir, tmp_path) -> Iterator[RedisServer]:
    """The broker shard: a redis-server of its own."""
    with RedisServer(free_port(), appendonly=True, dir=tmp_path / "shard", name="shard-redis",
                     run_dir=run_dir) as server:
        yield server


@pytest.fixture
def farm(fault_redis, fault_s3, run_dir, cache_dir, shard) -> Iterator[FaultFarm]:
    if not fault_redis.running:  # a failed scenario may have left it down
        fault_redis.start().wait_ready()
    farm = FaultFarm("shard", fault_redis, fault_s3, run_dir, cache_dir, RENDERFARM_POOLS=json.dumps(POOLS),
                     RENDERFARM_BROKERS=json.dumps({"shard-b": shard.url}))
    try:
        yield farm.start()
    finally:
        farm.stop()


def _running_on(farm: FaultFarm, worker_name: str, job_ids, below: float = 1.0) -> list[str]:
    return [j for j, (state, worker, progress) in zip(job_ids, farm.states(job_ids))
            if state == "running" and worker == worker_name and progress < below]


def _pool_keys(client, pool: str) -> list[str]:
    """The broker lists of ``pool`` and its entries in kombu's ``unacked`` on the Redis of ``client``."""
    lists = [k for k in client.scan_iter(match=f"{keys.queue(pool)}*") if keys.pool_of_broker_list(k) == pool]
    unacked = [raw for raw in client.hvals(keys.UNACKED) if f'"{keys.queue(pool)}"' in raw]
    return lists + unacked


def _ping(env: dict[str, str], shard: str | None) -> set[str]:
    """The nodes answering ``celery -A infra.broker.celery_app inspect ping`` on the default broker
    or on ``shard`` (``RENDERFARM_CELERY_BROKER``)."""
    env = {**os.environ, **env, **({"RENDERFARM_CELERY_BROKER": shard} if shard else {})}
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "infra.broker.celery_app", "inspect", "ping",
                          "--timeout", "5", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return set(json.loads(out.stdout))


def test_w_pool_on_its_own_broker_shard(farm, shard):
    on_shard = shard.client()
    [a_worker] = farm.add_workers(1, batch_size=8, step_delay_s=0.05, pool="null-a")
    # serial workers: "running" is exactly the batch each renders, so what they prefetched is "reserved"
    victim, survivor = farm.add_workers(2, batch_size=8, step_delay_s=0.2, pool="null-b",
                                        RENDERFARM_WORKER_OVERLAP="false")
    a_ids = farm.submit([_request(i, 64) for i in range(80)])
    b_ids = farm.submit([_request(i, 128) for i in range(160)])  # 20 batches of 1 s on two workers
    farm.wait_for(lambda: _running_on(farm, victim.worker_name, b_ids, below=0.5), timeout=60)

    # pool b's messages are on the shard only; pool a's on the farm's broker only
    assert _pool_keys(on_shard, "null-b") and not _pool_keys(farm.redis, "null-b")
    assert not _pool_keys(on_shard, "null-a")
    # prefetched messages: the API counts them from the shard's unacked hash (once, on a loaded CI
    # host, none showed within 20 s)
    row = farm.wait_for(lambda: (r := httpx.get(f"{farm.api.url}/v1/queues/null-b", timeout=10).json())["reserved"]
                        and r, timeout=45)
    assert row["outstanding"] == row["queued"] + row["reserved"] + row["running"] > 0, row

    # the checks above took a while: kill the victim early in one of its batches again
    farm.wait_for(lambda: _running_on(farm, victim.worker_name, b_ids, below=0.5), timeout=60, interval=0.05)
    reserved = farm.registry_entry(victim.worker_name).get("reserved_jobs", [])
    victim.kill()
    killed_at = time.monotonic()
    held = _running_on(farm, victim.worker_name, b_ids)
    affected = held + [j for j in reserved if j not in held]
    farm.wait_for(lambda: all(state == "succeeded" for state, _, _ in farm.states(affected)),
                  timeout=LEASE_S + 30, interval=0.05)
    recovery = time.monotonic() - killed_at
    farm.wait(a_ids + b_ids, timeout=180)
    row = farm.account("w. a pool on its own broker shard: kill -9 one of its two workers mid-batch",
                       a_ids + b_ids, recovery, running_on_killed=len(held),
                       prefetched_by_killed=len(affected) - len(held))
    assert row["lost"] == 0 and row["run_twice"] == 0 and row["succeeded"] == 240, row
    assert held and recovery <= LEASE_S + 10, row
    assert all(s.attempts == 2 and s.worker == survivor.worker_name for s in farm.statuses(held))
    # the dead worker's entries in the shard's unacked hash are swept by the reaper
    farm.wait_for(lambda: on_shard.hlen(keys.UNACKED) == 0, timeout=LEASE_S + 20)

    assert _ping(farm.env, None) == {f"celery@{a_worker.worker_name}"}
    assert _ping(farm.env, "shard-b") == {f"celery@{survivor.worker_name}"}
