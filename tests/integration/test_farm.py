"""The farm end to end on real components: redis-server, SeaweedFS, two Celery worker
processes on the tiny model, and the status API, driven through the Python client, the CLI
and plain HTTP."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from infra.schemas import RenderRequest
from infra.storage.images import read_parameters, request_from_parameters
from infra.storage.s3 import decode_metadata
from producer import NotFoundError

pytestmark = pytest.mark.integration
MODEL = "tiny"


@pytest.fixture(scope="module")
def s3(s3_server, farm_env):
    return s3_server.client(), farm_env["RENDERFARM_S3_BUCKET"]


def _req(prompt: str, **kw) -> RenderRequest:
    base = dict(model=MODEL, width=64, height=64, num_inference_steps=3, guidance_scale=5.0)
    return RenderRequest(prompt=prompt, **{**base, **kw})


LONE = _req("a lighthouse on a cliff at dusk", seed=4242, negative_prompt="fog")
MIXED = [
    _req("a red fox in the snow", seed=1),
    LONE,
    _req("a bowl of ramen", seed=2, negative_prompt="blurry"),
    _req("a tall narrow tower", seed=3, width=64, height=128, output_format="webp"),
    _req("a city at night", seed=4, num_inference_steps=2),
    _req("a watercolor cat", seed=5, output_format="jpeg"),
    _req("a watercolor cat", seed=6),
    _req("an astronaut riding a horse", seed=7, guidance_scale=0.0, width=96, height=64),
]


@pytest.fixture(scope="module")
def mixed_batch(client):
    accepted = client.submit_batch(MIXED)
    return accepted, client.wait(accepted.batch_id, timeout=600)


@pytest.fixture(scope="module")
def lone_job(client):
    accepted = client.submit_batch([LONE])
    return client.wait(accepted.batch_id, timeout=600)[0]


def test_every_job_succeeds_in_submission_order(mixed_batch):
    accepted, jobs = mixed_batch
    assert [j.job_id for j in jobs] == accepted.job_ids
    assert [j.state for j in jobs] == ["succeeded"] * len(MIXED), [(j.state, j.error) for j in jobs]
    assert all(j.progress == 1.0 and j.attempts == 1 and j.worker for j in jobs)
    assert [j.result.seed for j in jobs] == [r.seed for r in MIXED]


def test_objects_decode_at_requested_size_and_format(mixed_batch, s3):
    s3_client, bucket = s3
    accepted, jobs = mixed_batch
    for request, job in zip(MIXED, jobs):
        ext = {"png": "png", "webp": "webp", "jpeg": "jpg"}[request.output_format]
        assert job.result.key == f"{accepted.batch_id}/{job.job_id}.{ext}"
        obj = s3_client.get_object(Bucket=bucket, Key=job.result.key)
        data = obj["Body"].read()
        assert obj["ContentType"] == job.result.content_type and len(data) == job.result.bytes
        image = Image.open(io.BytesIO(data))
        assert image.format == {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}[request.output_format]
        assert image.size == (request.width, request.height)
        assert obj["Metadata"]["seed"] == str(request.seed)


def test_parameters_chunk_round_trips(mixed_batch, client, s3):
    s3_client, bucket = s3
    _, jobs = mixed_batch
    for request, job in zip(MIXED, jobs):
        text = read_parameters(client.fetch_bytes(job))
        back = request_from_parameters(text)
        # a request that kept the model's own scheduler comes back naming it: the tiny model's DDIM
        rendered = request.model_copy(update={"scheduler": "ddim"}) if request.scheduler == "default" else request
        assert "Sampler: DDIM," in text
        assert back.model_dump(exclude={"output_format", "metadata"}) == rendered.model_dump(
            exclude={"output_format", "metadata"})
        head = s3_client.head_object(Bucket=bucket, Key=job.result.key)
        assert head["Metadata"]["parameters"].isascii()
        assert f"Seed: {request.seed}" in decode_metadata(head["Metadata"]["parameters"])


def test_alone_and_in_a_mixed_batch_give_identical_pixels(mixed_batch, lone_job, client):
    _, jobs = mixed_batch
    in_batch = np.asarray(client.fetch_image(jobs[MIXED.index(LONE)]))
    alone = np.asarray(client.fetch_image(lone_job))
    assert in_batch.shape == alone.shape == (64, 64, 3)
    assert np.array_equal(in_batch, alone)
    # and the image is not trivially constant or equal to a different seed's
    other = np.asarray(client.fetch_image(jobs[0]))
    assert in_batch.std() > 1 and not np.array_equal(in_batch, other)


def test_presigned_url_serves_the_image(mixed_batch):
    _, jobs = mixed_batch
    response = httpx.get(jobs[0].result.url)
    assert response.status_code == 200 and response.content[:8] == b"\x89PNG\r\n\x1a\n"
    tampered = jobs[0].result.url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(tampered).status_code == 403


def test_wait_on_a_finished_batch_returns_in_submission_order(mixed_batch, client):
    accepted, _ = mixed_batch
    again = client.wait(accepted.batch_id, timeout=5)
    assert [j.job_id for j in again] == accepted.job_ids
    status = client.batch(accepted.batch_id)
    assert status.done and status.progress == 1.0 and status.counts["succeeded"] == len(MIXED)


def _farm_keys(redis_server) -> tuple[int, int]:
    r = redis_server.client()
    jobs = sum(1 for _ in r.scan_iter(match="rf:job:*", count=1000))
    queued = sum(r.llen(k) for k in r.scan_iter(match="renderfarm.*", count=1000) if r.type(k) == b"list")
    return jobs, queued


@pytest.mark.parametrize("bad,field,needle", [
    ({"prompt": "x", "width": 100}, "width", "multiple of 8"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"prompt": "x", "num_inference_steps": 500}, "num_inference_steps", "less than or equal to 150"),
    ({"prompt": "x", "guidance_scale": 31}, "guidance_scale", "less than or equal to 30"),
    ({"prompt": "x", "output_format": "gif"}, "output_format", "png"),
])
def test_bad_requests_get_422_naming_the_field_and_record_nothing(api_server, farm_env, redis_server, bad, field,
                                                                  needle):
    before = _farm_keys(redis_server)
    url = farm_env["RENDERFARM_API_URL"]
    one = httpx.post(f"{url}/v1/jobs", json=bad)
    assert one.status_code == 422
    detail = one.json()["detail"][0]
    assert detail["loc"][-1] == field and needle in detail["msg"]
    many = httpx.post(f"{url}/v1/batches", json={"jobs": [{"prompt": "fine"}, bad]})
    assert many.status_code == 422
    assert many.json()["detail"][0]["loc"][:3] == ["body", "jobs", 1]
    assert _farm_keys(redis_server) == before


def test_python_client_refuses_bad_input_before_sending(client, redis_server):
    before = _farm_keys(redis_server)
    with pytest.raises(ValidationError) as info:
        client.submit_batch([{"prompt": "ok", "model": MODEL}, {"prompt": "x", "height": 4000}])
    assert info.value.errors()[0]["loc"] == ("jobs", 1, "height")
    assert _farm_keys(redis_server) == before


def test_unknown_ids_are_404(api_server, farm_env, client):
    url = farm_env["RENDERFARM_API_URL"]
    for method, path in [("GET", "/v1/jobs/deadbeef"), ("GET", "/v1/batches/deadbeef"),
                         ("DELETE", "/v1/jobs/deadbeef"), ("DELETE", "/v1/batches/deadbeef")]:
        assert httpx.request(method, url + path).status_code == 404
    with pytest.raises(NotFoundError):
        client.status("deadbeef")


def test_http_single_job(api_server, workers, farm_env, client):
    url = farm_env["RENDERFARM_API_URL"]
    r = httpx.post(f"{url}/v1/jobs", json={"prompt": "a teapot", "model": MODEL, "width": 64, "height": 64,
                                           "num_inference_steps": 2, "seed": 11})
    assert r.status_code == 202
    accepted = r.json()
    jobs = client.wait(accepted["batch_id"], timeout=600)
    assert [j.job_id for j in jobs] == [accepted["job_id"]] and jobs[0].state == "succeeded"
    body = httpx.get(f"{url}/v1/jobs/{accepted['job_id']}").json()
    assert body["result"]["width"] == 64 and body["result"]["url"].startswith("http")


def _cli(farm_env, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], env=farm_env | {"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=timeout)


def test_cli_submit_status_wait(api_server, workers, farm_env, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a paper boat\n\na glass of water\n")
    sub = _cli(farm_env, "submit", "--prompts", str(prompts), "--model", MODEL, "--width", "64", "--height", "64",
               "--steps", "2", "--seed", "100")
    assert sub.returncode == 0, sub.stderr
    batch_id = sub.stdout.strip()
    waited = _cli(farm_env, "wait", batch_id, "--timeout", "600", "--json")
    assert waited.returncode == 0, waited.stderr
    jobs = json.loads(waited.stdout)
    assert [j["request"]["prompt"] for j in jobs] == ["a paper boat", "a glass of water"]
    assert [j["result"]["seed"] for j in jobs] == [100, 101]
    status = _cli(farm_env, "status", jobs[0]["job_id"], "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "succeeded"
    assert "2 jobs" in _cli(farm_env, "status", batch_id).stdout


def test_cli_bad_input_and_unknown_id(api_server, farm_env):
    bad = _cli(farm_env, "submit", "--prompt", "x", "--width", "100")
    assert bad.returncode == 2 and "width" in bad.stderr and "multiple of 8" in bad.stderr
    unknown = _cli(farm_env, "status", "deadbeef")
    assert unknown.returncode == 2 and "unknown" in unknown.stderr


def test_workers_are_registered(api_server, workers, farm_env):
    listed = httpx.get(f"{farm_env['RENDERFARM_API_URL']}/v1/workers").json()
    names = {w["name"] for w in listed}
    assert {w.name for w in workers} <= names
    for w in listed:
        assert w["model"] == MODEL and w["batch_size"] == 8 and w["device"]["kind"] == "cpu"
        assert w["heartbeat_age_s"] < 20 and w["pid"] > 0 and w["recipe"]["name"]
    health = httpx.get(f"{farm_env['RENDERFARM_API_URL']}/healthz").json()
    assert health == {"status": "ok", "checks": {"redis": "ok", "s3": "ok"}}


def test_workers_report_their_warm_up_and_buckets(api_server, workers, farm_env):
    """Each worker registers while warming and turns ready with its warm-up report: batch size 8
    gives buckets 1, 2, 4, 8; the CPU recipe compiles nothing, so it warms with one render and
    nothing recompiles afterwards."""
    deadline = time.monotonic() + 120
    while True:
        listed = {w["name"]: w for w in httpx.get(f"{farm_env['RENDERFARM_API_URL']}/v1/workers").json()}
        mine = [listed[w.name] for w in workers if w.name in listed]
        if len(mine) == len(workers) and all(w["state"] == "ready" for w in mine):
            break
        assert all(w["state"] in ("warming", "ready") for w in mine), mine
        assert time.monotonic() < deadline, f"workers still warming: {mine}"
        time.sleep(0.5)
    for w in mine:
        assert w["buckets"] == [1, 2, 4, 8] and w["recompiles"] == 0 and w["eager_renders"] == 0
        report = w["warmup"]["report"]
        assert report["compiled"] is False and report["renders"] == 1 and report["plan"]["buckets"] == [1, 2, 4, 8]
