"""Celery accepts JSON only: a pickle-serialized message injected straight into a worker's queue
is refused without being unpickled, it is logged, and the worker keeps rendering.

(Malformed JSON messages are tested with the fault-injection suite.)
"""

from __future__ import annotations

import pathlib
import secrets
import time

import pytest

from infra import keys
from infra.broker.app import TASK_NAME, make_celery
from infra.pools import pool_for_model
from infra.schemas import RenderRequest
from infra.settings import Settings
from producer import RenderClient

pytestmark = pytest.mark.integration
MODEL = "tiny"


class _TouchOnUnpickle:
    """Unpickling this creates ``path``: proof that someone deserialized the payload."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def _queued(redis_server, queue: str) -> int:
    client = redis_server.client()
    return sum(client.llen(k) for k in client.scan_iter(f"{queue}*") if client.type(k) == "list")


def test_pickle_message_is_refused_and_the_worker_lives(workers, api_server, redis_server, tmp_path):
    marker = tmp_path / "unpickled"
    queue = keys.queue(pool_for_model(MODEL))
    app = make_celery(Settings())
    try:
        app.send_task(TASK_NAME, kwargs={"job_id": secrets.token_hex(16), "evil": _TouchOnUnpickle(marker)},
                      queue=queue, routing_key=queue, serializer="pickle")
    finally:
        app.close()
    logs = lambda: "".join(w.log_path.read_text(errors="replace") for w in workers)  # noqa: E731
    deadline = time.monotonic() + 60
    refusal = "Refusing to deserialize untrusted content of type pickle"
    while refusal not in logs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refusal in logs(), logs()[-3000:]
    assert not marker.exists(), "a worker unpickled the payload"
    assert all(w.running for w in workers)
    assert _queued(redis_server, queue) == 0
    # and the workers still render
    with RenderClient() as client:
        accepted = client.submit_batch([RenderRequest(prompt="after the pickle", model=MODEL, width=64, height=64,
                                                      num_inference_steps=2, seed=3)])
        jobs = client.wait(accepted.batch_id, timeout=300)
    assert [j.state for j in jobs] == ["succeeded"] and not marker.exists()
    assert all(w.running for w in workers)
