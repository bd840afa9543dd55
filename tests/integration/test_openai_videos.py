"""The unmodified ``openai`` SDK's ``client.videos`` on the session farm (real API, Redis, SeaweedFS)
with a ``null``-model worker of this module: create → poll → download, list, delete, an
``input_reference`` (image-to-video), and bad input refused by name as the SDK's errors."""

from __future__ import annotations

import io
import warnings

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning")]


@pytest.fixture(scope="module")
def null_worker(start_worker, farm_env, workers):
    return start_worker("null", farm_env, batch_size=1)


@pytest.fixture(scope="module")
def sdk(openai_client, null_worker):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield openai_client


@pytest.fixture(scope="module")
def done(sdk):
    """One completed 1-second 96×64 video of the null model (8 frames at 8 fps)."""
    video = sdk.videos.create(prompt="a product turning on a table", model="null", seconds="1", size="96x64")
    assert video.status in ("queued", "in_progress", "completed") and video.id.startswith("video_")
    return sdk.videos.poll(video.id, poll_interval_ms=200)


def test_create_and_poll_answers_a_completed_video_with_the_farms_frames(sdk, done):
    assert (done.status, done.progress, done.model, done.size, done.seconds) == ("completed", 100, "null", "96x64", "1")
    assert done.object == "video" and done.error is None and done.completed_at >= done.created_at
    extra = done.model_extra or {}
    assert (extra["num_frames"], extra["fps"], extra["duration_s"]) == (8, 8, 1.0)
    assert sdk.videos.retrieve(done.id).status == "completed"


def test_download_content_is_the_mp4_and_thumbnail_and_spritesheet_are_images(sdk, done):
    import av

    data = sdk.videos.download_content(done.id).content
    assert data[4:8] == b"ftyp", data[:16]
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 8 and frames[0].shape == (64, 96, 3)
    assert np.abs(frames[0].astype(int) - frames[-1].astype(int)).mean() > 1  # the null video's frames move
    poster = Image.open(io.BytesIO(sdk.videos.download_content(done.id, variant="thumbnail").content))
    assert poster.size == (96, 64)
    preview = Image.open(io.BytesIO(sdk.videos.download_content(done.id, variant="spritesheet").content))
    assert preview.format == "WEBP" and getattr(preview, "n_frames", 1) > 1  # animated


def test_list_pages_with_the_sdks_cursor(sdk, done):
    more = [sdk.videos.create(prompt=f"list {i}", model="null", seconds="1", size="96x64") for i in range(2)]
    first = sdk.videos.list(limit=2)
    assert len(first.data) == 2 and first.has_more and first.last_id == first.data[-1].id
    ids = [v.id for v in sdk.videos.list(limit=2)]  # the SDK follows last_id → after through every page
    assert ids.index(more[1].id) < ids.index(more[0].id) < ids.index(done.id) and len(ids) == len(set(ids))
    oldest_first = [v.id for v in sdk.videos.list(order="asc", limit=100).data]
    assert oldest_first.index(done.id) < oldest_first.index(more[0].id) < oldest_first.index(more[1].id)


def test_input_reference_is_stored_and_becomes_the_init_image(sdk, api_server):
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 96, 3), 200, np.uint8)).save(buf, "PNG")
    video = sdk.videos.create(prompt="from this frame", model="null", seconds="1", size="96x64",
                              input_reference=("first.png", buf.getvalue(), "image/png"))
    job = httpx.get(f"{api_server.url}/v1/jobs/{video.id.removeprefix('video_')}", timeout=30).json()
    assert job["request"]["init_image"].startswith("inputs/") and job["request"]["kind"] == "video"
    assert sdk.videos.poll(video.id, poll_interval_ms=200).status == "completed"


def test_delete_removes_the_files_and_content_then_is_404(sdk):
    # create_and_poll waits as the farm's openai-poll-after-ms header says
    video = sdk.videos.create_and_poll(prompt="to delete", model="null", seconds="1", size="96x64")
    assert video.status == "completed", video.error
    assert sdk.videos.download_content(video.id).content  # stored
    deleted = sdk.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError, match="deleted"):
        sdk.videos.download_content(video.id)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"size": "100x64"}, "size", "multiple of 8"),
    ({"size": "wide"}, "size", "WIDTHxHEIGHT"),
    ({"seconds": "0"}, "seconds", "greater than or equal to 1"),
    ({"seconds": "61"}, "seconds", "less than or equal to 60"),
    ({"extra_body": {"frame_rate": 30}}, "frame_rate", "Unrecognized"),
])
def test_bad_input_is_a_bad_request_naming_the_field_and_nothing_is_recorded(sdk, fields, param, says):
    before = [v.id for v in sdk.videos.list(limit=5).data]
    asked = {"prompt": "bad", "model": "null", "seconds": "1", "size": "96x64", **fields}
    with pytest.raises(openai.BadRequestError, match=says) as caught:
        sdk.videos.create(**asked)
    assert caught.value.param == param, caught.value.body
    assert [v.id for v in sdk.videos.list(limit=5).data] == before


def test_an_unknown_model_or_video_is_not_found(sdk):
    with pytest.raises(openai.NotFoundError, match="does not exist") as caught:
        sdk.videos.create(prompt="x", model="sora-2", seconds="4", size="720x1280")
    assert caught.value.code == "model_not_found"
    for missing in ("video_" + "0" * 32, "not-an-id"):
        with pytest.raises(openai.NotFoundError):
            sdk.videos.retrieve(missing)
