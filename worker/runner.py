"""One worker's handling of a pulled batch: start → group → render → encode → upload → finish.

Data flow: queue (celery-batches hands over up to ``batch_size`` messages) → **here** → pipeline
(one call per compatibility group) → storage → job-state store.

Guarantees:
- A failure inside one job never fails the others: a group that raises is bisected until only
  the failing job is left, and that job alone is marked failed with its error (type, message).
- An out-of-memory error splits the group the same way and tells the worker to lower its
  batch size (``on_oom``).
- Every write after start carries the attempt number, so a stale attempt changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from PIL import Image

from infra.imagefile import encode_image, format_parameters
from infra.schemas import JobError, JobResult, RenderRequest
from infra.storage import Storage, object_key, object_metadata
from infra.store import JobStore, StartedJob
from pipeline.memory import is_oom_error
from pipeline.render import compat_key

log = logging.getLogger("renderfarm.worker")


class Renderer(Protocol):
    """What the runner needs of a renderer (``pipeline.Renderer``, or the null renderer)."""

    model: str

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]: ...


def job_ids_from_messages(messages: Sequence[Any]) -> list[str]:
    """The job ids carried by celery-batches requests; malformed messages are logged and dropped."""
    ids = []
    for message in messages:
        job_id = (getattr(message, "kwargs", None) or {}).get("job_id")
        if isinstance(job_id, str) and 0 < len(job_id) <= 64 and job_id.isalnum():
            ids.append(job_id)
        else:
            log.error("rejected malformed message %s: kwargs=%r args=%r", getattr(message, "id", "?"),
                      getattr(message, "kwargs", None), getattr(message, "args", None))
    return ids


class BatchRunner:
    """Renders pulled batches for one worker.

    Args:
        store: job-state store. storage: image bucket. renderer: the warm pipeline.
        worker_name: recorded on each job it runs.
        on_oom: called with the size of a group that ran out of memory.
        progress_interval_s: least seconds between progress writes of one group.
    """

    def __init__(self, store: JobStore, storage: Storage, renderer: Renderer, worker_name: str, *,
                 on_oom: Callable[[int], None] | None = None, progress_interval_s: float = 0.2):
        self.store = store
        self.storage = storage
        self.renderer = renderer
        self.worker_name = worker_name
        self.on_oom = on_oom or (lambda size: None)
        self.progress_interval_s = progress_interval_s
        self._lock = threading.Lock()
        self.current: dict[str, StartedJob] = {}
        self.images_done = 0
        self.jobs_failed = 0

    def run(self, messages: Sequence[Any]) -> None:
        """Handle one pulled batch of celery-batches requests. Never raises for a job's failure."""
        job_ids = job_ids_from_messages(messages)
        if not job_ids:
            return
        started = self.store.start_many(job_ids, self.worker_name)
        jobs = [s for s in started.values() if isinstance(s, StartedJob)]
        for job_id, reason in started.items():
            if not isinstance(reason, StartedJob):
                log.info("skipping job %s: %s", job_id, reason)
        groups: dict[tuple, list[StartedJob]] = defaultdict(list)
        for job in jobs:
            groups[compat_key(job.request)].append(job)
        with self._lock:
            self.current.update({j.job_id: j for j in jobs})
        try:
            for group in groups.values():
                t0 = time.perf_counter()
                self._render_group(group)
                log.info("rendered %d job(s) %s in %.2fs", len(group), compat_key(group[0].request)[1:4],
                         time.perf_counter() - t0)
        finally:
            with self._lock:
                for job in jobs:
                    self.current.pop(job.job_id, None)

    def current_jobs(self) -> list[StartedJob]:
        """Jobs this worker holds right now (for heartbeats and lease renewal)."""
        with self._lock:
            return list(self.current.values())

    def _render_group(self, jobs: list[StartedJob]) -> None:
        try:
            images = self.renderer.render([j.request for j in jobs], on_step=self._progress_reporter(jobs))
        except Exception as exc:  # bisect: only the job that fails may fail
            if is_oom_error(exc):
                log.warning("out of memory on a group of %d; splitting", len(jobs))
                self.on_oom(len(jobs))
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
                return
            mid = len(jobs) // 2
            log.warning("group of %d failed (%s: %s); bisecting", len(jobs), type(exc).__name__, exc)
            self._render_group(jobs[:mid])
            self._render_group(jobs[mid:])
            return
        for job, image in zip(jobs, images, strict=True):
            try:
                self._store_image(job, image)
            except Exception as exc:
                self._fail(job, exc)

    def _progress_reporter(self, jobs: list[StartedJob]) -> Callable[[int, int], None]:
        last = [0.0]

        def on_step(step: int, total: int) -> None:
            now = time.monotonic()
            if step < total and now - last[0] < self.progress_interval_s:
                return
            last[0] = now
            # the last step still has decoding and upload ahead: report < 1 until succeeded
            fraction = min(step / max(total, 1), 0.99)
            self.store.progress_many((job, fraction) for job in jobs)

        return on_step

    def _store_image(self, job: StartedJob, image: Image.Image) -> None:
        request = job.request
        parameters = format_parameters(request, model=self.renderer.model, job_id=job.job_id)
        body, content_type = encode_image(image, request.output_format, parameters)
        key = object_key(job.batch_id, job.job_id, request.output_format)
        metadata = object_metadata({"job-id": job.job_id, "batch-id": job.batch_id, "seed": str(request.seed),
                                    "model": self.renderer.model, "steps": str(request.num_inference_steps),
                                    "cfg-scale": f"{request.guidance_scale:g}",
                                    "size": f"{request.width}x{request.height}"}, parameters)
        self.storage.put(key, body, content_type, metadata)
        result = JobResult(key=key, width=image.width, height=image.height, seed=request.seed,
                           content_type=content_type, bytes=len(body))
        if self.store.succeed(job, result):
            self.images_done += 1
        else:
            log.warning("job %s attempt %d is stale; its result was not recorded", job.job_id, job.attempt)

    def _fail(self, job: StartedJob, exc: BaseException) -> None:
        log.error("job %s failed: %s: %s", job.job_id, type(exc).__name__, exc)
        self.jobs_failed += 1
        self.store.fail(job, JobError(type=type(exc).__name__, message=str(exc)[:2000]))
