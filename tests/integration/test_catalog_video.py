"""A catalog mixing image and video items on the session farm (real API, Redis, SeaweedFS) with a
``null``-model worker of this module: the ``video`` column makes its item a video job (kind,
frames and fps as asked), and a re-run renders nothing: the video's content key, frames and fps
included, is found in the catalog index like the images'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from producer.catalog import run_catalog

pytestmark = pytest.mark.integration
SMALL = {"width": 96, "height": 64}


@pytest.fixture(scope="module")
def null_worker(start_worker, farm_env, workers):
    return start_worker("null", farm_env, batch_size=1)


def test_two_images_and_a_video_then_a_rerun_renders_nothing(client, null_worker, tmp_path):
    (tmp_path / "products.csv").write_text("id,name,video,frames,fps\nmug,a mug,,,\nlamp,a lamp,,,\n"
                                           "turn,a mug turning,yes,9,8\n", encoding="utf-8")
    template = f"{{name}} on a kitchen table, {uuid.uuid4().hex[:8]}"
    first = run_catalog(tmp_path / "products.csv", template, client=client, model="null", params=SMALL, poll_s=0.3)
    assert (first["rendered"], first["skipped"], first["failed"]) == (3, 0, 0), first["failures"]
    jobs = {m["id"]: client.job(m["job_id"]) for m in first["manifest"]}
    assert {i: j.state for i, j in jobs.items()} == {"mug": "succeeded", "lamp": "succeeded", "turn": "succeeded"}
    assert not jobs["mug"].request.is_video and not jobs["lamp"].request.is_video
    turn = jobs["turn"].request
    assert (turn.kind, turn.num_frames, turn.fps) == ("video", 9, 8)

    again = run_catalog(tmp_path / "products.csv", template, client=client, model="null", params=SMALL, poll_s=0.3)
    assert (again["rendered"], again["skipped"], again["failed"]) == (0, 3, 0), again["failures"]
    assert {m["id"]: m["job_id"] for m in again["manifest"]} == {m["id"]: m["job_id"] for m in first["manifest"]}

    # the CLI's --frames default makes every item a video unless its video column says no: the images keep
    # their keys (skipped); the video's frame count changes its key, so it alone renders again
    (tmp_path / "products.csv").write_text("id,name,video\nmug,a mug,no\nlamp,a lamp,no\nturn,a mug turning,\n",
                                           encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "infra.cli", "catalog", str(tmp_path / "products.csv"),
                           "--template", template, "--model", "null", "--width", "96", "--height", "64",
                           "--frames", "17", "--fps", "8", "--poll-interval", "0.3", "--report",
                           str(tmp_path / "third.json")], capture_output=True, text=True, timeout=600,
                          env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    third = json.loads((tmp_path / "third.json").read_text())
    assert (third["rendered"], third["skipped"], third["failed"]) == (1, 2, 0), third["failures"]
    by_id = {m["id"]: m for m in third["manifest"]}
    assert client.job(by_id["turn"]["job_id"]).request.num_frames == 17
