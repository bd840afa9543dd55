"""Video jobs through the Python client and the CLI on the session farm (real API, Redis,
SeaweedFS) with a ``null``-model worker of this module: ``RenderClient.submit_video`` and
``download`` (the MP4 and its poster), ``renderfarm submit --video --frames N --fps N`` and
``renderfarm download``, and bad input refused before anything is sent."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

pytestmark = pytest.mark.integration
SMALL = {"model": "null", "width": 96, "height": 64}


@pytest.fixture(scope="module")
def null_worker(start_worker, farm_env, workers):
    return start_worker("null", farm_env, batch_size=1)


@pytest.fixture(scope="module")
def video_job(client, null_worker):
    accepted = client.submit_video("a product turning on a table", num_frames=9, fps=8, seed=3, **SMALL)
    (job,) = client.wait(accepted.batch_id, timeout=300)
    return job


def _cli(farm_env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], env=farm_env | {"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=600)


def test_submit_video_records_a_video_request_that_renders(video_job):
    assert video_job.state == "succeeded", video_job.error
    request = video_job.request
    assert (request.kind, request.num_frames, request.fps, request.duration_s) == ("video", 9, 8, 9 / 8)


def test_submit_video_uploads_a_local_init_image(client, null_worker, tmp_path):
    first = tmp_path / "first.png"
    Image.fromarray(np.full((64, 96, 3), 90, np.uint8)).save(first)
    accepted = client.submit_video("from this frame", num_frames=9, init_image=first, **SMALL)
    assert client.job(accepted.job_id).request.init_image.startswith("inputs/")
    assert client.wait(accepted.batch_id, timeout=300)[0].state == "succeeded"


def test_submit_video_refuses_what_a_video_cannot_take_before_sending(client):
    with pytest.raises(ValidationError, match="a video request takes no mask_image"):
        client.submit_video("x", num_frames=9, init_image="inputs/a.png", mask_image="inputs/b.png")


def test_download_names_the_video_mp4_and_saves_its_poster(client, video_job, tmp_path):
    path = client.download(video_job.job_id, tmp_path, poster=True)
    assert path.name == f"{video_job.job_id}.mp4" and path.read_bytes()[4:8] == b"ftyp"
    (poster,) = tmp_path.glob(f"{video_job.job_id}.poster.*")
    assert Image.open(poster).size == (96, 64)


def test_cli_submits_a_video_and_wait_reports_it(api_server, null_worker, farm_env):
    sub = _cli(farm_env, "submit", "--video", "--frames", "9", "--fps", "8", "--model", "null", "--width", "96",
               "--height", "64", "a product turning on a table")
    assert sub.returncode == 0, sub.stderr
    waited = _cli(farm_env, "wait", sub.stdout.strip(), "--timeout", "300", "--json")
    assert waited.returncode == 0, waited.stderr
    (job,) = json.loads(waited.stdout)
    assert job["request"]["prompt"] == "a product turning on a table"
    assert (job["request"]["kind"], job["request"]["num_frames"], job["request"]["fps"]) == ("video", 9, 8)


def test_cli_refuses_bad_video_flags_by_name(api_server, farm_env):
    masked = _cli(farm_env, "submit", "--frames", "9", "--init-image", "inputs/a.png", "--mask", "inputs/b.png", "x")
    assert masked.returncode == 2 and "a video request takes no mask_image" in masked.stderr, masked.stderr
    zero = _cli(farm_env, "submit", "--video", "--fps", "0", "x")
    assert zero.returncode == 2 and "fps: Input should be greater than or equal to 1" in zero.stderr, zero.stderr


def test_cli_download_writes_the_mp4_and_poster(api_server, video_job, farm_env, tmp_path):
    done = _cli(farm_env, "download", video_job.batch_id, "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{video_job.job_id}.mp4", f"{video_job.job_id}.poster.png"]
    assert Image.open(io.BytesIO((tmp_path / names[1]).read_bytes())).format == "PNG"


def test_cli_status_shows_a_videos_frames_and_poster(api_server, video_job, farm_env):
    shown = _cli(farm_env, "status", video_job.job_id)
    assert shown.returncode == 0, shown.stderr
    assert f"{video_job.job_id}.mp4 96x64, 9 frames at 8 fps" in shown.stdout and "\n  poster http" in shown.stdout
