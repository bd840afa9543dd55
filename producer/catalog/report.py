"""The catalog run's outcomes per content key, and its JSON report.

Place in the data flow: the run loop (:mod:`producer.catalog.run`) records an :class:`Outcome`
per content key → **the report**, per item, which ``renderfarm catalog --report`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from producer.catalog.plan import Plan


@dataclass
class Outcome:
    """What became of one content key: ``skipped`` (an image existed), ``rendered`` or
    ``failed`` (with ``error``: ``{"type", "message"}``), and the job that rendered it."""

    state: str
    job_id: str | None = None
    error: dict[str, str] | None = None


class RunState(Protocol):
    """What the report reads of a run (:class:`producer.catalog.run.CatalogRun`)."""

    plans: list[Plan]
    outcomes: dict[str, Outcome]
    requests: dict
    resumed: int
    interrupted: bool
    batches: list[str]
    wall_s: float


def build_report(run: RunState, context: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: counts per item (an item sharing its key with an earlier one shares its
    outcome), failures with reasons, wall seconds and images/s (distinct images rendered)."""
    counts = {"rendered": 0, "skipped": 0, "failed": 0, "pending": 0}
    failures = []
    for plan in run.plans:
        outcome = run.outcomes.get(plan.key) if plan.key else Outcome("failed", None, plan.error)
        state = outcome.state if outcome else "pending"
        counts[state] += 1
        if outcome is not None and state == "failed":
            failures.append({"index": plan.item.index, "line": plan.item.line, "id": plan.item.id,
                             "key": plan.key, "job_id": outcome.job_id, "error": outcome.error})
    rendered_images = sum(1 for o in run.outcomes.values() if o.state == "rendered")
    return {
        **context,
        "items": len(run.plans),
        "distinct_images": len(run.requests),
        **counts,
        "resumed": run.resumed,
        "interrupted": run.interrupted,
        "failures": failures,
        "batches": run.batches,
        "wall_seconds": round(run.wall_s, 3),
        "images_per_second": round(rendered_images / run.wall_s, 3) if run.wall_s > 0 else 0.0,
    }
