"""OpenAI's ``client.videos`` on a farm of its own whose pools declare video families (the
``null`` model standing in for the weights, so no diffusion model is loaded): ``seconds`` becomes
the family's frames at its frame rate, clipped to the pool's ``max_frames``; what the family
cannot render (a size off its multiple, an ``input_reference`` for a family without
image-to-video) is a 400 naming the SDK's parameter, and nothing is recorded."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from infra.localstack import ApiServer, free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning")]
DB = 6
POOLS = [  # both serve "null": up to 128×128 pixels routes to the LTX-Video pool, larger to the Wan one
    {"name": "ltx-null", "model": "null", "family": "ltx", "max_pixels": 128 * 128, "max_frames": 33},
    {"name": "wan-null", "model": "null", "family": "wan", "max_pixels": 256 * 256},
]


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps(POOLS)}


@pytest.fixture(scope="module")
def sdk(env, run_dir, start_worker) -> Iterator[openai.OpenAI]:
    start_worker("null", env, name="videos-ltx-null", batch_size=1, extra_args=["--pool", "ltx-null"])
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-videos-family",
                   run_dir=run_dir) as api, \
            openai.OpenAI(base_url=f"{api.url}/v1", api_key="sk-not-needed", max_retries=0) as client, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield client


def test_seconds_become_the_familys_frames_clipped_to_the_pools_max_frames(sdk):
    video = sdk.videos.create(prompt="a product turning", model="null", seconds="4", size="96x64")
    extra = video.model_extra or {}
    # LTX-Video: 4 s × 25 fps → 97 frames (8k+1), over the pool's max_frames 33 → 33 (1.32 s)
    assert (extra["num_frames"], extra["fps"], video.seconds) == (33, 25, "4")
    done = sdk.videos.poll(video.id, poll_interval_ms=200)
    assert done.status == "completed" and done.size == "96x64", done.error


def test_one_second_is_the_nearest_count_of_the_rule(sdk):
    video = sdk.videos.create(prompt="a short one", model="null", seconds="1", size="64x64")
    assert ((video.model_extra or {})["num_frames"], (video.model_extra or {})["fps"]) == (25, 25)  # 25 = 8·3+1
    assert sdk.videos.poll(video.id, poll_interval_ms=200).status == "completed"


def test_what_the_family_cannot_render_is_a_bad_request_naming_the_param(sdk):
    before = [v.id for v in sdk.videos.list(limit=100).data]
    with pytest.raises(openai.BadRequestError, match="height a multiple of 32") as caught:
        sdk.videos.create(prompt="x", model="null", seconds="4", size="96x72")  # LTX-Video: multiples of 32
    assert caught.value.param == "size"
    buf = io.BytesIO()
    Image.fromarray(np.zeros((192, 192, 3), np.uint8)).save(buf, "PNG")
    with pytest.raises(openai.BadRequestError, match="no image-to-video") as caught:
        sdk.videos.create(prompt="x", model="null", seconds="4", size="192x192",  # Wan's pool: text-to-video only
                          input_reference=("first.png", buf.getvalue(), "image/png"))
    assert caught.value.param == "input_reference"
    with pytest.raises(openai.BadRequestError, match="over max_pixels") as caught:
        sdk.videos.create(prompt="x", model="null", seconds="4", size="512x512")
    assert caught.value.param == "size"
    assert [v.id for v in sdk.videos.list(limit=100).data] == before
