"""Video jobs on real processes: a status API with an image pool (``tiny``) and two video pools
(``tiny-wan``: Wan's 4k+1 frames, no image-to-video, ``max_frames`` 17; ``tiny-ltx``: LTX-Video's
8k+1 frames, image-to-video), on its own Redis database of the session's redis-server.

- Bad input: each request a video pool cannot render is a 4xx naming the field and the rule,
  and nothing is recorded (no job record, nothing in a lane or a queue). The table of cases is
  printed (``pytest -s``) for the docs.
- A mixed run: images and videos in one batch, a worker per pool, every job succeeded once; each
  video is an H.264 MP4 of the asked frames and rate with its poster and preview.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import av
import httpx
import pytest
from PIL import Image

from infra.broker.dispatch import broker_depth
from infra.broker.lanes import backlog
from infra.localstack import ApiServer, WorkerProcess, free_port, start_workers

pytestmark = pytest.mark.integration

DB = 9
POOLS = [
    {"name": "images", "model": "tiny", "max_pixels": 128 * 128},
    {"name": "wan", "model": "tiny-wan", "max_pixels": 128 * 128, "max_frames": 17},
    {"name": "ltx", "model": "tiny-ltx", "max_pixels": 128 * 128},
]
WAN = {"prompt": "a lamp on a desk, the camera circling", "model": "tiny-wan", "width": 64, "height": 64,
       "num_inference_steps": 2, "num_frames": 9, "fps": 8}


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_POOLS": json.dumps(POOLS),
            "RENDERFARM_HEARTBEAT_INTERVAL_S": "0.5"}


@pytest.fixture(scope="module")
def r(redis_server, env):
    client = redis_server.client(DB)
    yield client
    client.flushdb()


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-video", run_dir=run_dir) as s:
        yield s


def _farm_state(r) -> tuple:
    jobs = sum(1 for _ in r.scan_iter(match="rf:job:*", count=1000))
    return jobs, sum(n for n, _ in backlog(r).values()), sum(broker_depth(r, p["name"]) for p in POOLS)


@pytest.fixture(scope="module")
def init_key(api) -> str:
    """An uploaded product photo (``POST /v1/uploads``), for image-to-video requests."""
    body = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 120, 40)).save(body, format="PNG")
    response = httpx.post(f"{api.url}/v1/uploads", files={"file": ("photo.png", body.getvalue(), "image/png")})
    assert response.status_code in (200, 201), response.text
    return response.json()["key"]


#: (case, request fields over WAN's, expected status, field, error type). ``{init}``: the upload's key.
BAD = [
    ("frames over the pool's max_frames (17)", {"num_frames": 21}, 422, "num_frames", "over_max_frames"),
    ("a frame count Wan cannot take (not 4k+1)", {"num_frames": 10}, 422, "num_frames", "frames_rule"),
    ("fps 0", {"fps": 0}, 422, "fps", "greater_than_equal"),
    ("fps 61 (over 60)", {"fps": 61}, 422, "fps", "less_than_equal"),
    ("num_frames 0", {"num_frames": 0}, 422, "num_frames", "greater_than_equal"),
    ("an init image for Wan T2V (no image-to-video)", {"init_image": "{init}"}, 422, "init_image",
     "no_image_to_video"),
    ("a size Wan cannot take (72: not a multiple of 16)", {"width": 72}, 422, "width", "size_not_multiple"),
    ("a mask on a video", {"init_image": "{init}", "mask_image": "{init}", "model": "tiny-ltx", "num_frames": 9},
     422, None, "value_error"),
    ("strength on a video", {"model": "tiny-ltx", "init_image": "{init}", "strength": 0.5, "num_frames": 9}, 422,
     None, "value_error"),
    ("a video of an image model", {"model": "tiny"}, 422, "kind", "not_a_video_model"),
    ("an image of a video model (kind image)", {"kind": "image", "num_frames": None, "fps": None}, 422, "kind",
     "video_model"),
    ("video fields on an image request", {"kind": "image", "model": "tiny"}, 422, None, "value_error"),
    ("frames over LTX-Video's max_frames (257, its pool declares none)", {"model": "tiny-ltx", "num_frames": 265},
     422, "num_frames", "over_max_frames"),
]


def _body(fields: dict, init: str) -> dict:
    body = {**WAN, **fields}
    body = {k: (init if v == "{init}" else v) for k, v in body.items() if v is not None}
    return body


def test_bad_video_requests_are_4xx_naming_the_field_and_nothing_is_recorded(api, r, init_key):
    before = _farm_state(r)
    rows = []
    for case, fields, status, field, kind in BAD:
        response = httpx.post(f"{api.url}/v1/jobs", json=_body(fields, init_key), timeout=30)
        detail = response.json()["detail"]
        first = detail[0] if isinstance(detail, list) else {"msg": str(detail), "loc": [], "type": ""}
        rows.append(f"| {case} | {response.status_code} | {first['type']} | {first['msg'][:110]} |")
        assert response.status_code == status, (case, response.text)
        assert first["type"] == kind, (case, first)
        if field is not None:
            assert first["loc"][-1] == field, (case, first)
    assert _farm_state(r) == before, "a refused request records nothing"
    print("\n| case | status | type | message |\n|---|---:|---|---|\n" + "\n".join(rows))


def test_a_video_request_without_frames_gets_its_familys_defaults(api, r):
    accepted = httpx.post(f"{api.url}/v1/jobs", json={"prompt": "a cup", "model": "tiny-ltx", "width": 64,
                                                      "height": 64}).json()
    request = httpx.get(f"{api.url}/v1/jobs/{accepted['job_id']}").json()["request"]
    assert (request["kind"], request["num_frames"], request["fps"]) == ("video", 121, 25)
    httpx.delete(f"{api.url}/v1/jobs/{accepted['job_id']}")


@pytest.fixture(scope="module")
def workers(api, env, run_dir) -> Iterator[list[WorkerProcess]]:
    procs = [WorkerProcess(model, env, f"video-{pool}", 2 if pool == "images" else 1, extra_args=["--pool", pool],
                           run_dir=run_dir)
             for pool, model in (("images", "tiny"), ("wan", "tiny-wan"), ("ltx", "tiny-ltx"))]
    try:
        start_workers(procs)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def test_a_mixed_run_of_images_and_videos_succeeds_once_each(api, workers, init_key):
    client = httpx.Client(base_url=api.url, timeout=60)
    jobs = [{"prompt": f"a product photo {i}", "model": "tiny", "width": 64, "height": 64, "num_inference_steps": 2,
             "seed": i} for i in range(4)]
    jobs += [{**WAN, "seed": 7}, {**WAN, "model": "tiny-ltx", "init_image": init_key, "seed": 8, "fps": 12}]
    accepted = client.post("/v1/batches", json={"jobs": jobs}).json()
    done = _wait(client, accepted["batch_id"])
    assert done["counts"]["succeeded"] == 6, done["counts"]
    for job_id in accepted["job_ids"]:
        status = client.get(f"/v1/jobs/{job_id}").json()
        assert status["attempts"] == 1, status
        result = status["result"]
        if status["request"].get("kind") != "video":
            assert result["content_type"] == "image/png" and "poster" not in result
            continue
        assert result["content_type"] == "video/mp4" and result["key"].endswith(".mp4")
        body = httpx.get(result["url"], timeout=60).content
        with av.open(io.BytesIO(body)) as container:
            stream = container.streams.video[0]
            frames = sum(1 for _ in container.decode(stream))
            assert stream.codec_context.name == "h264" and (stream.width, stream.height) == (64, 64)
        fps = status["request"]["fps"]
        assert frames == result["num_frames"] == 9 and result["fps"] == fps
        assert result["duration_s"] == pytest.approx(9 / fps)
        assert httpx.get(result["poster_url"], timeout=30).status_code == 200
        assert Image.open(io.BytesIO(httpx.get(result["preview_url"], timeout=30).content)).n_frames > 1


def _wait(client: httpx.Client, batch_id: str, timeout: float = 600) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/batches/{batch_id}", params={"limit": 0}).json()
        if status["done"]:
            return status
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not done after {timeout}s: {status['counts']}")
