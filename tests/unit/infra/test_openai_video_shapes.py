"""``seconds`` → frames for each video family (the documented mapping), and a video id ↔ job id."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from infra.api.compat.openai_video_shapes import FALLBACK_FPS, frames_for, job_id_of, video_id, video_of
from infra.schemas import JobError, JobStatus, RenderRequest
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


def _status(state: str, progress: float = 0.0, **extra) -> JobStatus:
    request = RenderRequest(prompt="a mug turning", model="ltx-video", width=704, height=480, kind="video",
                            num_frames=97, fps=25, metadata={"api": "openai.videos", "seconds": "4"})
    created = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
    return JobStatus(job_id="ab" * 16, batch_id="cd" * 16, state=state, progress=progress, created_at=created,
                     request=request, **extra)


@pytest.mark.parametrize(("state", "progress", "status", "percent", "code"), [
    ("queued", 0.0, "queued", 0, None),
    ("running", 0.42, "in_progress", 42, None),
    ("succeeded", 1.0, "completed", 100, None),
    ("failed", 0.3, "failed", 30, "generation_failed"),
    ("canceled", 0.1, "failed", 10, "canceled"),
])
def test_a_jobs_state_is_the_videos_status(state, progress, status, percent, code):
    finished = datetime(2026, 12, 7, 12, 1, tzinfo=timezone.utc) if state in ("succeeded", "failed", "canceled") \
        else None
    error = JobError(type="RuntimeError", message="out of memory") if state == "failed" else None
    video = video_of(_status(state, progress, finished_at=finished, error=error))
    assert (video.status, video.progress, video.error.code if video.error else None) == (status, percent, code)
    assert video.completed_at == (int(finished.timestamp()) if finished else None)
    assert (video.id, video.seconds, video.size, video.num_frames, video.fps, video.duration_s) == (
        "video_" + "ab" * 16, "4", "704x480", 97, 25, 3.88)
    if state == "failed":
        assert "RuntimeError: out of memory" in video.error.message
