"""Every mode × family that diffusers supports for the tiny builds, through the real farm: one
worker per model (SDXL, SD3, FLUX.1; SD 1 is in test_images.py), inputs uploaded to SeaweedFS,
img2img and inpainting rendered from each pinned pipeline's components: the infotext names the
mode, the worker's step count follows the strength, and another photo gives other pixels."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from infra.localstack import ApiServer, free_port
from infra.storage.images import parse_parameters, read_parameters
from producer import RenderClient

pytestmark = pytest.mark.integration
DB = 12
MODELS = ("tiny-sdxl", "tiny-sd3", "tiny-flux")


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}"}


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-image-families",
                   run_dir=run_dir) as s:
        yield s


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("model", MODELS)
def test_img2img_and_inpaint_render_through_the_farm(model, start_worker, api, env, tmp_path):
    start_worker(model, env, name=f"modes-{model}", batch_size=2)
    photo, other, mask = tmp_path / "photo.png", tmp_path / "other.png", tmp_path / "mask.png"
    for path, seed in ((photo, 1), (other, 2)):
        path.write_bytes(_png(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    mask_px = np.zeros((64, 64), np.uint8)
    mask_px[16:48, 16:48] = 255
    mask.write_bytes(_png(mask_px))
    base = {"prompt": "a mug on a desk", "model": model, "width": 64, "height": 64, "num_inference_steps": 4,
            "guidance_scale": 1.0 if model == "tiny-flux" else 7.5}
    jobs = [{**base, "seed": 1, "init_image": photo, "strength": 0.5},
            {**base, "seed": 2, "init_image": photo, "mask_image": mask, "strength": 0.75},
            {**base, "seed": 1, "init_image": other, "strength": 0.5}]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
        assert [j.state for j in done] == ["succeeded"] * 3, [(j.state, j.error) for j in done]
        modes = [parse_parameters(read_parameters(client.fetch_bytes(j)) or "").get("Mode") for j in done]
        first, changed = (np.asarray(Image.open(io.BytesIO(client.fetch_bytes(done[i]))), dtype=np.float64)
                          for i in (0, 2))
    assert modes == ["img2img", "inpaint", "img2img"]
    assert [j.result.denoising_steps for j in done] == [2, 3, 2]  # ⌊4 × strength⌋ steps, as the worker counted
    # the same request with another photo: other pixels. Mean |difference| 0…255 measured in process
    # (seeds 1–3): SDXL 3.5–4.6, SD3 13.8–17.4, FLUX.1 6.2–7.7; an init image the worker ignored gives 0
    assert (diff := np.abs(first - changed).mean()) > 1.0, f"mean |difference| {diff:.3f}"
