"""A real ``renderfarm up`` for the fault scenarios of ``test_up_scenarios.py``: started as a user
would, read through what it prints (the exports and the pids of its services), and accounted for
through its own Redis, S3 and API.

Used by ``test_up_scenarios.py`` and the Sentinel scenario s6 (``test_sentinel.py``). The
workers pin the ``null`` model behind the fault-injection wrapper (``worker/faults.py``: a step
delay, and the render and write counters that measure "run twice"), with the fault farm's short
leases (:data:`tests.faults.farm.FAULT_SETTINGS`).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import redis

from infra import keys
from infra.localstack import ManagedProcess
from infra.localstack.services import cli_command
from infra.state.connect import redis_client
from infra.state.job_store import JobStore
from tests.fault_table import TERMINAL, account_row, record_row
from worker.faults import read_counters

from .farm import FAULT_SETTINGS, LEASE_S, request

#: Seconds one step of the null model takes on the workers (4 steps: 0.4 s a batch).
STEP_DELAY_S = 0.1


class UpRun:
    """One ``renderfarm up --model null`` on ``data`` and fixed ports, with ``workers`` workers
    (``redis_url``: ``--redis-url``, a Redis it uses instead of starting its own; ``settings``: more
    ``RENDERFARM_*`` variables for every process of it).

    After :meth:`start`: :attr:`env` holds the exports it printed; :meth:`pids` the pid of each
    service from its ``✓`` lines and restarts.
    """

    def __init__(self, tmp_path: Path, run: str, data: Path, cache_dir: Path, api_port: int, s3_port: int,
                 workers: int = 2, redis_url: str | None = None, **settings: str):
        env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("RENDERFARM_", "AWS_"))}
        env.update(FAULT_SETTINGS, RENDERFARM_CACHE_DIR=str(cache_dir), RENDERFARM_ENV_FILE="", COLUMNS="200")
        env.update({"RENDERFARM_TEST_STEP_DELAY_S": str(STEP_DELAY_S), **settings})  # settings may set the delay
        argv = cli_command("up", "--workers", str(workers), "--model", "null", "--batch-size", "8",
                           "--data-dir", str(data), "--api-port", str(api_port), "--s3-port", str(s3_port),
                           *(("--redis-url", redis_url) if redis_url else ()))
        self.log = tmp_path / run / "up.log"
        self.process = ManagedProcess("up", argv, env=env, run_dir=tmp_path / run, cwd=tmp_path,
                                      ready=lambda: "Ctrl-C stops everything" in self.output(),
                                      ready_timeout=300, stop_timeout=120)
        self.env: dict[str, str] = {}
        self._redis: redis.Redis | None = None

    def start(self) -> "UpRun":
        self.process.start().wait_ready()
        self.env = dict(re.findall(r"^export (\w+)=(\S+)$", self.output(), flags=re.M))
        return self

    def output(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""

    def pids(self) -> dict[str, int]:
        """Each service's newest pid: from the ``✓`` lines, then from the restart lines."""
        text = self.output()
        found = {name: int(pid) for name, pid in re.findall(r"^✓ (\S+)\s+\S+.*?pid (\d+)\s*$", text, flags=re.M)}
        found.update({name: int(pid) for name, pid in re.findall(r" (\S+) restarted \(pid (\d+),", text)})
        return found

    @property
    def api(self) -> str:
        return self.env["RENDERFARM_API_URL"]

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:  # a client that follows a Sentinel group's failovers too
            self._redis = redis_client(self.env["RENDERFARM_REDIS_URL"], socket_timeout=5, socket_connect_timeout=2)
        return self._redis

    def s3(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.env["RENDERFARM_S3_ENDPOINT_URL"], region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))

    # ---- jobs -------------------------------------------------------------------------------
    def submit(self, n: int, base: int) -> list[str]:
        body = {"jobs": [request(base + i, steps=4).model_dump(mode="json", exclude_none=True) for i in range(n)]}
        resp = httpx.post(f"{self.api}/v1/batches", json=body, timeout=60)
        assert resp.status_code == 202, resp.text
        return resp.json()["job_ids"]

    def succeeded(self, job_ids: Sequence[str]) -> int:
        """Jobs succeeded now (-1 when Redis does not answer)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "state")
            return sum(1 for state in pipe.execute() if state == "succeeded")
        except (redis.RedisError, OSError):
            return -1

    def health(self) -> dict:
        """``/healthz``'s body with ``http``: its status code (``{"http": 0}`` when the API does not answer)."""
        try:
            resp = httpx.get(f"{self.api}/healthz", timeout=3)
            return {"http": resp.status_code, **resp.json()}
        except (httpx.HTTPError, ValueError):
            return {"http": 0}

    def wait_until(self, predicate, timeout: float, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(interval)
        raise TimeoutError(f"condition not met within {timeout} s; up's log:\n{self.process.log_tail(60)}")

    def wait_terminal(self, job_ids: Sequence[str], timeout: float = 180) -> None:
        def done() -> bool:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for job_id in job_ids:
                    pipe.hget(keys.job(job_id), "state")
                return all(state in TERMINAL for state in pipe.execute())
            except (redis.RedisError, OSError):
                return False

        self.wait_until(done, timeout, interval=0.5)

    def account(self, scenario: str, job_ids: Sequence[str], recovery_s: float | None, **extra) -> dict:
        """Record the scenario's row: states from Redis, objects from S3, and the images fetched
        through the API (``fetched``: those whose presigned URL answers a PNG)."""
        statuses = JobStore(self.redis, lease_s=LEASE_S).get_jobs(list(job_ids))
        s3, bucket = self.s3(), self.env["RENDERFARM_S3_BUCKET"]
        objects: set[str] = set()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objects.update(o["Key"] for o in page.get("Contents", []))
        renders, writes = read_counters(self.redis)
        fetched = 0
        with httpx.Client(timeout=30) as http:
            for job_id in job_ids:
                status = http.get(f"{self.api}/v1/jobs/{job_id}").json()
                url = (status.get("result") or {}).get("url")
                fetched += bool(url) and http.get(url).content[:4] == b"\x89PNG"
        row = account_row(scenario, job_ids, statuses, objects, renders, writes, recovery_s, fetched=fetched, **extra)
        record_row(row)
        return row

    # ---- stopping ---------------------------------------------------------------------------
    def interrupt(self) -> int | None:
        """SIGINT, as Ctrl-C does; returns its exit code once it has stopped everything."""
        self.process.send_signal(signal.SIGINT)
        assert self.process.proc is not None
        code = self.process.proc.wait(timeout=120)
        self.process.stop()
        return code

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
        self.process.stop()
