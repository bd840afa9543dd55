"""The upscaling stage through the real farm: a status API with a declared pool (its own Redis
database of the session's redis-server) that lists ``tiny-esrgan-x4``, a ``tiny`` worker of that
pool, SeaweedFS. Results are the upscaled size; the PNG's parameters and the S3 metadata name the
upscaler; an upscaler the pool lacks is a 422 at submit; the upscaled size may exceed max_pixels."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from infra.localstack import ApiServer, WorkerProcess, free_port
from infra.schemas import RenderRequest
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.s3 import decode_metadata
from producer import RenderClient

pytestmark = pytest.mark.integration
DB = 9
POOL = "cpu-tiny-up"
POOLS = [{"name": POOL, "model": "tiny", "device_class": "cpu", "max_pixels": 64 * 128, "max_batch": 4,
          "upscalers": ["tiny-esrgan-x4", "tiny-sd-x4-upscaler", "tiny-sd-x2-latent-upscaler"]}]


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps(POOLS)}


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-upscale", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def worker(start_worker, api, env) -> WorkerProcess:
    return start_worker("tiny", env, name="upscale-1", extra_args=["--pool", POOL])


def _req(prompt: str, seed: int, **kw) -> RenderRequest:
    return RenderRequest(prompt=prompt, seed=seed, model="tiny", **{"width": 64, "height": 64,
                                                                    "num_inference_steps": 2, **kw})


def test_upscaled_results_through_the_farm(worker, env, s3_server):
    batch = [_req("a red fox", 1), _req("一只红色的狐狸，雪地", 2, upscale=4, upscaler="tiny-esrgan-x4"),
             _req("a lighthouse", 3, upscale=2, upscaler="tiny-esrgan-x4"),
             _req("a tall tower", 4, width=64, height=128, upscale=4, upscaler="tiny-esrgan-x4"),
             _req("一座灯塔，黄昏", 5, upscale=4, upscaler="tiny-sd-x4-upscaler"),
             _req("a lighthouse at dusk", 6, upscale=4, upscaler="tiny-sd-x4-upscaler", negative_prompt="blurry"),
             _req("a red fox", 7, width=64, height=128, upscale=2, upscaler="tiny-sd-x4-upscaler"),
             _req("水墨山水", 8, upscale=2, upscaler="tiny-sd-x2-latent-upscaler"),
             _req("a red fox", 9, upscale=4, upscaler="tiny-sd-x2-latent-upscaler")]
    s3, bucket = s3_server.client(), env["RENDERFARM_S3_BUCKET"]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        accepted = client.submit_batch(batch)
        jobs = client.wait(accepted.batch_id, timeout=600)
        assert [j.state for j in jobs] == ["succeeded"] * len(batch), [(j.state, j.error) for j in jobs]
        for request, job in zip(batch, jobs):
            factor = request.upscale or 1
            size = (request.width * factor, request.height * factor)
            assert (job.result.width, job.result.height) == size  # up to 256×512, over max_pixels 64×128: allowed
            assert job.pool == POOL
            data = client.fetch_bytes(job)
            text = read_parameters(data)
            params = parse_parameters(text)
            assert params["prompt"] == request.prompt and params["Size"] == f"{request.width}x{request.height}"
            head = s3.head_object(Bucket=bucket, Key=job.result.key)["Metadata"]
            assert all(v.isascii() for v in head.values())
            assert decode_metadata(head["parameters"]) == text
            if request.upscale:
                assert params["Postprocess upscaler"] == request.upscaler
                assert params["Postprocess upscale by"] == str(request.upscale)
                assert head["upscaler"] == request.upscaler and head["output-size"] == f"{size[0]}x{size[1]}"
            else:
                assert "Postprocess upscaler" not in params and "upscaler" not in head
            assert client.fetch_image(job).size == size


@pytest.mark.parametrize("upscaler", ["esrgan-x4-arch", "sd-x4-upscaler", "stabilityai/sd-x2-latent-upscaler"])
def test_an_upscaler_the_pool_lacks_is_a_422(api, env, upscaler):
    jobs = [{"prompt": "fine", "model": "tiny", "width": 64, "height": 64},
            {"prompt": "a fox", "model": "tiny", "width": 64, "height": 64, "upscale": 4, "upscaler": upscaler}]
    response = httpx.post(f"{env['RENDERFARM_API_URL']}/v1/batches", json={"jobs": jobs})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "jobs", 1, "upscaler"] and f"has no upscaler '{upscaler}'" in detail["msg"]
    half = httpx.post(f"{env['RENDERFARM_API_URL']}/v1/jobs", json={"prompt": "a", "model": "tiny", "upscale": 4})
    assert half.status_code == 422 and "go together" in half.text


def test_without_declared_pools_a_hub_upscaler_is_a_422_naming_the_setting(api_server, farm_env):
    """The session's API declares no pools: only RENDERFARM_UPSCALERS (the offline builds) may be
    named, so no request makes a worker download the file it names."""
    jobs = [{"prompt": "a fox", "model": "tiny", "width": 64, "height": 64, "upscale": 4,
             "upscaler": "owner/repo/RealESRGAN_x4plus.pth"}]
    response = httpx.post(f"{farm_env['RENDERFARM_API_URL']}/v1/batches", json={"jobs": jobs})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["type"] == "unknown_upscaler" and detail["loc"] == ["body", "jobs", 0, "upscaler"]
    assert "RENDERFARM_UPSCALERS" in detail["msg"]
