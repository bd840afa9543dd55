"""Storing a rendered video on the session's real SeaweedFS S3: ``store_video``'s three objects and
their metadata, written once; presigned URLs that answer HTTP range requests (206, the right bytes) and serve an
MP4 that PyAV decodes; and the whole farm path: a ``null`` worker renders a video job (9 frames at
8 fps) and the result names a decodable MP4, its poster and its preview, each fetched by its URL."""

from __future__ import annotations

import hashlib
import io
import uuid

import httpx
import pytest
from PIL import Image

from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.s3 import Storage, decode_metadata
from infra.storage.video import probe_mp4
from infra.storage.video_results import store_video
from pipeline.null import null_video
from producer import RenderClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def storage(farm_env) -> Storage:
    return Storage(Settings())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _video_request(**kw) -> RenderRequest:
    return RenderRequest(**{"prompt": "a lighthouse at dusk, waves; 灯塔", "model": "null", "width": 96,
                            "height": 64, "seed": 11, "kind": "video", "num_frames": 9, "fps": 8,
                            "output_format": "jpeg", **kw})


def test_store_video_writes_mp4_poster_and_preview_once(storage):
    request = _video_request()
    batch_id, job_id = f"vb-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    stored = store_video(storage, null_video(request), job_id=job_id, batch_id=batch_id, request=request,
                         model="null", retry_s=5, denoising_steps=20)
    result = stored.result
    assert stored.written
    assert (result.key, result.poster, result.preview) == (
        f"{batch_id}/{job_id}.mp4", f"{batch_id}/{job_id}.poster.jpg", f"{batch_id}/{job_id}.preview.webp")
    assert (result.content_type, result.width, result.height, result.num_frames, result.fps, result.duration_s) == (
        "video/mp4", 96, 64, 9, 8, 1.125)
    body = storage.get(result.key)
    assert result.bytes == len(body)
    info = probe_mp4(io.BytesIO(body))
    assert (info.codec, info.num_frames, info.fps, info.width, info.height) == ("h264", 9, 8, 96, 64)
    fields = parse_parameters(info.metadata["comment"])
    assert fields["prompt"] == request.prompt and fields["Job id"] == job_id and fields["Frames"] == "9"

    head = storage.client.head_object(Bucket=storage.bucket, Key=result.key)
    meta = head["Metadata"]
    assert head["ContentType"] == "video/mp4"
    assert (meta["job-id"], meta["batch-id"], meta["seed"], meta["model"], meta["frames"], meta["fps"],
            meta["size"], meta["steps"]) == (job_id, batch_id, "11", "null", "9", "8", "96x64", "20")
    assert decode_metadata(meta["parameters"]) == info.metadata["comment"]

    poster = storage.get(result.poster)
    assert Image.open(io.BytesIO(poster)).format == "JPEG" and read_parameters(poster) == info.metadata["comment"]
    preview = Image.open(io.BytesIO(storage.get(result.preview)))
    assert preview.format == "WEBP" and getattr(preview, "n_frames", 1) == 9

    again = store_video(storage, null_video(request), job_id=job_id, batch_id=batch_id, request=request,
                        model="null", retry_s=5, denoising_steps=20)
    assert not again.written and again.result == result and _sha(storage.get(result.key)) == _sha(body)


def test_a_presigned_mp4_url_answers_range_requests(storage):
    request = _video_request(num_frames=17, fps=12)
    batch_id, job_id = f"vb-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    result = store_video(storage, null_video(request), job_id=job_id, batch_id=batch_id, request=request,
                         model="null", retry_s=5).result
    url = storage.presigned_url(result.key)
    with httpx.Client(timeout=30) as http:
        whole = http.get(url)
        assert whole.status_code == 200 and whole.headers["content-type"] == "video/mp4"
        assert whole.headers.get("accept-ranges") == "bytes"
        body = whole.content
        assert len(body) == result.bytes
        for first, last in ((0, 99), (len(body) // 2, len(body) // 2 + 4095), (len(body) - 50, len(body) - 1)):
            part = http.get(url, headers={"Range": f"bytes={first}-{last}"})
            assert part.status_code == 206
            assert part.headers["content-range"] == f"bytes {first}-{last}/{len(body)}"
            assert part.content == body[first:last + 1]
        tail = http.get(url, headers={"Range": "bytes=-200"})  # a suffix range: the last 200 bytes
        assert tail.status_code == 206 and tail.content == body[-200:]
    info = probe_mp4(io.BytesIO(body))
    assert (info.num_frames, info.fps, info.width, info.height) == (17, 12, 96, 64)


def test_a_video_job_through_a_null_worker(start_worker, api_server, farm_env):
    start_worker("null", farm_env, name="video-null-1")
    request = RenderRequest(prompt="a video through the farm", model="null", width=64, height=64, seed=3,
                            kind="video", num_frames=9, fps=8)
    with RenderClient(api_url=farm_env["RENDERFARM_API_URL"]) as client:
        accepted = client.submit_batch([request])
        [job] = client.wait(accepted.batch_id, timeout=120)
    assert job.state == "succeeded", job.error
    result = job.result
    assert result is not None and result.url and result.poster_url and result.preview_url
    assert (result.key, result.poster, result.preview) == (
        f"{job.batch_id}/{job.job_id}.mp4", f"{job.batch_id}/{job.job_id}.poster.png",
        f"{job.batch_id}/{job.job_id}.preview.webp")
    assert (result.content_type, result.num_frames, result.fps, result.duration_s) == ("video/mp4", 9, 8, 1.125)
    mp4 = httpx.get(result.url, timeout=30)
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4" and len(mp4.content) == result.bytes
    part = httpx.get(result.url, headers={"Range": "bytes=100-1099"}, timeout=30)  # the API's URL seeks too
    assert part.status_code == 206 and part.content == mp4.content[100:1100]
    info = probe_mp4(io.BytesIO(mp4.content))
    assert (info.codec, info.num_frames, info.fps, info.width, info.height) == ("h264", 9, 8, 64, 64)
    assert parse_parameters(info.metadata["comment"])["Job id"] == job.job_id
    poster = httpx.get(result.poster_url, timeout=30)
    assert poster.headers["content-type"] == "image/png" and Image.open(io.BytesIO(poster.content)).size == (64, 64)
    preview = httpx.get(result.preview_url, timeout=30)
    assert preview.headers["content-type"] == "image/webp"
    assert getattr(Image.open(io.BytesIO(preview.content)), "n_frames", 1) == 9
