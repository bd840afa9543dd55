"""A compiling worker warms up before it takes jobs, through the real farm: a status API with a
declared pool (its own Redis database), a ``tiny`` worker whose recipe compiles the VAE decoder
with Inductor (static shapes), SeaweedFS.

The pool declares one size (64²) and the worker batch size 2: buckets 1 and 2, compiled at
warm-up. A batch submitted while the worker warms waits in the queue and starts after it is
ready; a group of 3 renders as 2 + 1 without compiling, and each pipeline call is seen running the
compiled decoder (``compiled_renders``); a size the pool did not declare runs eagerly and is seen
so (``eager_renders``), the compiled count unchanged. ``/v1/workers`` and ``/metrics`` show all of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from infra.localstack import ApiServer, WorkerProcess, free_port
from infra.schemas import RenderRequest
from producer import RenderClient

pytestmark = [pytest.mark.integration, pytest.mark.long]
DB = 12
POOL = "cpu-tiny-warm"
POOLS = [{"name": POOL, "model": "tiny", "device_class": "cpu", "max_pixels": 72 * 64, "max_batch": 2,
          "sizes": [[64, 64]], "steps": 1, "guidance_scale": 7.5}]


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps(POOLS),
            "RENDERFARM_RECIPE_OVERRIDES": json.dumps({"compile_vae": True}),
            "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5"}


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-warm", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def worker(api, env, run_dir) -> Iterator[WorkerProcess]:
    """Started, and returned as soon as it is registered (while it loads), with
    ``first_entry``: its entry in the first ``/v1/workers`` answer that listed it.

    With the decoder's packages in Inductor's cache the warm-up takes about half a second, so
    the loop polls every 50 ms and the state is kept from the poll that first saw the worker:
    a later look (the test's first line, after the fixture returns) can already find it ready."""
    proc = WorkerProcess("tiny", env, "warm-1", 2, extra_args=["--pool", POOL], run_dir=run_dir)
    try:
        proc.start()
        deadline = time.monotonic() + proc.ready_timeout
        with httpx.Client(base_url=env["RENDERFARM_API_URL"], timeout=10) as http:
            while not (entry := next((w for w in http.get("/v1/workers").json() if w["name"] == proc.worker_name),
                                     None)):
                assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
                assert time.monotonic() < deadline, proc.log_tail()
                time.sleep(0.05)
        proc.first_entry = entry
        yield proc
    finally:
        proc.stop()


def _req(seed: int, width: int = 64, height: int = 64) -> RenderRequest:
    return RenderRequest(prompt=f"a green hill {seed}", seed=seed, model="tiny", width=width, height=height,
                         num_inference_steps=2)


def _me(env, name: str) -> dict:
    (me,) = [w for w in httpx.get(f"{env['RENDERFARM_API_URL']}/v1/workers").json() if w["name"] == name]
    return me


def _after_images(env, name: str, images: int) -> dict:
    """The worker's ``/v1/workers`` entry from the first heartbeat that counts ``images`` stored:
    a heartbeat after the job ended can still carry the one before. An image is counted stored
    after its pipeline call, so that entry's render counts include every call of those images."""
    deadline = time.monotonic() + 30
    while (me := _me(env, name))["images_done"] < images:
        assert time.monotonic() < deadline, me
        time.sleep(0.5)
    return me


def _counts(me: dict) -> dict:
    return {k: me[k] for k in ("images_done", "compiled_renders", "eager_renders", "recompiles")}


def test_jobs_wait_for_the_warm_up_and_nothing_recompiles_after_it(worker, env):
    first = worker.first_entry
    # listed while it loads: before its pipeline, device profile or batch size exist
    assert first["state"] == "loading" and first["batch_size"] is None and first["device"] is None, first
    seen_states = {first["state"]}
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        accepted = client.submit_batch([_req(i) for i in range(3)])  # 3 → buckets 2 + 1
        jobs = client.wait(accepted.batch_id, timeout=900)
        assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.state, j.error) for j in jobs]
        me = _me(env, worker.worker_name)
        seen_states.add(me["state"])
        assert me["state"] == "ready" and me["buckets"] == [1, 2]
        report = me["warmup"]["report"]
        assert report["compiled"] and report["renders"] == 2 and report["compiles"] >= 2
        assert me["warmup"]["done"] == me["warmup"]["total"] == 2
        # the consumer starts after warm-up: no job of the batch started before the worker was ready
        assert all(j.started_at.timestamp() >= me["warmup"]["ready_at"] - 0.5 for j in jobs)
        # 3 images are two pipeline calls (2 + 1), or three if they reached the worker apart
        me = _after_images(env, worker.worker_name, 3)
        compiled = me["compiled_renders"]
        assert 2 <= compiled <= 3 and me["recompiles"] == 0 and me["eager_renders"] == 0, _counts(me)

        odd = client.wait(client.submit_batch([_req(9, width=72)]).batch_id, timeout=600)  # not declared
        assert odd[0].state == "succeeded" and (odd[0].result.width, odd[0].result.height) == (72, 64)
    me = _after_images(env, worker.worker_name, 4)
    assert _counts(me) == {"images_done": 4, "compiled_renders": compiled, "eager_renders": 1, "recompiles": 0}
    assert seen_states == {"loading", "ready"}  # seen loading right after it registered
    # the seconds of each state it went through: no sizing, its batch size was given (2)
    assert set(me["startup"]["phases"]) == {"loading", "warming"}, me["startup"]
    assert me["startup"]["phases"]["warming"] >= report["seconds"] * 0.9
    metrics = httpx.get(f"{env['RENDERFARM_API_URL']}/metrics").text
    labels = f'pool="{POOL}",worker="{worker.worker_name}"'
    assert f"renderfarm_recompiles_total{{{labels}}} 0.0" in metrics
    assert f"renderfarm_eager_renders_total{{{labels}}} 1.0" in metrics
    assert f"renderfarm_compiled_renders_total{{{labels}}} {float(compiled)}" in metrics
    assert f"renderfarm_warmup_seconds{{{labels}}}" in metrics


def test_a_worker_killed_while_loading_is_gone_as_a_ready_one_is(api, env, run_dir) -> None:
    """Listed as ``loading`` within its first seconds, then killed (SIGKILL: no deregistration):
    it drops out of ``/v1/workers`` once its heartbeat's TTL (2 s here) has passed."""
    proc = WorkerProcess("tiny", {**env, "RENDERFARM_HEARTBEAT_TTL_S": "2"}, "warm-dies", 2,
                         extra_args=["--pool", POOL], run_dir=run_dir)
    try:
        started = time.monotonic()
        proc.start()
        while not (entry := next((w for w in httpx.get(f"{env['RENDERFARM_API_URL']}/v1/workers").json()
                                  if w["name"] == proc.worker_name), None)):
            assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
            assert time.monotonic() - started < 60, proc.log_tail()
            time.sleep(0.05)
        assert entry["state"] == "loading", entry
        assert proc.proc is not None
        proc.proc.kill()
        killed = time.monotonic()
        while any(w["name"] == proc.worker_name for w in httpx.get(f"{env['RENDERFARM_API_URL']}/v1/workers").json()):
            assert time.monotonic() - killed < 10, "a worker killed while loading is still listed"
            time.sleep(0.2)
    finally:
        proc.stop()
