"""``seconds`` → frames for each video family (the documented mapping), and a video id ↔ job id."""

from __future__ import annotations

import pytest

from infra.api.compat.openai_video_shapes import FALLBACK_FPS, frames_for, job_id_of, video_id
from infra.video import VIDEO_RULES
from pipeline.null import NULL_VIDEO_FPS


@pytest.mark.parametrize(("seconds", "family", "max_frames", "expected"), [
    (4, "wan", None, (65, 16)),     # 64 wanted: 4k+1 → 65
    (8, "wan", None, (81, 16)),     # 128 wanted: over Wan's 81
    (1, "wan", None, (17, 16)),
    (4, "ltx", None, (97, 25)),     # 100 wanted: 97 (3.88 s) is nearer than 105
    (8, "ltx", None, (201, 25)),
    (12, "ltx", None, (257, 25)),   # 300 wanted: LTX-Video's 257
    (8, "ltx", 129, (129, 25)),     # the pool's max_frames
    (8, "ltx", 130, (129, 25)),     # clipped to the largest 8k+1 within it
    (4, None, None, (32, 8)),       # no family: seconds × the null renderer's fps
    (60, None, None, (480, 8)),
])
def test_frames_for_is_the_nearest_count_the_family_allows(seconds, family, max_frames, expected):
    frames, fps = frames_for(seconds, family, max_frames)
    assert (frames, fps) == expected
    rules = VIDEO_RULES.get(family or "")
    if rules is not None:
        assert rules.frames_ok(frames)


def test_the_fallback_rate_is_the_null_renderers():
    assert FALLBACK_FPS == NULL_VIDEO_FPS


def test_video_ids_map_back_to_job_ids():
    job = "0f" * 16
    assert video_id(job) == f"video_{job}" and job_id_of(video_id(job)) == job
    assert job_id_of("not-an-id") == "not-an-id"
