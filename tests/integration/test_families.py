"""tiny-flux through the real farm: a WorkerProcess (``renderfarm worker --model tiny-flux``), the
status API, redis-server and SeaweedFS S3 (the session fixtures of ``tests/conftest.py``). A mixed
batch renders; what FLUX.1-schnell cannot do is a 422 at submission, before anything is queued."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from infra.schemas import RenderRequest
from producer import RenderClient

pytestmark = pytest.mark.integration
MODEL = "tiny-flux"


@pytest.fixture(scope="module")
def flux_worker(start_worker, farm_env, api_server):
    return start_worker(MODEL, farm_env)


def _req(prompt: str, seed: int, **kw) -> RenderRequest:
    return RenderRequest(prompt=prompt, seed=seed, model=MODEL, **{"width": 64, "height": 64,
                                                                   "num_inference_steps": 2, **kw})


MIXED = [
    _req("a red fox in the snow", 1),
    _req("a lighthouse at dusk", 2, guidance_scale=0.0),
    _req("a tall tower", 3, width=64, height=96, output_format="webp"),
    _req("a city at night", 4, num_inference_steps=3),
    _req("a watercolor cat", 5, width=128, height=64, output_format="jpeg"),
    _req("a watercolor cat", 6),
]


def test_tiny_flux_renders_a_mixed_batch_through_the_farm(flux_worker, farm_env):
    with RenderClient() as client:
        accepted = client.submit_batch(MIXED)
        jobs = client.wait(accepted.batch_id, timeout=600)
        assert [j.state for j in jobs] == ["succeeded"] * len(MIXED), [(j.state, j.error) for j in jobs]
        pixels = []
        for request, job in zip(MIXED, jobs):
            image = client.fetch_image(job)
            assert image.size == (request.width, request.height)
            pixels.append(np.asarray(image.convert("RGB")))
    assert all(p.std() > 1 for p in pixels)  # pictures, not blanks
    assert not np.array_equal(pixels[0], pixels[5])  # seeds and prompts matter
    worker = next(w for w in httpx.get(f"{farm_env['RENDERFARM_API_URL']}/v1/workers").json()
                  if w.get("model") == MODEL)
    recipe = worker["recipe"]
    assert recipe["family"] == "flux-schnell" and recipe["denoiser"] == "transformer"
    assert recipe["report"]["applied"]["dtype"] == "float32"  # the CPU reference dtype
    assert recipe["capabilities"]["negative_prompt"] is False


@pytest.mark.parametrize("field, value, msg", [
    ("negative_prompt", "blurry", "takes no negative prompt"),
    ("guidance_scale", 3.5, "ignores guidance_scale"),
    ("scheduler", "ddim", "cannot use scheduler 'ddim'"),
    ("width", 72, "multiple of 16"),
])
def test_what_flux_schnell_cannot_do_is_a_422_at_submission(api_server, farm_env, field, value, msg):
    url = farm_env["RENDERFARM_API_URL"]
    job = {"prompt": "a fox", "model": MODEL, "width": 64, "height": 64, field: value}
    response = httpx.post(f"{url}/v1/batches", json={"jobs": [{"prompt": "fine", "model": MODEL}, job]})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "jobs", 1, field] and msg in detail["msg"]
