"""The catalog run's outcomes per content key, and its JSON report.

Place in the data flow: the run loop (:mod:`producer.catalog.run`) records an :class:`Outcome`
per content key → **the report**, per item, which ``renderfarm catalog --report`` writes. Its
``manifest`` says where each item's image is: item id → S3 key → presigned GET URL (from a last
``POST /v1/catalog/lookup`` of the run's keys; the URLs last ``RENDERFARM_PRESIGN_EXPIRES_S``).
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


def _inputs_of(plan: Plan) -> dict[str, str]:
    request = plan.request
    if request is None:
        return {}
    control = request.controls[0].image if request.controls else None
    return {column: value for column, value in (("image", request.init_image), ("mask", request.mask_image),
                                                ("control_image", control)) if value is not None}


def manifest(plans: list[Plan], located: dict[str, dict | None]) -> list[dict[str, Any]]:
    """Per item whose content key has an image in ``located`` (catalog key → lookup entry with
    ``result_key`` and ``url``), in item order: ``index``, ``line``, ``id``, ``key`` (content
    key), ``job_id``, ``s3_key`` and ``url``; for an item with input images, ``inputs``: column →
    the input's key (``inputs/<sha256>.<ext>``, naming its hash) or URL."""
    out = []
    for plan in plans:
        entry = located.get(plan.key) if plan.key else None
        if entry and entry.get("result_key"):
            out.append({"index": plan.item.index, "line": plan.item.line, "id": plan.item.id, "key": plan.key,
                        "job_id": entry.get("job_id"), "s3_key": entry["result_key"], "url": entry.get("url"),
                        **({"inputs": inputs} if (inputs := _inputs_of(plan)) else {})})
    return out


def build_report(run: RunState, context: dict[str, Any], located: dict[str, dict | None] | None = None,
                 located_error: str | None = None) -> dict[str, Any]:
    """The JSON report: counts per item (an item sharing its key with an earlier one shares its
    outcome), failures with reasons, wall seconds and images/s (distinct images rendered), and
    the :func:`manifest` of ``located`` (``manifest_error`` says why it is missing)."""
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
        **({"manifest": manifest(run.plans, located)} if located is not None else {}),
        **({"manifest_error": located_error} if located_error else {}),
    }
