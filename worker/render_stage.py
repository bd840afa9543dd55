"""The render stage: a started batch's groups through the warm pipeline, one call per group, in
parts that fit.

Place in the data flow: batch started (:mod:`worker.runner`) → **render stage** (the render
thread; the calling thread when not overlapped) → pipeline (``Renderer.render``) → hand-off
(:mod:`worker.handoff`) → post stage (:mod:`worker.post_stage`).

A batch reads top to bottom in :meth:`RenderStage.render_batch`: its render groups
(:func:`worker.batch.render_groups`), each rendered through the farm's one out-of-memory policy,
:func:`pipeline.memory.render_in_parts` (cap the group for its shape, lower the cap on an OOM,
render the halves after the ``except`` block), whose other failures come back to
:meth:`RenderStage._failed`, which bisects the rest too, so that only a job that fails alone
fails. Each part that rendered is handed on as a :class:`worker.handoff.RenderedGroup`, and the
batch's end as a :class:`worker.handoff.BatchEnd`.

- Before each render the group's size is recorded on its jobs (bisection across attempts,
  :mod:`infra.state.scripts`); a group of suspects first waits until the groups before it are
  stored, or a crash would lose their work.
- The step callback reports progress, learns of cancellations (when no job of the group is held
  any more it raises :class:`GroupAbandoned` and the group stops between two denoising steps)
  and stops a render past its deadline with ``TimeoutError``: ``job_timeout_s``, or more for a
  group estimated to take longer, a video (:mod:`worker.budgets`); the halves each get a fresh
  deadline; a job that alone still times out fails with the timeout. The render watchdog
  (:mod:`worker.watchdog`) sees each render start, step and end.
- After an error of this worker's infrastructure (:mod:`worker.errors`) the batch's groups not
  yet rendered are released unrendered.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import redis
from PIL import Image

from infra.schemas import RenderRequest
from infra.state.job_store import HELD, JobStore, StartedJob
from pipeline.compat import compat_key
from pipeline.memory import BatchLimits, render_in_parts
from worker.attempts import AttemptRecorder
from worker.batch import BatchOutcome, BatchWork, render_groups
from worker.budgets import render_budget
from worker.errors import REQUEST, TRANSIENT, classify
from worker.handoff import BatchEnd, RenderedGroup
from worker.watchdog import RenderWatchdog

log = logging.getLogger("renderfarm.worker")

HandOff = Callable[[RenderedGroup | BatchEnd], None]


class Renderer(Protocol):
    """What the worker needs of a renderer (``pipeline.Renderer``, or the null renderer). One that
    also has ``scheduler_name(requested) -> str`` names the scheduler in each image's infotext."""

    model: str

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]: ...


class GroupAbandoned(Exception):
    """Raised from the step callback when no job of the group is held by this attempt any more
    (all canceled, or taken over): the render stops between two denoising steps."""


class RenderStage:
    """Renders started batches, group by group, and hands each rendered group on.

    Args:
        store: job-state store (group sizes, progress). renderer: the warm pipeline.
        attempts: records the jobs whose render failed.
        limits: per-shape batch caps after an OOM (:class:`pipeline.memory.BatchLimits`).
        progress_interval_s: least seconds between progress writes of one group.
        job_timeout_s: longest a group's render may take, seconds, unless its estimate at
            ``s_per_mpx_step`` (seconds per megapixel per denoising step, per frame of a video)
            asks for more (:func:`worker.budgets.render_budget`).
        watchdog: told of each render's start, steps and end (and of the render's stall limit).
        on_rendered: called with the job ids of each group that rendered (a test counter).
        wait_for_stored: blocks until the groups handed on so far are stored (before suspects).
    """

    def __init__(self, store: JobStore, renderer: Renderer, attempts: AttemptRecorder, *, limits: BatchLimits,
                 progress_interval_s: float, job_timeout_s: float, watchdog: RenderWatchdog,
                 on_rendered: Callable[[list[str]], None], wait_for_stored: Callable[[], None],
                 s_per_mpx_step: float = 0.05):
        self.store, self.renderer, self.attempts, self.limits = store, renderer, attempts, limits
        self.s_per_mpx_step = s_per_mpx_step
        self.progress_interval_s = progress_interval_s
        self.job_timeout_s = job_timeout_s
        self.watchdog = watchdog
        self.on_rendered = on_rendered
        self.wait_for_stored = wait_for_stored
        self._rendered: list[StartedJob] = []  # the last group rendered (its render is over once the next starts)

    def render_batch(self, work: BatchWork, hand_off: HandOff) -> None:
        """Render the batch's groups, handing each rendered group, then the batch's end, to
        ``hand_off`` (the post stage itself, or its thread's queue)."""
        try:
            for group in render_groups(work.jobs):
                if work.rendering.infrastructure or work.outcome.infrastructure:  # this worker is broken:
                    self.attempts.release(group, work.rendering)  # hand the rest over unrendered
                    continue
                t0 = time.perf_counter()
                self._render_group(group, work, hand_off)
                log.info("rendered %d job(s) %s in %.2fs", len(group), compat_key(group[0].request)[1:4],
                         time.perf_counter() - t0)
        finally:
            hand_off(BatchEnd(work))  # after its groups, in order

    def _render_group(self, group: list[StartedJob], work: BatchWork, hand_off: HandOff) -> None:
        """One render group, in the parts the out-of-memory policy and bisection make of it."""
        parts = render_in_parts(functools.partial(self._render, work), group, self.limits,
                                compat_key(group[0].request), on_error=functools.partial(self._failed, work.rendering))
        for jobs, rendered in parts:
            self._rendered = jobs
            work.rendering.renders.append((len(jobs), rendered.seconds))
            self.on_rendered([j.job_id for j in jobs])
            hand_off(rendered)

    def _render(self, work: BatchWork, jobs: list[StartedJob]) -> RenderedGroup:
        """One pipeline call for ``jobs`` (raises what the render raised)."""
        if jobs[0].suspect_n:  # it may crash the worker: store the groups rendered before it first,
            self.wait_for_stored()  # or the crash would lose their work
        budget = render_budget([j.request for j in jobs], s_per_mpx_step=self.s_per_mpx_step,
                               job_timeout_s=self.job_timeout_s, stall_s=self.watchdog.stall_s)
        deadline = time.monotonic() + budget.timeout_s
        t0 = time.perf_counter()
        try:  # the group's size on its jobs, should this worker be lost (bisection across attempts)
            self.store.mark_rendering(jobs, rendered=self._rendered)
        except redis.RedisError as exc:  # Redis away: render anyway, the heartbeat renews the leases
            log.warning("group size not recorded: %s", exc)
        steps = [0]  # the group's denoising steps, counted by the step callback (each result reports them)
        with self.watchdog.rendering(f"a group of {len(jobs)} ({jobs[0].job_id}…)", budget.stall_s):
            images = self.renderer.render([j.request for j in jobs],
                                          on_step=self._step_callback(jobs, deadline, budget.timeout_s, steps))
        return RenderedGroup(work, jobs, images, steps[0], time.perf_counter() - t0)

    def _failed(self, outcome: BatchOutcome, jobs: list[StartedJob], exc: Exception) -> bool:
        """The out-of-memory policy's ``on_error``: a render of ``jobs`` raised ``exc`` (anything
        but an OOM of two or more jobs, which the policy splits itself). Returns True to bisect:
        only the job that fails may fail."""
        if isinstance(exc, GroupAbandoned):
            log.info("stopped a group of %d: %s", len(jobs), exc)
            outcome.dropped += len(jobs)
            return False
        if isinstance(exc, TimeoutError) and len(jobs) == 1:
            self.attempts.fail(jobs[0], TimeoutError(f"{exc}; it ran alone, so the job itself is too slow"),
                               outcome, retry=False)
            return False
        if classify(exc) not in (REQUEST, TRANSIENT) or len(jobs) == 1:
            for job in jobs:  # this worker's infrastructure, or the job alone: no bisection
                self.attempts.fail(job, exc, outcome)
            return False
        log.warning("group of %d failed (%s: %s); bisecting", len(jobs), type(exc).__name__, exc)
        return True

    def _step_callback(self, jobs: list[StartedJob], deadline: float, timeout_s: float,
                       steps: list[int]) -> Callable[[int, int], None]:
        """The renderer's ``on_step`` for a group: progress, cancellation, the deadline; adds each
        denoising step it sees to ``steps[0]``."""
        last = [0.0]

        def on_step(step: int, total: int) -> None:
            steps[0] += 1
            self.watchdog.progress()
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"render exceeded the job timeout of {timeout_s:g}s "
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
