"""Fixtures of the webhook tests: a local HTTP receiver, and two status-API replicas with webhook
settings on their own Redis database of the session's redis-server (so that the session's API,
whose SSRF policy refuses 127.0.0.1, never claims these batches).

Jobs name a model no worker serves; tests finish them through the store, as a worker would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.localstack import ApiServer, free_port
from infra.state.job_store import JobStore

WEBHOOK_DB = 5
UNSERVED_MODEL = "webhook-unserved"


@dataclass
class Call:
    """One POST the receiver got."""

    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST. ``fail_first[path] = n`` answers the
    first ``n`` POSTs to ``path`` with 500."""

    server: ThreadingHTTPServer
    calls: list[Call] = field(default_factory=list)
    fail_first: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def calls_to(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path == path]


@pytest.fixture(scope="package")
def receiver() -> Iterator[Receiver]:
    import time

    holder: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            rec = holder["r"]
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with rec.lock:
                rec.calls.append(Call(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                failing = rec.fail_first.get(self.path, 0)
                if failing:
                    rec.fail_first[self.path] = failing - 1
            self.send_response(500 if failing else 204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder["r"] = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder["r"]
    server.shutdown()
    server.server_close()


def webhook_env(farm_env: dict[str, str], redis_server, db: int = WEBHOOK_DB, **extra: str) -> dict[str, str]:
    """``farm_env`` on Redis database ``db``, with fast webhook retries to 127.0.0.1 allowed."""
    return {**farm_env, "RENDERFARM_REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{db}",
            "RENDERFARM_WEBHOOK_ALLOW_PRIVATE": "true",
            "RENDERFARM_WEBHOOK_BACKOFF_S": "0.3", "RENDERFARM_WEBHOOK_POLL_S": "0.2",
            "RENDERFARM_WEBHOOK_MAX_ATTEMPTS": "5", "RENDERFARM_REAPER_ENABLED": "false",
            "RENDERFARM_DEFAULT_MODEL": UNSERVED_MODEL, **extra}


@pytest.fixture(scope="package")
def webhook_apis(farm_env, redis_server, run_dir) -> Iterator[list[ApiServer]]:
    """Two API replicas with the same webhook settings on Redis database 5."""
    env = webhook_env(farm_env, redis_server)
    servers = [ApiServer(free_port(), env, name=f"api-webhooks-{i}", run_dir=run_dir) for i in (1, 2)]
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="package")
def webhook_store(redis_server) -> JobStore:
    """The job-state store on the webhook APIs' Redis database."""
    return JobStore(redis_server.client(db=WEBHOOK_DB))
