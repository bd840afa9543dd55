"""The post stage stores a video job as a video: through the real BatchRunner, null renderer,
job-state store (the session's redis-server, a database of its own) and bucket (the session's
SeaweedFS), a rendered video becomes an MP4, a poster and a preview recorded in its result,
beside an image job stored as before; a video job canceled during its upload keeps none of its
three objects; one whose bucket is unreachable goes back to the queue."""

from __future__ import annotations

import io
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state.job_store import JobStore, NewJob
from infra.storage.s3 import Storage
from infra.storage.video import probe_mp4
from infra.submission.submitter import new_id
from pipeline.null import NULL_MODEL, NullRenderer
from worker.runner import BatchRunner

DB = 14  # test_runner.py uses 6; the session farm 0


def submit(store: JobStore, prompt: str, **params) -> str:
    """Record one queued job (a batch of its own) for the null model, as submission does."""
    params = {"model": NULL_MODEL, "num_inference_steps": 4, "width": 64, "height": 64, "seed": 1, **params}
    job = NewJob(new_id(), RenderRequest(prompt=prompt, **params), NULL_MODEL)
    store.create_batch(new_id(), [job])
    return job.job_id


def messages(job_ids: Sequence[str]) -> list[SimpleNamespace]:
    """What celery-batches hands the task: one request per message, the job id in its kwargs."""
    return [SimpleNamespace(id=f"m{i}", kwargs={"job_id": j}, args=()) for i, j in enumerate(job_ids)]


def runner(store: JobStore, storage: Storage) -> BatchRunner:
    return BatchRunner(store, storage, NullRenderer(), "test-video-runner", progress_interval_s=0.0,
                       redis_retry_s=2.0)


@pytest.fixture
def store(redis_db) -> JobStore:
    return JobStore(redis_db(DB), lease_s=30.0, max_attempts=3)


@pytest.fixture
def storage(farm_env) -> Storage:
    return Storage(Settings())


def _keys(storage: Storage, batch_id: str) -> set[str]:
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=f"{batch_id}/")
    return {o["Key"] for o in listed.get("Contents", [])}


def test_a_video_job_is_stored_as_mp4_poster_and_preview(store, storage):
    video_id = submit(store, "a video", kind="video", num_frames=5, fps=4, output_format="webp")
    image_id = submit(store, "an image")
    outcome = runner(store, storage).run(messages([video_id, image_id]))
    assert outcome.succeeded == 2
    video, image = store.get_job(video_id), store.get_job(image_id)
    result = video.result
    assert result is not None and image.result is not None
    assert (result.key, result.poster, result.preview) == (
        f"{video.batch_id}/{video_id}.mp4", f"{video.batch_id}/{video_id}.poster.webp",
        f"{video.batch_id}/{video_id}.preview.webp")
    assert (result.content_type, result.num_frames, result.fps, result.duration_s) == ("video/mp4", 5, 4, 1.25)
    assert _keys(storage, video.batch_id) == {result.key, result.poster, result.preview}
    info = probe_mp4(io.BytesIO(storage.get(result.key)))
    assert (info.num_frames, info.fps, info.width, info.height) == (5, 4, 64, 64)
    # the image path as before: one PNG, no video fields
    assert image.result.content_type == "image/png" and image.result.poster is None
    assert _keys(storage, image.batch_id) == {f"{image.batch_id}/{image_id}.png"}


def test_a_video_job_canceled_during_its_upload_keeps_no_object(store, storage):
    job_id = submit(store, "canceled while uploading", kind="video", num_frames=5, fps=4)

    class CancelingStorage(Storage):
        def put_once(self, key, *args, **kwargs):
            written = super().put_once(key, *args, **kwargs)
            if key.endswith(".preview.webp"):  # the last object a video job writes
                store.cancel(job_id)
            return written

    outcome = runner(store, CancelingStorage(Settings())).run(messages([job_id]))
    assert (outcome.succeeded, outcome.dropped) == (0, 1)
    status = store.get_job(job_id)
    assert status.state == "canceled" and status.result is None
    assert _keys(storage, status.batch_id) == set()


def test_storage_away_sends_a_video_job_back_to_the_queue(store, farm_env):
    job_id = submit(store, "no bucket", kind="video", num_frames=5, fps=4)
    away = Storage(Settings(s3_endpoint_url="http://127.0.0.1:9"), max_attempts=1, connect_timeout_s=0.5)
    outcome = BatchRunner(store, away, NullRenderer(), "test-video-runner", progress_interval_s=0.0,
                          redis_retry_s=2.0, upload_retry_s=0.0).run(messages([job_id]))
    assert (outcome.succeeded, outcome.failed, outcome.requeued) == (0, 0, [job_id])
    status = store.get_job(job_id)
    assert status.state == "queued" and status.attempts == 1 and status.result is None
