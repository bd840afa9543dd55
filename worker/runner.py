"""One worker's handling of a pulled batch: start → group → render → encode → upload → finish.

Data flow: queue (celery-batches hands over up to ``batch_size`` messages) → **here** → pipeline
(one call per compatibility group) → storage → job-state store.

Guarantees:
- A failure inside one job never fails the others: a group that raises is bisected until only
  the failing job is left, and that job alone is marked failed with its error (type, message).
- An out-of-memory error splits the group the same way (the halves render after the ``except``
  block, so the failed batch's tensors are released first) and lowers the batch size for that
  shape only (``pipeline.memory.BatchLimits``, keyed by the compat key), which rises back after
  successes; other shapes keep the worker's batch size. A VAE decode that alone runs out of
  memory never reaches here: the renderer decodes that batch one image at a time.
- Every write after start carries the attempt number, so a stale attempt changes nothing; a
  job this attempt no longer holds (canceled, or taken over after its lease ran out) is
  discarded before upload, and the upload itself is write-once (:meth:`infra.storage.s3.Storage.put_once`).
- Cancellation reaches a running job between denoising steps: each progress write answers,
  per job, whether this attempt still holds it. When no job of the group is held any more,
  the step callback raises :class:`GroupAbandoned` and the group stops at once. When only
  some are canceled, the group renders on (the others share the same denoising loop, and
  stopping it would cost them their work) and the canceled jobs' images are dropped: their
  state stays ``canceled`` and no object is written.
- A render taking longer than ``job_timeout_s`` stops at its next step with ``TimeoutError``;
  the group is split in halves, each with a fresh deadline (a slow request among fast ones
  leaves them their time), and a job that alone still times out fails with the timeout.
- Transient errors (storage or Redis away, out of memory on a single job) fail the attempt,
  not the job: it goes back to the queue until its attempts are spent. Job-state writes ride
  out a Redis restart by retrying for ``redis_retry_s`` seconds.
- Errors of this worker's infrastructure (:mod:`worker.errors`: S3 credentials, a broken
  device) never fail a job for good: credential errors release it without spending an attempt,
  device errors spend one; the batch's outcome says so (``infrastructure``), the worker opens
  its breaker at once, and its groups not yet rendered are released unrendered.
- Bisection across attempts: each group's size is recorded on its jobs as it starts rendering;
  jobs a lost worker held come back as suspects and render in halves (``worker.batch``). A
  render watchdog (``worker.watchdog``), when given, sees each render start, step and end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import redis
from PIL import Image

from infra.schemas import JobError, RenderRequest
from infra.state import metrics
from infra.state.job_store import HELD, JobStore, StartedJob
from infra.storage.results import StoredImage, store_image
from infra.storage.s3 import Storage
from pipeline.compat import compat_key
from pipeline.memory import BatchLimits, is_oom_error
from worker.batch import BatchOutcome, BatchWork, PostItem, job_ids_from_messages, render_groups
from worker.errors import CREDENTIALS, DEVICE, REQUEST, TRANSIENT, classify
from worker.watchdog import RenderWatchdog

log = logging.getLogger("renderfarm.worker")


class Renderer(Protocol):
    """What the runner needs of a renderer (``pipeline.Renderer``, or the null renderer). One that
    also has ``scheduler_name(requested) -> str`` names the scheduler in each image's infotext."""

    model: str

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]: ...


class GroupAbandoned(Exception):
    """Raised from the step callback when no job of the group is held by this attempt any more
    (all canceled, or taken over): the render stops between two denoising steps."""


class BatchRunner:
    """Renders pulled batches for one worker.

    Args:
        store: job-state store. storage: image bucket. renderer: the warm pipeline.
        worker_name: recorded on each job it runs.
        progress_interval_s: least seconds between progress writes of one group.
        job_timeout_s: longest a group's render may take, seconds.
        upload_retry_s: how long an upload rides out a storage outage, seconds.
        redis_retry_s: how long a job-state write rides out a Redis outage, seconds.
        on_requeued: called with the ids of jobs put back to ``queued`` (to republish them).
        on_rendered / on_written: test counters (``worker.faults``): job ids rendered, and each
            job whose object this attempt really wrote.
        upload_threads: jobs of a group encoded, uploaded and recorded at once (1 = in turn).
        pending_groups: rendered groups that may wait for post-processing in
            :meth:`run_overlapped` before the renderer blocks (the bound on held images).
        watchdog: told of each render's start, steps and end (:mod:`worker.watchdog`), or None.

    Two ways to run a batch: :meth:`run` does it all in the calling thread; :meth:`run_overlapped`
    starts the jobs in the calling thread, renders in a render thread and leaves encoding, upload
    and the state writes to one post-processing thread (each fed through a bounded queue, in
    order), so that the device renders the next group while the last one is stored, and Celery's
    consumer acks and receives messages meanwhile. The guarantees are the same: the lease check
    that drops canceled or taken-over jobs runs just before each group's upload, uploads are
    write-once and every write is fenced by the attempt; jobs stay in :meth:`current_jobs` (their
    leases renewed by the heartbeat) until their group is recorded. :meth:`drain` waits for the
    post-processing to finish (a warm shutdown).
    """

    def __init__(self, store: JobStore, storage: Storage, renderer: Renderer, worker_name: str, *,
                 progress_interval_s: float = 0.2,
                 job_timeout_s: float = 600.0, upload_retry_s: float = 60.0, redis_retry_s: float = 30.0,
                 on_requeued: Callable[[list[str]], object] | None = None,
                 on_rendered: Callable[[list[str]], None] | None = None,
                 on_written: Callable[[str], None] | None = None, upload_threads: int = 8,
                 pending_groups: int = 2, watchdog: RenderWatchdog | None = None):
        self.store = store
        self.storage = storage
        self.renderer = renderer
        self.worker_name = worker_name
        self.limits = BatchLimits()
        self.progress_interval_s = progress_interval_s
        self.job_timeout_s = job_timeout_s
        self.upload_retry_s = upload_retry_s
        self.redis_retry_s = redis_retry_s
        self.on_requeued = on_requeued or (lambda ids: None)
        self.on_rendered = on_rendered or (lambda ids: None)
        self.on_written = on_written or (lambda job_id: None)
        self._lock = threading.Lock()
        self.current: dict[str, StartedJob] = {}
        self.images_done = 0
        self.jobs_failed = 0
        self.timing = {"batches": 0, "jobs": 0, "total_s": 0.0, "render_s": 0.0}  # see _account
        self.upload_threads = upload_threads
        self._uploads: ThreadPoolExecutor | None = None  # created at the first batch of two or more
        self._post: queue.Queue[PostItem] = queue.Queue(maxsize=max(1, pending_groups))
        self._post_thread: threading.Thread | None = None  # started by the first run_overlapped
        self._render_q: queue.Queue[BatchWork] = queue.Queue(maxsize=1)
        self._render_thread: threading.Thread | None = None
        self._done: list[BatchOutcome] = []
        self.watchdog = watchdog or RenderWatchdog(0)  # 0: never fires (and is never started)
        self._rendered: list[StartedJob] = []  # the last group rendered (its render is over once the next starts)

    def run(self, messages: Sequence[Any]) -> BatchOutcome:
        """Handle one pulled batch of celery-batches requests, start to finish, in this thread.
        Never raises for a job's failure; returns what became of its jobs."""
        work = self._start_batch(messages)
        if work is None:
            return BatchOutcome()
        self._render_batch(work, self._post_inline)
        return work.outcome

    def run_overlapped(self, messages: Sequence[Any]) -> list[BatchOutcome]:
        """Start one pulled batch's jobs here (fenced attempts, leases), then hand it to the render
        thread and return, so that the caller (Celery's consumer) acks its messages and receives
        the next ones while it renders; rendered groups go on to the post-processing thread
        (encode, upload, record) while the next group renders. Blocks while a started batch
        already waits for the render thread, and the render thread blocks while
        ``pending_groups`` rendered groups wait for post-processing (backpressure: memory stays
        bounded). Returns the outcomes of the batches finished since the last call."""
        work = self._start_batch(messages)
        if work is not None:
            if self._render_thread is None:
                self._render_thread = threading.Thread(target=self._render_loop, name="render", daemon=True)
                self._render_thread.start()
            self._render_q.put(work)
        return self.take_done()

    def drain(self) -> list[BatchOutcome]:
        """Wait until every started batch is rendered, stored and recorded (at shutdown); returns
        the outcomes not yet taken."""
        if self._render_thread is not None:
            self._render_q.join()
        if self._post_thread is not None:
            self._post.join()
        return self.take_done()

    def _render_loop(self) -> None:
        while True:
            work = self._render_q.get()
            try:
                self._render_batch(work, self._post_queued)
            except Exception:  # its jobs stay running with their leases: the reaper recovers them
                log.exception("rendering a batch of %d job(s) failed", len(work.jobs))
            finally:
                self._render_q.task_done()

    def _start_batch(self, messages: Sequence[Any]) -> BatchWork | None:
        """Start the batch's jobs (held in :meth:`current_jobs` from here until recorded)."""
        batch_started = time.perf_counter()
        job_ids = job_ids_from_messages(messages)
        if not job_ids:
            return None
        started = self._redis(self.store.start_many, job_ids, self.worker_name)
        jobs = [s for s in started.values() if isinstance(s, StartedJob)]
        for job_id, reason in started.items():
            if not isinstance(reason, StartedJob):
                log.info("skipping job %s: %s", job_id, reason)
        work = BatchWork(job_ids=job_ids, jobs=jobs, started=batch_started)
        work.outcome.started = len(jobs)
        with self._lock:
            self.current.update({j.job_id: j for j in jobs})
        return work

    def _render_batch(self, work: BatchWork, post: Callable[[PostItem], None]) -> None:
        """Render the batch's groups, handing each rendered group, then the batch's end, to
        ``post`` (inline, or the post-processing thread's queue)."""
        try:
            for group in render_groups(work.jobs):
                if work.rendering.infrastructure or work.outcome.infrastructure:  # this worker is broken:
                    self._release_jobs(group, work.rendering)  # hand the rest over unrendered
                    continue
                t0 = time.perf_counter()
                self._render_group(group, work, post)
                log.info("rendered %d job(s) %s in %.2fs", len(group), compat_key(group[0].request)[1:4],
                         time.perf_counter() - t0)
        finally:
            post(PostItem(work))  # the batch's end: after its groups, in order

    # ---- post-processing: encode, upload, record ----------------------------------------------
    def _post_inline(self, item: PostItem) -> None:
        self._post_one(item)

    def _post_queued(self, item: PostItem) -> None:
        if self._post_thread is None:
            self._post_thread = threading.Thread(target=self._post_loop, name="post", daemon=True)
            self._post_thread.start()
        self._post.put(item)

    def _post_loop(self) -> None:
        while True:
            item = self._post.get()
            try:
                self._post_one(item)
            except Exception:  # the jobs stay running with their leases: the reaper recovers them
                log.exception("post-processing of %d job(s) failed", len(item.jobs or item.work.jobs))
            finally:
                self._post.task_done()

    def _post_one(self, item: PostItem) -> None:
        if item.jobs is not None:
            assert item.images is not None  # a group's item always carries its images
            self._store_group(item.work, item.jobs, item.images, item.steps)
            return
        work = item.work  # the batch's end: every group before it is stored
        outcome, rendering = work.outcome, work.rendering
        outcome.failed += rendering.failed
        outcome.dropped += rendering.dropped
        outcome.requeued.extend(rendering.requeued)
        outcome.renders.extend(rendering.renders)
        outcome.job_ids = list(work.job_ids)
        with self._lock:
            for job in work.jobs:
                self.current.pop(job.job_id, None)
        outcome.infrastructure = outcome.infrastructure or rendering.infrastructure
        if outcome.requeued:
            self._republish(outcome.requeued)
        batch_s = time.perf_counter() - work.started
        metrics.record_batch(self.store.r, [j.job_id for j in work.jobs], worker=self.worker_name,
                             renders=outcome.renders, succeeded=outcome.succeeded, failed=outcome.failed,
                             batch_seconds=batch_s)
        self._account(len(work.job_ids), batch_s, outcome)
        with self._lock:
            self._done.append(outcome)

    def take_done(self) -> list[BatchOutcome]:
        """The outcomes of the batches recorded since the last call (each returned once); thread-safe."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def _store_group(self, work: BatchWork, jobs: list[StartedJob], images: list[Image.Image],
                     steps: int | None = None) -> None:
        """Who is still ours, just before upload (cancellation and takeover), then store them."""
        held = self._redis(self.store.renew_leases, jobs, rendered=True)
        kept = []
        for job, image in zip(jobs, images, strict=True):
            if held.get(job.job_id) != HELD:
                log.info("job %s attempt %d was canceled or taken over; its image is discarded",
                         job.job_id, job.attempt)
                work.outcome.dropped += 1
                continue
            kept.append((job, image))
        self._store_all(kept, work.outcome, steps)

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

    def current_jobs(self) -> list[StartedJob]:
        """Jobs this worker holds right now (for heartbeats and lease renewal)."""
        with self._lock:
            return list(self.current.values())

    # ---- rendering ------------------------------------------------------------------------
    def _render_group(self, jobs: list[StartedJob], work: BatchWork, post: Callable[[PostItem], None]) -> None:
        outcome = work.rendering
        key = compat_key(jobs[0].request)
        cap = self.limits.cap(key, len(jobs))
        if len(jobs) > cap:  # this shape ran out of memory before: render it in chunks it fits in
            for i in range(0, len(jobs), cap):
                self._render_group(jobs[i:i + cap], work, post)
            return
        if jobs[0].suspect_n and self._post_thread is not None:  # it may crash the worker: store the
            self._post.join()  # groups rendered before it first, or the crash would lose their work
        deadline = time.monotonic() + self.job_timeout_s
        t0 = time.perf_counter()
        try:  # the group's size on its jobs, should this worker be lost (bisection across attempts)
            self.store.mark_rendering(jobs, rendered=self._rendered)
        except redis.RedisError as exc:  # Redis away: render anyway, the heartbeat renews the leases
            log.warning("group size not recorded: %s", exc)
        steps = [0]  # the group's denoising steps, counted by the step callback (each result reports them)
        try:
            with self.watchdog.rendering(f"a group of {len(jobs)} ({jobs[0].job_id}…)"):
                images = self.renderer.render([j.request for j in jobs],
                                              on_step=self._step_callback(jobs, deadline, steps))
        except GroupAbandoned as exc:
            log.info("stopped a group of %d: %s", len(jobs), exc)
            outcome.dropped += len(jobs)
            return
        except Exception as exc:  # bisect: only the job that fails may fail
            if isinstance(exc, TimeoutError) and len(jobs) == 1:
                self._fail(jobs[0], TimeoutError(f"{exc}; it ran alone, so the job itself is too slow"),
                           outcome, retry=False)
                return
            if classify(exc) not in (REQUEST, TRANSIENT) or (len(jobs) == 1 and not is_oom_error(exc)):
                for job in jobs:  # this worker's infrastructure, or the job alone: no bisection
                    self._fail(job, exc, outcome)
                return
            if is_oom_error(exc):
                cap = self.limits.lowered(key, len(jobs))
                log.warning("out of memory on a group of %d; this shape now renders at most %d at once", len(jobs), cap)
            if len(jobs) == 1:
                self._fail(jobs[0], exc, outcome)
                return
            log.warning("group of %d failed (%s: %s); bisecting", len(jobs), type(exc).__name__, exc)
            failed = True  # the halves render below, once the except block has released the exception
        else:
            failed = False
        if failed:  # outside the except block: the failed batch's frames and tensors are freed first
            mid = len(jobs) // 2
            self._render_group(jobs[:mid], work, post)
            self._render_group(jobs[mid:], work, post)
            return
        self.limits.succeeded(key, len(jobs))
        self._rendered = jobs
        outcome.renders.append((len(jobs), time.perf_counter() - t0))
        self.on_rendered([j.job_id for j in jobs])
        post(PostItem(work, jobs, images, steps[0]))

    def _store_all(self, kept: list[tuple[StartedJob, Image.Image]], outcome: BatchOutcome,
                   steps: int | None = None) -> None:
        """Encode and upload each job's image, ``upload_threads`` jobs at a time (Pillow's encoders
        and the S3 PUT release the GIL; boto3's client is thread-safe, on one connection pool
        sized to these threads), then record the group's successes in one pipelined round trip
        (:meth:`infra.state.jobs.JobStore.succeed_many`)."""
        def upload(pair: tuple[StartedJob, Image.Image]):
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
                self._fail(job, result, outcome)
            else:
                stored.append((job, result))
        if not stored:
            return
        try:
            recorded = self._redis(self.store.succeed_many, [(job, s.result) for job, s in stored])
        except Exception as exc:  # Redis away past redis_retry_s: the attempts fail (and retry)
            for job, _ in stored:
                self._fail(job, exc, outcome)
            return
        for job, result in stored:
            if recorded.get(job.job_id):
                with self._lock:
                    self.images_done += 1
                outcome.succeeded += 1
            else:
                self._stale_result(job, result, outcome)

    def _step_callback(self, jobs: list[StartedJob], deadline: float, steps: list[int]) -> Callable[[int, int], None]:
        """The renderer's ``on_step`` for a group: progress, cancellation, the deadline; adds each
        denoising step it sees to ``steps[0]``."""
        last = [0.0]

        def on_step(step: int, total: int) -> None:
            steps[0] += 1
            self.watchdog.progress()
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"render exceeded the job timeout of {self.job_timeout_s:g}s "
                                   f"(stopped after step {step} of {total})")
            if step < total and now - last[0] < self.progress_interval_s:
                return
            last[0] = now
            # the last step still has decoding and upload ahead: report < 1 until succeeded
            fraction = min(step / max(total, 1), 0.99)
            try:
                codes = self.store.progress_many((job, fraction) for job in jobs)
            except redis.RedisError as exc:  # Redis away: keep rendering; the heartbeat renews leases
                log.warning("progress not recorded: %s", exc)
                return
            if codes and all(code != HELD for code in codes.values()):
                raise GroupAbandoned(f"all {len(jobs)} job(s) canceled or taken over at step {step} of {total}")

        return on_step

    # ---- results --------------------------------------------------------------------------
    def _upload(self, job: StartedJob, image: Image.Image, steps: int | None = None) -> StoredImage:
        stored = store_image(self.storage, image, job_id=job.job_id, batch_id=job.batch_id, request=job.request,
                             model=self.renderer.model, retry_s=self.upload_retry_s,
                             scheduler=self._scheduler_name(job.request.scheduler),
                             lora_hashes=getattr(self.renderer, "lora_hashes", lambda request: None)(job.request),
                             denoising_steps=steps)
        if stored.written:
            self.on_written(job.job_id)
        return stored

    def _stale_result(self, job: StartedJob, stored: StoredImage, outcome: BatchOutcome) -> None:
        """The attempt no longer held the job when its success was recorded."""
        outcome.dropped += 1
        status = self._redis(self.store.get_job, job.job_id)
        if stored.written and status is not None and status.state == "canceled":
            # canceled between the pre-upload check and now: a canceled job keeps no object
            self.storage.delete(stored.result.key)
            log.info("job %s was canceled during its upload; object removed", job.job_id)
        else:
            log.warning("job %s attempt %d is stale; its result was not recorded", job.job_id, job.attempt)

    def _scheduler_name(self, requested: str) -> str:
        name_of = getattr(self.renderer, "scheduler_name", None)
        return name_of(requested) if name_of is not None else requested

    def _fail(self, job: StartedJob, exc: BaseException, outcome: BatchOutcome, *, retry: bool | None = None) -> None:
        kind = classify(exc)
        if kind in (CREDENTIALS, DEVICE) and not outcome.infrastructure:  # logged by the breaker as it opens
            outcome.infrastructure = f"{type(exc).__name__}: {exc}"[:500]
        if kind == CREDENTIALS and retry is None:  # nothing of the request was at fault: no attempt spent
            self._release_jobs([job], outcome)
            return
        retry = kind != REQUEST if retry is None else retry
        error = JobError(type=type(exc).__name__, message=str(exc)[:2000])
        state = self._redis(self.store.fail, job, error, retry=retry)
        if state == "queued":
            log.warning("job %s attempt %d failed (%s: %s); requeued", job.job_id, job.attempt, error.type, exc)
            outcome.requeued.append(job.job_id)
        elif state == "failed":
            log.error("job %s failed: %s: %s", job.job_id, error.type, exc)
            with self._lock:
                self.jobs_failed += 1
            outcome.failed += 1
        else:
            log.warning("job %s attempt %d is stale; its failure was not recorded", job.job_id, job.attempt)
            outcome.dropped += 1

    def _release_jobs(self, jobs: list[StartedJob], outcome: BatchOutcome) -> None:
        """Give ``jobs`` back to ``queued`` without spending an attempt (republished at the batch's end)."""
        try:
            released = self._redis(self.store.release, jobs)
        except Exception as exc:  # Redis away: their leases expire and the reaper requeues them
            log.warning("could not release %d job(s): %s", len(jobs), exc)
            return
        outcome.requeued.extend(job_id for job_id, _ in released)  # the others were taken over or canceled
        log.warning("released %d job(s) unharmed to other workers", len(released))

    def _republish(self, job_ids: list[str]) -> None:
        try:
            self.on_requeued(job_ids)
        except Exception as exc:  # the reaper republishes what stays queued without a message
            log.warning("could not republish %d requeued job(s): %s", len(job_ids), exc)

    def _redis(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, retried with backoff while Redis is unreachable or loading,
        for up to ``redis_retry_s`` seconds; then the last error is raised."""
        deadline = time.monotonic() + self.redis_retry_s
        delay = 0.2
        while True:
            try:
                return fn(*args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
