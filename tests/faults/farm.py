"""The fault farm: one scenario's real processes; its rows go to the fault table
(:mod:`tests.fault_table`).

Used by ``tests/faults/conftest.py`` (the fixtures) and the scenarios. See the conftest for why
every scenario gets its own farm.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from infra import keys
from infra.localstack import (
    ApiServer,
    RedisServer,
    SeaweedS3,
    WorkerProcess,
    ensure_bucket,
    free_port,
    stack_env,
)
from infra.schemas import JobStatus, RenderRequest
from infra.state.job_store import JobStore
from producer import RenderClient
from tests.fault_table import TERMINAL, account_row, record_row
from worker.faults import read_counters

LEASE_S = 5.0

#: Settings of every process of a fault farm: short leases, fast heartbeats and sweeps.
FAULT_SETTINGS = {
    "RENDERFARM_LEASE_S": str(LEASE_S),
    "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5",
    "RENDERFARM_HEARTBEAT_TTL_S": "3",
    "RENDERFARM_REAPER_INTERVAL_S": "0.5",
    "RENDERFARM_REPUBLISH_AFTER_S": "3",
    "RENDERFARM_TEST_COUNTERS": "1",
    "RENDERFARM_UPLOAD_RETRY_S": "60",
}

_databases = itertools.cycle(range(1, 15))  # Redis databases of fault farms (15 is the store tests')


def request(i: int, *, prompt: str = "fault test", steps: int = 4) -> RenderRequest:
    """A small request for the null model; ``steps`` × the step delay is its render time."""
    return RenderRequest(prompt=f"{prompt} {i}", model="null", width=64, height=64, num_inference_steps=steps,
                         seed=i)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1):
    """Poll ``predicate()`` until it returns something truthy; returns it (TimeoutError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")


class FaultFarm:
    """One scenario's farm: flushed Redis, a fresh bucket, an API with the reaper, and workers.

    ``env`` holds every variable its processes get; ``store`` reads the job states directly.
    """

    def __init__(self, name: str, redis_server: RedisServer, s3_server: SeaweedS3, run_dir: Path, cache_dir: Path,
                 **settings: str):
        self.name = name
        self.redis_server, self.s3_server, self.run_dir = redis_server, s3_server, run_dir
        self.bucket = f"faults-{name}-{secrets.token_hex(3)}"
        self.db = next(_databases)  # farms alive at once (a module's and a test's) must not share queues
        self.env = stack_env(redis_url=redis_server.db_url(self.db),
                             s3_endpoint_url=s3_server.url, access_key=s3_server.access_key,
                             secret_key=s3_server.secret_key, bucket=self.bucket,
                             api_url=f"http://127.0.0.1:{free_port()}", cache_dir=cache_dir)
        self.env.update(FAULT_SETTINGS)
        self.env.update(settings)
        self.redis = redis_server.client(db=self.db)
        self.store = JobStore(self.redis, lease_s=LEASE_S)
        self.s3 = s3_server.client()
        self.api = ApiServer(int(self.env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), self.env,
                             name=f"api-{name}", run_dir=run_dir)
        self.workers: list[WorkerProcess] = []
        self.client: RenderClient | None = None

    def start(self) -> "FaultFarm":
        self.redis.flushdb()
        ensure_bucket(self.env)
        self.api.start().wait_ready()
        self.client = RenderClient(api_url=self.api.url)
        return self

    def add_workers(self, count: int, *, batch_size: int = 8, step_delay_s: float = 0.1, pool: str | None = None,
                    **env: str) -> list[WorkerProcess]:
        """Start ``count`` null-model workers (of the declared ``pool``, when given) and wait until
        they are registered."""
        base = len(self.workers)
        worker_env = {**self.env, "RENDERFARM_TEST_STEP_DELAY_S": str(step_delay_s), **env}
        new = [WorkerProcess("null", worker_env, f"{self.name}-w{base + i + 1}", batch_size, run_dir=self.run_dir,
                             extra_args=["--pool", pool] if pool else [])
               for i in range(count)]
        self.workers += new
        for worker in new:  # the null model builds nothing: all start at once
            worker.start()
        for worker in new:
            worker.wait_ready()
        return new

    def stop(self) -> None:
        """Stop the workers and the API, all at once."""
        if self.client is not None:
            self.client.close()
        threads = [threading.Thread(target=p.stop) for p in (*self.workers, self.api)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # ---- observing --------------------------------------------------------------------------
    def submit(self, requests: Sequence[RenderRequest], **kwargs) -> list[str]:
        """Submit one batch through the API; returns its job ids."""
        return self.client.submit_batch(list(requests), **kwargs).job_ids

    def burst_of_202s(self, threads: int = 4, batches: int = 5, size: int = 10) -> list[str]:
        """``threads`` clients each POST ``batches`` batches of ``size`` jobs at once, asserting
        every answer is a 202; returns the accepted job ids (as fast as the API answers)."""
        import httpx

        accepted: list[str] = []
        lock = threading.Lock()

        def burst(t: int) -> None:
            for k in range(batches):
                body = {"jobs": [request(t * 1000 + k * 100 + i).model_dump(mode="json", exclude_none=True)
                                 for i in range(size)]}
                resp = httpx.post(f"{self.api.url}/v1/batches", json=body, timeout=60)
                assert resp.status_code == 202, resp.text
                with lock:
                    accepted.extend(resp.json()["job_ids"])

        workers = [threading.Thread(target=burst, args=(t,)) for t in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        return accepted

    def statuses(self, job_ids: Sequence[str]) -> list[JobStatus | None]:
        return self.store.get_jobs(job_ids)

    def states(self, job_ids: Sequence[str]) -> list[tuple[str | None, str | None, float]]:
        """``(state, worker, progress)`` per job, read cheaply (for polling loops)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), "state", "worker", "progress")
        return [(state, worker, float(progress or 0)) for state, worker, progress in pipe.execute()]

    def wait(self, job_ids: Sequence[str], timeout: float = 120.0) -> list[JobStatus | None]:
        """Poll until every job is terminal or ``timeout`` seconds pass; returns the statuses."""
        deadline = time.monotonic() + timeout
        while not all(state in TERMINAL for state, _, _ in self.states(job_ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.statuses(job_ids)

    def wait_for(self, predicate, timeout: float = 60.0, interval: float = 0.1):
        """:func:`wait_for` (kept as a method: the scenarios read ``farm.wait_for``)."""
        return wait_for(predicate, timeout, interval)

    def registry_entry(self, worker_name: str) -> dict:
        """The worker's registry entry (heartbeat), or {} when it is not registered."""
        from infra.state.registry import live_workers

        return next((w for w in live_workers(self.redis, 3.0) if w["name"] == worker_name), {})

    def objects(self) -> set[str]:
        """Keys in this farm's bucket."""
        keys: set[str] = set()
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys.update(o["Key"] for o in page.get("Contents", []))
        return keys

    def counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per job id: completed renders, and object writes that really wrote."""
        return read_counters(self.redis)

    def account(self, scenario: str, job_ids: Sequence[str], recovery_s: float | None, **extra) -> dict:
        """Every job accounted for: one row of the fault table (:func:`tests.fault_table.account_row`,
        with ``objects``: the keys in this farm's bucket), recorded with :func:`record_row`."""
        objects = self.objects()
        renders, writes = self.counters()
        row = account_row(scenario, job_ids, self.statuses(job_ids), objects, renders, writes, recovery_s,
                          objects=len(objects), **extra)
        record_row(row)
        return row
