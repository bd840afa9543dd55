"""The OpenAI Videos API's objects and how a farm job maps onto them (OpenAI API reference, Videos;
the ``openai`` SDK's ``openai.types.Video``, ``VideoDeleteResponse`` and its
``SyncConversationCursorPage``).

Place in the data flow: :mod:`infra.api.compat.openai_videos` (the routes) → **here**: a
``seconds`` string → the frame count and frame rate the pool's video family renders
(:func:`frames_for`); a job's :class:`~infra.schemas.JobStatus` → a :class:`Video`
(:func:`video_of`); a video id ↔ the farm's job id (:func:`video_id`, :func:`job_id_of`).

The mapping of ``seconds`` (a whole number of seconds, 1…60) to frames, at the family's default
frame rate (:data:`infra.video.VIDEO_RULES`):

- a video family (``wan``: 4k+1 frames at 16 fps; ``ltx``: 8k+1 at 25 fps): the allowed frame
  count closest to ``seconds × fps`` (ties round up), clipped to the largest allowed count within
  the pool's ``max_frames`` (else the family's). E.g. Wan: 4 s → 65 frames (4.06 s), 8 s → 81
  (5.06 s, the family's limit); LTX-Video: 4 s → 97 (3.88 s), 8 s → 201 (8.04 s), 12 s → 257 (10.28 s).
- no known family (the farm's offline ``null`` model, or a model the pools do not classify):
  ``seconds × 8`` frames at 8 fps (the null renderer's frame rate), at most 1,025 frames.

The answer keeps the asked ``seconds`` (what the client compares) and adds the farm's own
``num_frames``, ``fps`` and ``duration_s`` (the rendered length) beside OpenAI's fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from infra.schemas import JobStatus
from infra.video import MAX_FRAMES, VIDEO_RULES

#: A video id is the farm's job id with this prefix (OpenAI's ids read ``video_…``).
VIDEO_ID_PREFIX = "video_"
#: ``metadata["api"]`` of the jobs this API submits (how the list finds them).
API_TAG = "openai.videos"
#: Frame rate of a video whose family is unknown: the null renderer's (``pipeline.null``).
FALLBACK_FPS = 8
#: ``seconds`` a request may ask for (the SDK's enum is 4, 8 and 12; any whole number in range is taken).
MIN_SECONDS, MAX_SECONDS = 1, 60
#: Job state → OpenAI's ``status`` (a canceled job reads as failed, with error code ``canceled``).
STATUS_OF = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
             "canceled": "failed"}


def video_id(job_id: str) -> str:
    """The video id of a farm job id (``video_<32 hex>``)."""
    return VIDEO_ID_PREFIX + job_id


def job_id_of(video: str) -> str:
    """The farm job id a video id names; the input unchanged when it lacks the prefix (the route
    then answers 404 for an id that is not a job id)."""
    return video[len(VIDEO_ID_PREFIX):] if video.startswith(VIDEO_ID_PREFIX) else video


def frames_for(seconds: int, family: str | None, max_frames: int | None = None) -> tuple[int, int]:
    """``(num_frames, fps)`` for a clip of ``seconds`` seconds by a pool of ``family`` whose limit
    is ``max_frames`` (None: the family's); see the module docstring for the rule."""
    rules = VIDEO_RULES.get(family or "")
    if rules is None:
        return max(1, min(seconds * FALLBACK_FPS, MAX_FRAMES)), FALLBACK_FPS
    step, target = rules.frame_step, seconds * rules.default_fps
    frames = int((target - 1) / step + 0.5) * step + 1
    limit = min(max_frames or rules.max_frames, MAX_FRAMES)
    if frames > limit:
        frames = (limit - 1) // step * step + 1
    return max(1, frames), rules.default_fps


class VideoError(BaseModel):
    """Why a video failed: ``code`` (``generation_failed``, ``canceled``) and ``message``."""

    code: str
    message: str


class Video(BaseModel):
    """OpenAI's ``Video`` object (OpenAI API reference, Videos: "The video object"), with the
    farm's ``num_frames``, ``fps`` and ``duration_s`` (seconds) beside it. Times are Unix seconds;
    ``progress`` is 0…100; ``size`` is ``"WIDTHxHEIGHT"`` in pixels."""

    id: str = Field(description="video_<job id>: the farm's job id, prefixed.")
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(ge=0, le=100, description="Percent of the denoising steps done.")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str | None = None
    seconds: str = Field(description="The asked duration, as sent.")
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    num_frames: int | None = Field(None, description="Frames rendered (the farm's; see the seconds mapping).")
    fps: int | None = Field(None, description="Frames per second of the MP4.")
    duration_s: float | None = Field(None, description="num_frames / fps: the rendered length, seconds.")


class VideoList(BaseModel):
    """A page of ``GET /v1/videos`` (the SDK's ``SyncConversationCursorPage``): ``last_id`` is the
    ``after`` of the next page; ``has_more`` whether one follows."""

    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    """Answer of ``DELETE /v1/videos/{id}`` (OpenAI's ``VideoDeleteResponse``)."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


def video_of(status: JobStatus) -> Video:
    """The :class:`Video` of a job this API submitted (its request carries the asked
    ``seconds`` in ``metadata``). Raises ``ValueError`` for a job without its request."""
    request = status.request
    if request is None:
        raise ValueError(f"job {status.job_id} has no recorded request")
    state = STATUS_OF[status.state]
    error = None
    if status.state == "canceled":
        error = VideoError(code="canceled", message="the video was canceled before it finished")
    elif status.state == "failed":
        reason = f"{status.error.type}: {status.error.message}" if status.error else "the job failed"
        error = VideoError(code="generation_failed", message=reason)
    finished = status.finished_at if status.state in ("succeeded", "failed", "canceled") else None
    frames, fps = request.num_frames, request.fps
    return Video(
        id=video_id(status.job_id), status=state, progress=100 if state == "completed" else int(status.progress * 100),
        created_at=int(status.created_at.timestamp()),
        completed_at=int(finished.timestamp()) if finished else None, model=request.model or "",
        prompt=request.prompt, seconds=request.metadata.get("seconds", str(request.duration_s or "")),
        size=f"{request.width}x{request.height}", error=error, num_frames=frames, fps=fps,
        duration_s=round(frames / fps, 3) if frames and fps else None)
