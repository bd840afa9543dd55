"""The post stage: each rendered group is encoded, uploaded and recorded; each batch's end is
recorded (metrics, requeues, its jobs no longer held).

Place in the data flow: render stage (:mod:`worker.render_stage`) → hand-off
(:mod:`worker.handoff`) → **post stage** (the post thread; the calling thread when not
overlapped) → storage (``store_image``, or ``store_video`` for a video; write-once) → job-state
store (``succeed_many``) → the batch's outcome, taken by the worker's consumer for its circuit breaker.

- Just before a group's upload, who is still ours: a job canceled or taken over (its lease ran
  out) while it rendered is dropped, and no object is written for it. The upload itself is
  write-once (:meth:`infra.storage.s3.Storage.put_once`) and every write is fenced by the
  attempt; a job canceled during its upload loses its objects again (image and control maps, or
  a video's MP4, poster and preview).
- A failed upload or state write fails the attempt, not the job (:mod:`worker.attempts`): it
  goes back to the queue until its attempts are spent.
- At the batch's end its jobs leave the held set (the heartbeat stops renewing their leases),
  the requeued ones are republished, and the batch's figures go to the farm metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

from infra.state import metrics
from infra.state.job_store import HELD, JobStore, StartedJob
from infra.storage.results import StoredImage, store_image
from infra.storage.s3 import Storage
from infra.storage.video_results import store_video
from infra.video import frames_of
from worker.attempts import AttemptRecorder
from worker.batch import BatchOutcome, BatchWork, HeldJobs
from worker.handoff import BatchEnd, RenderedGroup
from worker.render_stage import Renderer

log = logging.getLogger("renderfarm.worker")


class PostStage:
    """Stores rendered groups and records finished batches for one worker.

    Args:
        store: job-state store. storage: image bucket. renderer: names the model, the scheduler
            and the LoRA hashes in each image's infotext.
        attempts: records the jobs whose upload or state write failed.
        held: the jobs this worker holds (its batches' jobs leave it at their end).
        worker_name: recorded with the batch metrics.
        upload_retry_s: how long an upload rides out a storage outage, seconds.
        upload_threads: jobs of a group encoded, uploaded and recorded at once (1 = in turn).
        on_requeued: called with the ids of jobs put back to ``queued`` (to republish them).
        on_written: called with each job whose object this attempt really wrote (a test counter).
    """

    def __init__(self, store: JobStore, storage: Storage, renderer: Renderer, attempts: AttemptRecorder,
                 held: HeldJobs, worker_name: str, *, upload_retry_s: float, upload_threads: int,
                 on_requeued: Callable[[list[str]], object], on_written: Callable[[str], None]):
        self.store, self.storage, self.renderer, self.attempts = store, storage, renderer, attempts
        self.held, self.worker_name = held, worker_name
        self.upload_retry_s, self.upload_threads = upload_retry_s, upload_threads
        self.on_requeued, self.on_written = on_requeued, on_written
        self.images_done = 0
        self.timing = {"batches": 0, "jobs": 0, "total_s": 0.0, "render_s": 0.0}  # see _account
        self._uploads: ThreadPoolExecutor | None = None  # created at the first group of two or more
        self._lock = threading.Lock()
        self._done: list[BatchOutcome] = []

    def handle(self, item: RenderedGroup | BatchEnd) -> None:
        """Store a rendered group, or record a batch's end (every group before it is stored)."""
        if isinstance(item, BatchEnd):
            self._finish(item.work)
        else:
            self._store_group(item)

    def take_done(self) -> list[BatchOutcome]:
        """The outcomes of the batches recorded since the last call (each returned once); thread-safe."""
        with self._lock:
            done, self._done = self._done, []
        return done

    # ---- a rendered group: who is still ours, encode, upload, record ---------------------------
    def _store_group(self, group: RenderedGroup) -> None:
        """Who is still ours, just before upload (cancellation and takeover), then store them."""
        outcome = group.work.outcome
        held = self.attempts.redis(self.store.renew_leases, group.jobs, rendered=True)
        kept = []
        for job, image in zip(group.jobs, group.images, strict=True):
            if held.get(job.job_id) != HELD:
                log.info("job %s attempt %d was canceled or taken over; its image is discarded",
                         job.job_id, job.attempt)
                outcome.dropped += 1
                continue
            kept.append((job, image))
        self._store_all(kept, outcome, group.steps)

    def _store_all(self, kept: list[tuple[StartedJob, Image.Image]], outcome: BatchOutcome, steps: int) -> None:
        """Encode and upload each job's image, ``upload_threads`` jobs at a time (Pillow's encoders
        and the S3 PUT release the GIL; the storage client is thread-safe, on one connection pool
        sized to these threads), then record the group's successes in one pipelined round trip
        (:meth:`infra.state.job_store.JobStore.succeed_many`)."""
        def upload(pair: tuple[StartedJob, Image.Image]) -> StoredImage | Exception:
            job, image = pair
            try:
                return self._upload(job, image, steps)
            except Exception as exc:
                return exc

        if len(kept) > 1 and self.upload_threads > 1:
            if self._uploads is None:
                self._uploads = ThreadPoolExecutor(self.upload_threads, thread_name_prefix="upload")
            uploaded = list(self._uploads.map(upload, kept))
        else:
            uploaded = [upload(pair) for pair in kept]
        stored = []
        for (job, _), result in zip(kept, uploaded, strict=True):
            if isinstance(result, BaseException):
                self.attempts.fail(job, result, outcome)
            else:
                stored.append((job, result))
        if not stored:
            return
        try:
            recorded = self.attempts.redis(self.store.succeed_many, [(job, s.result) for job, s in stored])
        except Exception as exc:  # Redis away past redis_retry_s: the attempts fail (and retry)
            for job, _ in stored:
                self.attempts.fail(job, exc, outcome)
            return
        for job, result in stored:
            if recorded.get(job.job_id):
                with self._lock:
                    self.images_done += 1
                outcome.succeeded += 1
            else:
                self._stale_result(job, result, outcome)

    def _upload(self, job: StartedJob, image: Image.Image, steps: int) -> StoredImage:
        name_of = getattr(self.renderer, "scheduler_name", None)
        scheduler = name_of(job.request.scheduler) if name_of is not None else job.request.scheduler
        if frames_of(image) is not None:  # a video: MP4, poster and preview (infra.storage.video_results)
            stored = store_video(self.storage, image, job_id=job.job_id, batch_id=job.batch_id, request=job.request,
                                 model=self.renderer.model, retry_s=self.upload_retry_s, scheduler=scheduler,
                                 denoising_steps=steps)
        else:
            stored = store_image(self.storage, image, job_id=job.job_id, batch_id=job.batch_id,
                                 request=job.request, model=self.renderer.model, retry_s=self.upload_retry_s,
                                 scheduler=scheduler, denoising_steps=steps,
                                 lora_hashes=getattr(self.renderer, "lora_hashes", lambda request: None)(job.request))
        if stored.written:
            self.on_written(job.job_id)
        return stored

    def _stale_result(self, job: StartedJob, stored: StoredImage, outcome: BatchOutcome) -> None:
        """The attempt no longer held the job when its success was recorded."""
        outcome.dropped += 1
        status = self.attempts.redis(self.store.get_job, job.job_id)
        if stored.written and status is not None and status.state == "canceled":
            # canceled between the pre-upload check and now: a canceled job keeps no object, nor
            # the control maps stored beside its image, nor a video's poster and preview
            result = stored.result
            extra = [key for key in (result.poster, result.preview) if key is not None]
            for key in (result.key, *(result.control_maps or ()), *extra):
                self.storage.delete(key)
            log.info("job %s was canceled during its upload; its objects removed", job.job_id)
        else:
            log.warning("job %s attempt %d is stale; its result was not recorded", job.job_id, job.attempt)

    # ---- the batch's end: one outcome, requeues, metrics ---------------------------------------
    def _finish(self, work: BatchWork) -> None:
        """Merge the render stage's outcome into the post stage's, release the batch's jobs from
        the held set, republish the requeued ones, record the batch's metrics."""
        outcome, rendering = work.outcome, work.rendering
        outcome.failed += rendering.failed
        outcome.dropped += rendering.dropped
        outcome.requeued.extend(rendering.requeued)
        outcome.renders.extend(rendering.renders)
        outcome.job_ids = list(work.job_ids)
        self.held.remove(work.jobs)
        outcome.infrastructure = outcome.infrastructure or rendering.infrastructure
        if outcome.requeued:
            try:
                self.on_requeued(outcome.requeued)
            except Exception as exc:  # the reaper republishes what stays queued without a message
                log.warning("could not republish %d requeued job(s): %s", len(outcome.requeued), exc)
        batch_s = time.perf_counter() - work.started
        metrics.record_batch(self.store.r, [j.job_id for j in work.jobs], worker=self.worker_name,
                             renders=outcome.renders, succeeded=outcome.succeeded, failed=outcome.failed,
                             batch_seconds=batch_s)
        self._account(len(work.job_ids), batch_s, outcome)
        with self._lock:
            self._done.append(outcome)

    def _account(self, jobs: int, total_s: float, outcome: BatchOutcome) -> None:
        """Worker time of one batch, in seconds: whole (start, render, encode, upload, state writes,
        metrics) vs. inside the pipeline calls. Summed in ``self.timing`` and logged as a
        ``batch timing:`` line for people; programs read the same figures from the farm metrics
        (``renderfarm_batch_seconds`` and ``renderfarm_render_seconds_per_image``)."""
        render_s = sum(seconds for _, seconds in outcome.renders)
        for key, value in (("batches", 1), ("jobs", jobs), ("total_s", total_s), ("render_s", render_s)):
            self.timing[key] += value
        log.info("batch timing: %d job(s) in %.4fs, render %.4fs, overhead %.3f ms/job", jobs, total_s, render_s,
                 1000 * (total_s - render_s) / max(jobs, 1))
