"""What a worker holds while one pulled batch is in flight, and what became of its jobs.

Place in the data flow: inside the worker, from the batch's start (:mod:`worker.runner`, in
Celery's consumer thread) through the render stage (:mod:`worker.render_stage`) to the post
stage (:mod:`worker.post_stage`), which records it: the pulled messages' job ids
(:func:`job_ids_from_messages`), the batch in flight (:class:`BatchWork`), its render groups
(:func:`render_groups`), the jobs held meanwhile (:class:`HeldJobs`) and what became of them
(:class:`BatchOutcome`).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infra.state.job_store import StartedJob
from pipeline.compat import compat_key

log = logging.getLogger("renderfarm.worker")


@dataclass
class BatchOutcome:
    """What became of one pulled batch's jobs (counts of jobs)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    dropped: int = 0  # canceled or taken over while this attempt ran: result discarded
    requeued: list[str] = field(default_factory=list)  # transient failure: back to queued
    infrastructure: str = ""  # this worker's infrastructure failed (worker.errors): its breaker opens at once
    renders: list[tuple[int, float]] = field(default_factory=list)  # (images, seconds) per pipeline call
    job_ids: list[str] = field(default_factory=list)  # the pulled batch's job ids (set when it is recorded)

    @property
    def failed_batch(self) -> bool:
        """True when jobs ran and every one of them ended in an error (the circuit breaker's input)."""
        return self.succeeded == 0 and (self.failed + len(self.requeued)) > 0


@dataclass
class BatchWork:
    """One pulled batch in flight: its job ids, the jobs this attempt started, the perf_counter
    time it started, and two outcomes, one per stage (each written by one thread), merged by the
    post stage at the batch's end: ``rendering`` (the render stage's failures and drops, its
    pipeline calls) and ``outcome`` (the post stage's)."""

    job_ids: list[str]
    jobs: list[StartedJob]
    started: float
    outcome: BatchOutcome = field(default_factory=BatchOutcome)
    rendering: BatchOutcome = field(default_factory=BatchOutcome)


class HeldJobs:
    """The jobs this worker holds: each from its start until its batch is recorded (their leases
    are renewed by the heartbeat meanwhile, and a cold shutdown releases them). Thread-safe."""

    def __init__(self) -> None:
        self._jobs: dict[str, StartedJob] = {}
        self._lock = threading.Lock()

    def add(self, jobs: Iterable[StartedJob]) -> None:
        """Hold ``jobs`` (started by this worker)."""
        with self._lock:
            self._jobs.update({j.job_id: j for j in jobs})

    def remove(self, jobs: Iterable[StartedJob]) -> None:
        """Hold ``jobs`` no more (their batch is recorded)."""
        with self._lock:
            for job in jobs:
                self._jobs.pop(job.job_id, None)

    def snapshot(self) -> list[StartedJob]:
        """The jobs held now."""
        with self._lock:
            return list(self._jobs.values())


def render_groups(jobs: list[StartedJob]) -> list[list[StartedJob]]:
    """The render groups of a started batch, in order: jobs of one compatibility group
    (``pipeline.compat.compat_key``) render together, except *suspects* — jobs a worker was lost
    with while they rendered in a group of ``suspect_n`` (bisection across attempts,
    :mod:`infra.state.scripts`) — which render apart from the unsuspected jobs, in groups of at
    most half the smallest ``suspect_n`` among them (at least 1), so that each loss halves the
    group a worker-killing request is in, until it renders alone. Unsuspected groups come
    first, so that they are done before a suspect can crash the worker."""
    groups: dict[tuple, list[StartedJob]] = defaultdict(list)
    for job in jobs:
        groups[(compat_key(job.request), job.suspect_n > 0)].append(job)
    out = [group for (_, suspect), group in groups.items() if not suspect]  # first: done before any crash
    for (_, suspect), group in groups.items():
        if suspect:
            cap = max(1, min(j.suspect_n for j in group) // 2)
            out.extend(group[i:i + cap] for i in range(0, len(group), cap))
    return out


def job_ids_from_messages(messages: Sequence[Any], *, log_rejects: bool = True) -> list[str]:
    """The job ids carried by celery-batches requests; malformed messages are dropped (and
    logged, unless ``log_rejects`` is false)."""
    ids = []
    for message in messages:
        kwargs = getattr(message, "kwargs", None)
        job_id = kwargs.get("job_id") if isinstance(kwargs, dict) else None
        if isinstance(job_id, str) and 0 < len(job_id) <= 64 and job_id.isascii() and job_id.isalnum():
            ids.append(job_id)
        elif log_rejects:
            log.error("rejected malformed message %s: kwargs=%.200r args=%.200r", getattr(message, "id", "?"),
                      kwargs, getattr(message, "args", None))
    return ids
