"""Fixtures of the security tests: extra status-API processes with security settings, on the
session's redis-server and SeaweedFS (tests/conftest.py), and tenants' keys.

``secure_api`` requires keys (``RENDERFARM_AUTH_REQUIRED=true``) with generous limits;
``tight_api`` requires keys too but has small limits (body, rate, presign lifetime), so that
each limit can be hit quickly. Jobs submitted here name models no worker serves, so the
session's workers never pick them up; tests that need a finished job finish it through the
store, as a worker would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from infra.api.auth import KeyStore
from infra.localstack import ApiServer, RedisServer, free_port
from infra.schemas import JobResult
from infra.state.job_store import JobStore

#: A model no test worker serves: jobs for it stay queued until a test moves them.
UNSERVED_MODEL = "security-unserved"

TIGHT = {
    "RENDERFARM_MAX_BODY_BYTES": str(64 * 1024),
    "RENDERFARM_RATE_LIMIT_REQUESTS_PER_S": "2",
    "RENDERFARM_RATE_LIMIT_REQUEST_BURST": "10",
    "RENDERFARM_RATE_LIMIT_JOBS_PER_S": "1",
    "RENDERFARM_RATE_LIMIT_JOB_BURST": "5",
    "RENDERFARM_PRESIGN_EXPIRES_S": "2",
}


def start_api(farm_env: dict[str, str], run_dir: Path, name: str, **overrides: str) -> ApiServer:
    """An ApiServer on a free port with ``farm_env`` plus ``overrides``, ready."""
    server = ApiServer(free_port(), {**farm_env, **overrides}, name=name, run_dir=run_dir)
    server.start()
    server.wait_ready()
    return server


@dataclass
class Tenant:
    """A tenant with one key, and an httpx client that sends it."""

    name: str
    key_id: str
    key: str
    http: httpx.Client


@pytest.fixture(scope="package")
def secure_api(farm_env, run_dir) -> Iterator[ApiServer]:
    server = start_api(farm_env, run_dir, "api-secure", RENDERFARM_AUTH_REQUIRED="true",
                       RENDERFARM_DEFAULT_MODEL=UNSERVED_MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="package")
def tight_api(farm_env, run_dir) -> Iterator[ApiServer]:
    server = start_api(farm_env, run_dir, "api-tight", RENDERFARM_AUTH_REQUIRED="true",
                       RENDERFARM_DEFAULT_MODEL=UNSERVED_MODEL, **TIGHT)
    yield server
    server.stop()


@pytest.fixture(scope="package")
def keystore(redis_server: RedisServer) -> KeyStore:
    return KeyStore(redis_server.client())


@pytest.fixture(scope="package")
def store(redis_server: RedisServer) -> JobStore:
    return JobStore(redis_server.client())


@pytest.fixture(scope="package")
def make_tenant(keystore: KeyStore):
    """``make_tenant(name, base_url)`` → a :class:`Tenant` with a fresh key; clients closed at the end."""
    clients: list[httpx.Client] = []

    def make(name: str, base_url: str) -> Tenant:
        info, key = keystore.create(name, name="pytest")
        http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=30)
        clients.append(http)
        return Tenant(name, info.key_id, key, http)

    yield make
    for http in clients:
        http.close()


def _module_tenant(request, secure_api: ApiServer, make_tenant, suffix: str) -> Tenant:
    """A tenant of ``secure_api`` named after the test module (``<module>-<suffix>``), so that
    modules sharing the package's API never share a tenant."""
    return make_tenant(f"{request.module.__name__.rsplit('.', 1)[-1]}-{suffix}", secure_api.url)


@pytest.fixture(scope="module")
def tenant_a(request, secure_api, make_tenant) -> Tenant:
    """This module's first tenant on ``secure_api`` (the owner in isolation tests)."""
    return _module_tenant(request, secure_api, make_tenant, "a")


@pytest.fixture(scope="module")
def tenant_b(request, secure_api, make_tenant) -> Tenant:
    """This module's second tenant on ``secure_api`` (the prober in isolation tests)."""
    return _module_tenant(request, secure_api, make_tenant, "b")


@pytest.fixture(scope="package")
def finish_as_worker(store: JobStore):
    """``finish_as_worker(job_id, key)`` moves a queued job to ``succeeded`` with its image at
    S3 ``key``, as a worker would."""

    def finish(job_id: str, key: str, *, worker: str = "pytest-worker") -> None:
        started = store.start_many([job_id], worker)[job_id]
        assert not isinstance(started, str), started
        result = JobResult(key=key, width=64, height=64, seed=started.request.seed, content_type="image/png",
                           bytes=8)
        assert store.succeed(started, result)

    return finish


@pytest.fixture(scope="package")
def job_body() -> dict:
    """A small valid RenderRequest body for a model no worker serves."""
    return {"prompt": "a tenant's secret lighthouse", "model": UNSERVED_MODEL, "width": 64, "height": 64,
            "num_inference_steps": 2, "seed": 5}
