"""Celery's own tools against the session farm's real workers: ``celery inspect`` through the
app module the Flower guide names, and the task events and worker heartbeats that Flower reads,
turned on the way Flower turns them on (the ``enable_events`` remote-control command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest

from infra.broker.app import make_celery
from infra.schemas import RenderRequest
from infra.settings import get_settings
from producer import RenderClient

pytestmark = pytest.mark.integration

APP = "infra.broker.celery_app"


def celery(*args: str) -> subprocess.CompletedProcess:
    """``celery -A infra.broker.celery_app ARGS…`` with the session farm's environment."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def inspect(command: str, workers) -> dict:
    """``celery inspect COMMAND --json`` addressed to the session's workers (so it returns as soon
    as each has answered; a worker answers between two batches)."""
    nodes = ",".join(f"celery@{w.worker_name}" for w in workers)
    out = celery("inspect", command, "--destination", nodes, "--timeout", "60", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def test_celery_inspect_ping_answers_for_every_worker(workers):
    replies = inspect("ping", workers)
    assert replies == {f"celery@{w.worker_name}": {"ok": "pong"} for w in workers}
    queues = inspect("active_queues", workers)
    assert {q["name"] for reply in queues.values() for q in reply} == {"renderfarm.tiny"}


def test_celery_inspect_stats_counts_the_farms_jobs(workers, api_server):
    before = _processed(workers)
    with RenderClient() as client:
        batch = client.submit_batch([RenderRequest(prompt=f"a pebble {i}", model="tiny", width=64, height=64,
                                                   num_inference_steps=2, seed=i) for i in range(3)])
        assert {j.state for j in client.wait(batch.batch_id, timeout=600, progress=False)} == {"succeeded"}
    assert _processed(workers) - before == 3
    assert set(inspect("active", workers)) == {f"celery@{w.worker_name}" for w in workers}
    assert all(reply == [] for reply in inspect("reserved", workers).values()), "nothing left in the buffers"


def _processed(workers) -> int:
    return sum(reply["total"].get("renderfarm.render", 0) for reply in inspect("stats", workers).values())


def test_flower_sees_workers_and_job_events(workers, api_server):
    app = make_celery(get_settings())
    seen: dict[str, list[str]] = defaultdict(list)
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": lambda e: seen[e.get("uuid") or e["hostname"]]
                                                             .append(e["type"])})
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        thread.start()
        try:
            nodes = {f"celery@{w.worker_name}" for w in workers}
            _until(lambda: all("worker-heartbeat" in seen[n] for n in nodes), 60, "worker heartbeats")
            app.control.enable_events()  # what Flower does at start
            with RenderClient() as client:
                batch = client.submit_batch([RenderRequest(prompt="a comet", model="tiny", width=64, height=64,
                                                           num_inference_steps=2, seed=5)])
                [job] = client.wait(batch.batch_id, timeout=600, progress=False)
            _until(lambda: "task-succeeded" in seen[job.job_id], 60, "the job's task-succeeded event")
            assert seen[job.job_id][:3] == ["task-received", "task-started", "task-succeeded"], seen[job.job_id]
        finally:
            app.control.disable_events()
            receiver.should_stop = True
            thread.join(timeout=15)


def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.2)
