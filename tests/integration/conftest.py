"""Integration fixtures beside the session farm of ``tests/conftest.py``: ``start_worker``, the one
way a test module starts workers of its own (a model, a pool, a Redis database other than the
session farm's), stopped when the module ends; ``https_folder``, a real HTTPS server on loopback
for input images fetched by URL; ``compile_cache_in``, the compile-cache store in a bucket of the
test's own, emptied after it; ``private_env`` and ``port_open`` for the tests that start a local
stack of their own (``renderfarm up``, ``renderfarm demo``, the service classes)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from infra.localstack import WorkerProcess, free_port, start_workers
from infra.settings import Settings
from infra.storage.compile_artifacts import CompileCacheStore
from infra.storage.s3 import Storage
from tests.integration.https_site import HttpsSite, https_site

StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def compile_cache_in(farm_env) -> Iterator[Callable[[str], CompileCacheStore]]:
    """``compile_cache_in(bucket)``: the compile-cache store in the session SeaweedFS's ``bucket``
    (created when missing), a bucket of the test's own; every artifact in it is deleted after the test."""
    stores: list[CompileCacheStore] = []

    def open_store(bucket: str) -> CompileCacheStore:
        storage = Storage(Settings(s3_bucket=bucket))
        storage.ensure_bucket()
        stores.append(CompileCacheStore(storage))
        return stores[-1]

    yield open_store
    for store in stores:
        for artifact in store.list():
            store.delete(artifact.key)


@pytest.fixture(scope="module")
def start_worker(run_dir: Path) -> Iterator[StartWorker]:
    """``start_worker(model, env, *, name=None, batch_size=4, extra_args=())``: start one
    ``renderfarm worker`` of ``model`` with the environment ``env`` (e.g. ``farm_env``, or a copy
    naming another Redis database and ``RENDERFARM_POOLS``), wait until it is registered, and
    return it. ``name`` defaults to ``test-<model>-<n>``. Every worker started through it is
    stopped (warm shutdown) when the test module ends, also when it failed to start."""
    procs: list[WorkerProcess] = []

    def start(model: str, env: Mapping[str, str], *, name: str | None = None, batch_size: int = 4,
              extra_args: Sequence[str] = ()) -> WorkerProcess:
        proc = WorkerProcess(model, dict(env), name or f"test-{model}-{len(procs) + 1}", batch_size,
                             extra_args=extra_args, run_dir=run_dir)
        procs.append(proc)
        start_workers([proc])
        return proc

    try:
        yield start
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def https_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsSite]:
    """A folder served over HTTPS on 127.0.0.1 for the module, with a self-signed certificate
    (:func:`tests.integration.https_site.https_site`); a client trusts it with
    ``SSL_CERT_FILE=<site.cert>``."""
    with https_site(tmp_path_factory.mktemp("https")) as site:
        yield site


@pytest.fixture(scope="module")
def webui(api_server, workers):
    """The real webuiapi client (AUTOMATIC1111's API) on the test farm's API."""
    import webuiapi

    url = urlsplit(api_server.url)
    return webuiapi.WebUIApi(host=url.hostname, port=url.port)


@pytest.fixture(scope="module")
def openai_client(api_server, workers):
    """The real OpenAI SDK client on the test farm's API, without retries."""
    from openai import OpenAI

    # the SDK insists on a key; this farm does not require one, and a non-key bearer is anonymous
    with OpenAI(base_url=f"{api_server.url}/v1", api_key="sk-not-needed", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def private_env(cache_dir: Path) -> Callable[[], dict[str, str | None]]:
    """``private_env()``: environment overrides for a child that starts a stack of its own: no
    RENDERFARM_*/AWS_* of this session, a Redis URL nobody answers at (a new free port each call,
    so the stack starts its own redis-server), the session's model cache, and no client settings
    file."""

    def make() -> dict[str, str | None]:
        env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("RENDERFARM_", "AWS_"))}
        env.update(RENDERFARM_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", RENDERFARM_CACHE_DIR=str(cache_dir),
                   RENDERFARM_ENV_FILE="", COLUMNS="200")  # fmt: skip
        return env

    return make


@pytest.fixture
def port_open() -> Callable[[int], bool]:
    """``port_open(port)``: whether something accepts TCP connections on 127.0.0.1:``port``."""

    def probe(port: int) -> bool:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex(("127.0.0.1", port)) == 0

    return probe
