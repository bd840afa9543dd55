"""The fault table: one row per fault scenario, whichever test package runs it.

Place: beside the tests. The fault-injection scenarios (``tests/faults``) and those that need
another fixture set (scenario o, ``tests/integration/security/test_probe.py``) account for their
jobs with :func:`account_row` and record the row with :func:`record_row`: it is printed, merged
into ``test-artifacts/faults.json`` (by scenario, under a file lock: pytest-xdist workers record
at the same time) and kept until ``tests/conftest.py`` moves it into the report of the test phase
that recorded it (:func:`take_recorded`). The process that prints the session's summary (the
xdist controller, or the one pytest process) gathers the rows from those reports
(:func:`collect`), so the table at the end holds every worker's rows. This module imports no
test package, so either may import it without a cycle.

Columns (:data:`COLUMNS`): jobs ``submitted``; ``succeeded``, ``failed``, ``canceled`` (terminal
states); ``lost`` (a job not terminal at the end, or succeeded without its object in the
bucket); ``run_twice`` (a job rendered, or its object written, more than once: the worker's
``RENDERFARM_TEST_COUNTERS``); ``recovery_s`` (seconds, or None). A scenario's own extra columns
go to the JSON and the printed line, not the table.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

ARTIFACT = Path(__file__).resolve().parents[1] / "test-artifacts" / "faults.json"
TERMINAL = ("succeeded", "failed", "canceled")
COLUMNS = ("submitted", "succeeded", "failed", "canceled", "lost", "run_twice", "recovery_s")

_recorded: list[dict] = []  # recorded in this process, not yet in a test report
_collected: list[dict] = []  # gathered from the reports, for the session's table


def account_row(scenario: str, job_ids: Sequence[str], statuses: Sequence[Any], bucket_keys: Collection[str],
                renders: Mapping[str, int], writes: Mapping[str, int], recovery_s: float | None,
                **extra: Any) -> dict:
    """One row of the table for ``job_ids`` (not recorded; see :func:`record_row`).

    Args:
        statuses: each job's :class:`infra.schemas.JobStatus`, or None where its record is gone,
            in the order of ``job_ids``.
        bucket_keys: the S3 keys that exist in the scenario's bucket (at least those of the jobs).
        renders, writes: per job id, completed renders and object writes that really wrote.
        recovery_s: seconds the scenario took to recover, or None.
        extra: the scenario's own columns.
    """
    counts = {state: sum(1 for s in statuses if s is not None and s.state == state) for state in TERMINAL}
    missing_object = sum(1 for s in statuses if s is not None and s.state == "succeeded"
                         and (s.result is None or s.result.key not in bucket_keys))
    unfinished = sum(1 for s in statuses if s is None or s.state not in TERMINAL)
    run_twice = sum(1 for j in job_ids if renders.get(j, 0) > 1 or writes.get(j, 0) > 1)
    return {"scenario": scenario, "submitted": len(job_ids), **counts, "lost": unfinished + missing_object,
            "run_twice": run_twice, "recovery_s": None if recovery_s is None else round(recovery_s, 1), **extra}


def record_row(row: dict) -> None:
    """Print the row (with its extra columns), keep it for the summary, and merge it into
    ``test-artifacts/faults.json``."""
    extra = {k: v for k, v in row.items() if k != "scenario" and k not in COLUMNS}
    print("\n" + format_row(row) + ("  " + json.dumps(extra) if extra else ""))
    _recorded.append(row)
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    with open(ARTIFACT.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            rows = {r["scenario"]: r for r in json.loads(ARTIFACT.read_text())["rows"]}
        except (OSError, ValueError, KeyError, TypeError):
            rows = {}
        rows[row["scenario"]] = row
        ARTIFACT.write_text(json.dumps({"rows": sorted(rows.values(), key=lambda r: r["scenario"])}, indent=2)
                            + "\n")


def format_row(row: dict) -> str:
    """The row as a Markdown table line: the scenario and :data:`COLUMNS` (None as "–")."""
    cells = [str(row["scenario"])] + ["–" if row.get(c) is None else str(row[c]) for c in COLUMNS]
    return "| " + " | ".join(cells) + " |"


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table of ``rows``, sorted by scenario."""
    header = "| scenario | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " |"
    rule = "|" + "---|" * (len(COLUMNS) + 1)
    return "\n".join([header, rule, *(format_row(r) for r in sorted(rows, key=lambda r: r["scenario"]))])


def take_recorded() -> list[dict]:
    """The rows this process recorded since the last call (and forgets them)."""
    taken = list(_recorded)
    _recorded.clear()
    return taken


def collect(row: dict) -> None:
    """Keep ``row``, read from a test report, for the session's table."""
    _collected.append(row)


def rows() -> list[dict]:
    """The rows gathered in this session (every pytest-xdist worker's)."""
    return list(_collected)
