"""``/v1/gallery``: a tenant's most recent images and videos, with presigned URLs, for the dashboard's gallery.

Place in the data flow: job-state store (the tenant's recent batches and their succeeded jobs)
and the bucket (presigned GET URLs; one image's embedded infotext) → **here** → the dashboard,
which shows the images as thumbnails straight from S3 (its Content-Security-Policy allows the
bucket's origin in ``img-src``) and, on a click, the full-size image with its parameters. A
video shows as its animated WebP preview and plays in the viewer from its MP4's presigned URL
(``media-src``), seeking by range requests.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from infra.api.deps import FarmDep, Tenant, not_found, require_id
from infra.schemas import JobResult, JobStatus
from infra.storage.images import read_parameters

router = APIRouter(prefix="/v1/gallery", tags=["gallery"])

#: Recent batches looked through for images, newest first.
SCANNED_BATCHES = 20


class GalleryImage(BaseModel):
    """One rendered image: where to fetch it (``url``, a presigned GET), its size in pixels, and
    the request that made it. ``parameters`` (the A1111 infotext embedded in the image, naming
    the real scheduler) only in ``GET /v1/gallery/{job_id}``."""

    job_id: str
    batch_id: str
    url: str
    width: int
    height: int
    content_type: str
    finished_at: datetime | None = None
    prompt: str = ""
    negative_prompt: str = ""
    model: str | None = None
    seed: int
    steps: int | None = None
    guidance_scale: float | None = None
    parameters: str | None = None
    kind: str = Field("image", description="image, or video (url is then the MP4's, which answers range requests).")
    poster_url: str | None = Field(None, description="A video's poster frame (presigned GET).")
    preview_url: str | None = Field(None, description="A video's animated WebP preview (presigned GET).")
    num_frames: int | None = None
    fps: int | None = None
    duration_s: float | None = Field(None, description="A video's length, seconds.")


class GalleryPage(BaseModel):
    """The tenant's newest images first (from its newest batches)."""

    images: list[GalleryImage]


def _image(farm, job: JobStatus, result: JobResult) -> GalleryImage:
    request = job.request
    return GalleryImage(
        job_id=job.job_id, batch_id=job.batch_id, url=farm.storage.presigned_url(result.key),
        width=result.width, height=result.height, content_type=result.content_type,
        finished_at=job.finished_at, seed=result.seed, prompt=request.prompt if request else "",
        negative_prompt=request.negative_prompt if request else "", model=request.model if request else None,
        steps=request.num_inference_steps if request else None,
        guidance_scale=request.guidance_scale if request else None,
        **({} if result.poster is None else {
            "kind": "video", "poster_url": farm.storage.presigned_url(result.poster),
            "preview_url": farm.storage.presigned_url(result.preview) if result.preview else None,
            "num_frames": result.num_frames, "fps": result.fps, "duration_s": result.duration_s}))


@router.get("", response_model=GalleryPage)
def recent_images(farm: FarmDep, tenant: Tenant, limit: int = Query(24, ge=1, le=200)) -> GalleryPage:
    """Up to ``limit`` of this tenant's most recently finished images, newest first, from its
    newest batches (the last ``limit`` jobs of each), with presigned URLs."""
    found: list[JobStatus] = []
    for batch in farm.store.recent_batches(tenant, limit=SCANNED_BATCHES):
        if not batch.counts.get("succeeded"):
            continue
        start = max(0, batch.total - limit)
        ids = farm.store.batch_job_ids(batch.batch_id, offset=start, limit=limit)
        found.extend(j for j in farm.store.get_jobs(ids) if j is not None and j.state == "succeeded" and j.result)
        if len(found) >= limit:
            break
    found.sort(key=lambda j: j.finished_at or j.created_at, reverse=True)
    return GalleryPage(images=[_image(farm, j, j.result) for j in found[:limit] if j.result is not None])


@router.get("/{job_id}", response_model=GalleryImage)
def image(job_id: str, farm: FarmDep, tenant: Tenant) -> GalleryImage:
    """One image (or video) with the ``parameters`` embedded in it (a video's, in its poster).
    404 for an unknown id or a job without a result."""
    job = farm.store.get_job(require_id(job_id, "job"), tenant)
    if job is None or job.state != "succeeded" or job.result is None:
        raise not_found("job")
    out = _image(farm, job, job.result)
    # a video's parameters are in its poster (an image file): never read the whole MP4 for them
    out.parameters = read_parameters(farm.storage.get(job.result.poster or job.result.key))
    return out
