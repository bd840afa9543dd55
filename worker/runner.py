"""One worker's handling of a pulled batch: start → render stage → post stage, and what it guarantees.

Data flow: queue (celery-batches hands over up to ``batch_size`` messages) → **here**: the
batch's jobs are started → :mod:`worker.render_stage` (group, render: one pipeline call per
compatibility group) → :mod:`worker.handoff` → :mod:`worker.post_stage` (encode, upload,
record) → storage → job-state store.

Guarantees:
- A failure inside one job never fails the others: a group that raises is bisected until only
  the failing job is left, and that job alone is marked failed with its error (type, message).
- An out-of-memory error splits the group the same way (the farm's one policy,
  :func:`pipeline.memory.render_in_parts`: the halves render after the ``except`` block, so the
  failed batch's tensors are released first) and lowers the batch size for that shape only
  (``pipeline.memory.BatchLimits``, keyed by the compat key), which rises back after
  successes; other shapes keep the worker's batch size. A VAE decode that alone runs out of
  memory never reaches here: the renderer decodes that batch one image at a time.
- Every write after start carries the attempt number, so a stale attempt changes nothing; a
  job this attempt no longer holds (canceled, or taken over after its lease ran out) is
  discarded before upload, and the upload itself is write-once (:meth:`infra.storage.s3.Storage.put_once`).
- Cancellation reaches a running job between denoising steps: each progress write answers,
  per job, whether this attempt still holds it. When no job of the group is held any more,
  the step callback raises :class:`worker.render_stage.GroupAbandoned` and the group stops at
  once. When only some are canceled, the group renders on (the others share the same denoising
  loop, and stopping it would cost them their work) and the canceled jobs' images are dropped:
  their state stays ``canceled`` and no object is written.
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
import time
from collections.abc import Callable, Sequence
from typing import Any

from infra.state.job_store import JobStore, StartedJob
from infra.storage.s3 import Storage
from pipeline.memory import BatchLimits
from worker.attempts import AttemptRecorder
from worker.batch import BatchOutcome, BatchWork, HeldJobs, job_ids_from_messages
from worker.handoff import BatchEnd, RenderedGroup, StageThread
from worker.post_stage import PostStage
from worker.render_stage import Renderer, RenderStage
from worker.watchdog import RenderWatchdog

log = logging.getLogger("renderfarm.worker")

__all__ = ["BatchRunner", "Renderer", "job_ids_from_messages"]


class BatchRunner:
    """Runs pulled batches for one worker: starts their jobs, then the render stage and the post stage.

    Args:
        store: job-state store. storage: image bucket. renderer: the warm pipeline.
        worker_name: recorded on each job it runs.
        progress_interval_s: least seconds between progress writes of one group.
        job_timeout_s: longest a group's render may take, seconds (longer for a group estimated at
            ``s_per_mpx_step`` to need more: :mod:`worker.budgets`).
        upload_retry_s: how long an upload rides out a storage outage, seconds.
        redis_retry_s: how long a job-state write rides out a Redis outage, seconds.
        on_requeued: called with the ids of jobs put back to ``queued`` (to republish them).
        on_rendered / on_written: test counters (``worker.faults``): job ids rendered, and each
            job whose object this attempt really wrote.
        upload_threads: jobs of a group encoded, uploaded and recorded at once (1 = in turn).
        pending_groups: rendered groups that may wait for the post stage in
            :meth:`run_overlapped` before the renderer blocks (the bound on held images).
        watchdog: told of each render's start, steps and end (:mod:`worker.watchdog`), or None.

    Two ways to run a batch: :meth:`run` does it all in the calling thread; :meth:`run_overlapped`
    starts the jobs in the calling thread, renders in a render thread and leaves encoding, upload
    and the state writes to one post thread (each fed through a bounded queue, in order,
    :class:`worker.handoff.StageThread`), so that the device renders the next group while the
    last one is stored, and Celery's consumer acks and receives messages meanwhile. The
    guarantees are the same: the lease check that drops canceled or taken-over jobs runs just
    before each group's upload, uploads are write-once and every write is fenced by the attempt;
    jobs stay in :meth:`current_jobs` (their leases renewed by the heartbeat) until their batch
    is recorded. :meth:`drain` waits for both threads to finish (a warm shutdown).
    """

    def __init__(self, store: JobStore, storage: Storage, renderer: Renderer, worker_name: str, *,
                 progress_interval_s: float = 0.2,
                 job_timeout_s: float = 600.0, upload_retry_s: float = 60.0, redis_retry_s: float = 30.0,
                 on_requeued: Callable[[list[str]], object] | None = None,
                 on_rendered: Callable[[list[str]], None] | None = None,
                 on_written: Callable[[str], None] | None = None, upload_threads: int = 8,
                 pending_groups: int = 2, watchdog: RenderWatchdog | None = None, s_per_mpx_step: float = 0.05):
        self.store = store
        self.worker_name = worker_name
        self.limits = BatchLimits()
        self.held = HeldJobs()
        self.attempts = AttemptRecorder(store, redis_retry_s=redis_retry_s)
        self.post = PostStage(store, storage, renderer, self.attempts, self.held, worker_name,
                              upload_retry_s=upload_retry_s, upload_threads=upload_threads,
                              on_requeued=on_requeued or (lambda ids: None),
                              on_written=on_written or (lambda job_id: None))
        self._post_thread: StageThread[RenderedGroup | BatchEnd] = StageThread(
            "post", self.post.handle, maxsize=pending_groups,
            describe=lambda item: f"post-processing of {len(getattr(item, 'jobs', None) or item.work.jobs)} job(s)")
        self.render = RenderStage(store, renderer, self.attempts, limits=self.limits,
                                  progress_interval_s=progress_interval_s, job_timeout_s=job_timeout_s,
                                  watchdog=watchdog or RenderWatchdog(0),  # 0: never fires (and is never started)
                                  on_rendered=on_rendered or (lambda ids: None), wait_for_stored=self._post_thread.join,
                                  s_per_mpx_step=s_per_mpx_step)
        self._render_thread: StageThread[BatchWork] = StageThread(
            "render", lambda work: self.render.render_batch(work, self._post_thread.put), maxsize=1,
            describe=lambda work: f"rendering a batch of {len(work.jobs)} job(s)")

    def run(self, messages: Sequence[Any]) -> BatchOutcome:
        """Handle one pulled batch of celery-batches requests, start to finish, in this thread.
        Never raises for a job's failure; returns what became of its jobs."""
        work = self._start_batch(messages)
        if work is None:
            return BatchOutcome()
        self.render.render_batch(work, self.post.handle)
        return work.outcome

    def run_overlapped(self, messages: Sequence[Any]) -> list[BatchOutcome]:
        """Start one pulled batch's jobs here (fenced attempts, leases), then hand it to the render
        thread and return, so that the caller (Celery's consumer) acks its messages and receives
        the next ones while it renders; rendered groups go on to the post thread (encode, upload,
        record) while the next group renders. Blocks while a started batch already waits for the
        render thread, and the render thread blocks while ``pending_groups`` rendered groups wait
        for the post stage (backpressure: memory stays bounded). Returns the outcomes of the
        batches finished since the last call."""
        work = self._start_batch(messages)
        if work is not None:
            self._render_thread.put(work)
        return self.take_done()

    def drain(self) -> list[BatchOutcome]:
        """Wait until every started batch is rendered, stored and recorded (at shutdown); returns
        the outcomes not yet taken."""
        self._render_thread.join()
        self._post_thread.join()
        return self.take_done()

    def take_done(self) -> list[BatchOutcome]:
        """The outcomes of the batches recorded since the last call (each returned once); thread-safe."""
        return self.post.take_done()

    def current_jobs(self) -> list[StartedJob]:
        """Jobs this worker holds right now (for heartbeats and lease renewal)."""
        return self.held.snapshot()

    def start(self) -> None:
        """As a part of the worker: nothing to start (the render and post threads start with the
        first overlapped batch)."""

    def stop(self) -> None:
        """As a part of the worker, last at exit: give back the jobs still held (a cold shutdown
        interrupted a batch), so they run again at once instead of after their lease; a warm
        shutdown holds none."""
        held = self.current_jobs()
        if not held:
            return
        try:
            released = self.store.release(held)
            self.post.on_requeued([job_id for job_id, _ in released])
            log.warning("released %d running job(s) on shutdown", len(released))
        except Exception as exc:  # Redis away: their leases expire and the reaper requeues them
            log.warning("could not release %d job(s): %s", len(held), exc)

    @property
    def images_done(self) -> int:
        """Images stored and recorded by this worker."""
        return self.post.images_done

    @property
    def jobs_failed(self) -> int:
        """Jobs this worker failed for good."""
        return self.attempts.jobs_failed

    def _start_batch(self, messages: Sequence[Any]) -> BatchWork | None:
        """Start the batch's jobs (held in :meth:`current_jobs` from here until recorded); None
        when no message carries a job id."""
        batch_started = time.perf_counter()
        job_ids = job_ids_from_messages(messages)
        if not job_ids:
            return None
        started = self.attempts.redis(self.store.start_many, job_ids, self.worker_name)
        jobs = [s for s in started.values() if isinstance(s, StartedJob)]
        for job_id, reason in started.items():
            if not isinstance(reason, StartedJob):
                log.info("skipping job %s: %s", job_id, reason)
        work = BatchWork(job_ids=job_ids, jobs=jobs, started=batch_started)
        work.outcome.started = len(jobs)
        self.held.add(jobs)
        return work
