"""What a worker holds while one pulled batch is in flight, and what became of its jobs.

Place in the data flow: inside the worker, between :class:`worker.runner.BatchRunner`'s three
stages (start, in Celery's consumer thread → render, in the render thread → encode, upload and
record, in the post-processing thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from infra.state.jobs import StartedJob


@dataclass
class BatchOutcome:
    """What became of one pulled batch's jobs (counts of jobs)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    dropped: int = 0  # canceled or taken over while this attempt ran: result discarded
    requeued: list[str] = field(default_factory=list)  # transient failure: back to queued
    renders: list[tuple[int, float]] = field(default_factory=list)  # (images, seconds) per pipeline call
    job_ids: list[str] = field(default_factory=list)  # the pulled batch's job ids (set when it is recorded)

    @property
    def failed_batch(self) -> bool:
        """True when jobs ran and every one of them ended in an error (the circuit breaker's input)."""
        return self.succeeded == 0 and (self.failed + len(self.requeued)) > 0


@dataclass
class BatchWork:
    """One pulled batch in flight: its jobs, the perf_counter time it started, and two outcomes,
    one per thread, merged at the batch's end: ``rendering`` (the render stage's failures and
    drops, its pipeline calls) and ``outcome`` (the post stage's)."""

    job_ids: list[str]
    jobs: list[StartedJob]
    started: float
    outcome: BatchOutcome = field(default_factory=BatchOutcome)
    rendering: BatchOutcome = field(default_factory=BatchOutcome)


@dataclass
class PostItem:
    """A post-processing item: a rendered group (jobs and their images, in order), or with
    ``jobs`` None the batch's end (metrics, requeues, release from ``current``)."""

    work: BatchWork
    jobs: list[StartedJob] | None = None
    images: list[Image.Image] | None = None
