"""The shared compile cache on real processes: ``renderfarm worker`` starts with compile on, real
Redis (its own database) and SeaweedFS, each start with an empty Inductor cache directory (as a
new pod has).

1. The first start finds no artifact (``miss``), compiles during its warm-up and saves
   ``compile-cache/<key>.bin``; it also converts the UNet to OpenVINO and saves the IR
   (``compile-cache/<key>.ir/``).
2. A second start loads both (``hit``): it reads the IR instead of tracing the UNet, and
   compiles nothing new: the VAE decoder's AOTInductor packages (one per bucket) are loaded, none
   compiled, Inductor's FX graph cache counts no misses, and its log says so.
3. A corrupt artifact (one payload byte flipped) falls back to compiling with one log line
   naming the checksum; the worker still serves a job, and its save replaces the corrupt blob.
   This start reuses the first one's Inductor cache directory: its compile is the fallback's, not
   a second cold one.

Shapes are tiny: the tiny model, a pool of 64² at 1 step, buckets 1 and 2; the UNet runs in
OpenVINO on every CPU class (the override), so only the VAE decoder is compiled, which keeps a
cold start to a few minutes on this 2-core machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.localstack import ApiServer, WorkerProcess, free_port, start_workers
from infra.settings import Settings
from infra.storage.compile_artifacts import CompileCacheStore, object_name
from infra.storage.s3 import Storage
from pipeline.compile_cache import read_header
from producer.client import RenderClient

pytestmark = [pytest.mark.integration, pytest.mark.long]
DB = 11
POOL = {"name": "tiny-cc", "model": "tiny", "device_class": "cpu", "max_pixels": 64 * 64, "max_batch": 2,
        "steps": 1, "queue": "renderfarm.tiny-cc"}
OVERRIDES = {"compile_vae": True, "batch_invariant": False, "backend": "openvino"}


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps([POOL]),
            "RENDERFARM_RECIPE_OVERRIDES": json.dumps(OVERRIDES), "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5"}


@pytest.fixture(scope="module")
def store(env) -> Iterator[CompileCacheStore]:
    cache = CompileCacheStore(Storage(Settings()))  # farm_env is in os.environ
    for artifact in cache.list():
        if artifact.meta.get("model") == "tiny":
            cache.delete(artifact.key)
    yield cache


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-compile-cache",
                   run_dir=run_dir) as server:
        yield server


@pytest.fixture(scope="module")
def start(env, run_dir, tmp_path_factory):
    """``start(label, inductor=None)``: one worker of the pool with a fresh, empty Inductor cache
    directory (or the ``label`` one of an earlier start); stopped after the module."""
    procs: list[WorkerProcess] = []
    dirs: dict[str, Path] = {}

    def run(label: str, inductor_of: str | None = None) -> WorkerProcess:
        inductor = dirs[inductor_of] if inductor_of else tmp_path_factory.mktemp(f"inductor-{label}")
        dirs[label] = inductor
        proc = WorkerProcess("tiny", {**env, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}, f"cc-{label}", 2,
                             extra_args=["--pool", POOL["name"]], run_dir=run_dir)
        procs.append(proc)
        start_workers([proc])
        return proc

    yield run
    for proc in reversed(procs):
        proc.stop()


def _entry(env: dict[str, str], name: str, timeout_s: float = 900.0) -> dict:
    """The worker's /v1/workers entry once it is ``ready`` (it registers as ``warming`` first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = httpx.get(f"{env['RENDERFARM_API_URL']}/v1/workers", timeout=10).json()
        entry = next((w for w in workers if w["name"] == name), None)
        if entry is not None and entry.get("state") == "ready":
            return entry
        assert time.monotonic() < deadline, f"worker {name} not ready after {timeout_s}s: {entry}"
        time.sleep(1.0)


def _ir(entry: dict) -> dict:
    """The worker's OpenVINO IR cache outcome, from its recipe report."""
    return entry["recipe"]["report"]["applied"]["backend"]["ir"]


def _log(proc: WorkerProcess) -> str:
    return Path(proc.log_path).read_text(errors="replace")


def test_first_start_compiles_and_saves(env, api, store, start) -> None:
    proc = start("cold")
    entry = _entry(env, proc.worker_name)
    cache = entry["compile_cache"]
    assert cache["outcome"] == "miss", cache
    assert cache["counters"]["aot_compiled"] == 2, cache  # it compiled the decoder at buckets 1 and 2
    assert cache["compiler_warm_up"] == "kept", cache  # a miss compiles: the toolchain warm-up is let run
    assert cache["saved"]["bytes"] > 0, cache
    stored = {a.key: a for a in store.list()}
    assert cache["key"] in stored and stored[cache["key"]].bytes == cache["saved"]["bytes"]
    assert stored[cache["key"]].meta["model"] == "tiny" and stored[cache["key"]].kind == "inductor"
    assert f"compile cache miss: {cache['key']}" in _log(proc)
    ir = _ir(entry)
    assert ir["outcome"] == "miss" and ir["saved"]["bytes"] == ir["bytes"] > 0, ir
    assert stored[ir["key"]].kind == "openvino-ir" and stored[ir["key"]].bytes > ir["bytes"]  # + the manifest
    assert f"openvino IR cache miss: {ir['key']}" in _log(proc)
    proc.stop()


def test_second_start_loads_and_compiles_nothing(env, api, store, start) -> None:
    proc = start("cached")
    entry = _entry(env, proc.worker_name)
    cache = entry["compile_cache"]
    assert cache["outcome"] == "hit", cache
    assert cache["counters"]["fxgraph_cache_miss"] == cache["counters"]["aot_compiled"] == 0, cache  # nothing new
    assert cache["counters"]["aot_loaded"] == 2, cache  # the decoder's packages, one per bucket
    assert cache["saved"] is None, cache  # nothing to save
    # a hit compiles nothing, so the compiler warm-up child is not let run: "stopped" when it still
    # ran as the hit was found, "finished" when it had exited (its one tiny kernel can come from the
    # Inductor cache the first start filled, while this process loads the pipeline); which comes
    # first is a race between two processes, and both mean the child no longer runs
    assert cache["compiler_warm_up"] in ("stopped", "finished"), cache
    log = _log(proc)
    assert f"compile cache hit: {cache['key']}" in log
    assert "compile cache hit: Inductor FX graph cache" in log and ", 0 miss(es);" in log
    assert "AOTInductor packages 2 loaded, 0 compiled after the warm-up" in log
    ir = _ir(entry)
    assert ir["outcome"] == "hit" and ir["saved"] is None, ir  # read, not traced again
    assert f"openvino IR cache hit: {ir['key']}" in log
    proc.stop()


def test_corrupt_artifact_falls_back_and_serves(env, api, store, start) -> None:
    (artifact,) = [a for a in store.list() if a.meta.get("model") == "tiny" and a.kind == "inductor"]
    blob = bytearray(store.get(artifact.key) or b"")
    blob[-100] ^= 0xFF  # one payload byte: the header still reads, the checksum does not match
    store.storage.client.put_object(Bucket=store.storage.bucket, Key=object_name(artifact.key), Body=bytes(blob))
    # the fallback is the behaviour here, not a cold compile (the first test has one): the worker
    # compiles with the first start's Inductor cache directory, so its kernels come from there
    proc = start("corrupt", inductor_of="cold")
    cache = _entry(env, proc.worker_name)["compile_cache"]
    assert cache["outcome"] == "corrupt" and "SHA-256" in cache["reason"], cache
    # the artifact was refused: the decoder's two packages came from this start's own compile path
    # (built, or found in the Inductor cache directory it shares with the first start), not from it
    assert cache["counters"]["aot_compiled"] + cache["counters"]["aot_loaded"] == 2, cache
    assert cache["saved"]["bytes"] > 0, cache
    assert f"compile cache corrupt: {artifact.key}" in _log(proc)
    accepted = httpx.post(f"{env['RENDERFARM_API_URL']}/v1/jobs", timeout=30,
                          json={"prompt": "after a corrupt cache", "model": "tiny", "width": 64, "height": 64,
                                "num_inference_steps": 1, "seed": 7})
    assert accepted.status_code == 202, accepted.text
    with RenderClient(env["RENDERFARM_API_URL"]) as client:
        [job] = client.wait(accepted.json()["batch_id"], timeout=300, progress=False)
    assert job.state == "succeeded", job
    repaired = store.get(artifact.key) or b""
    assert repaired != bytes(blob) and read_header(repaired)["key"] == artifact.key  # the save replaced it
