"""The catalog run loop: skip what has an image, wait for what is in flight, submit the rest.

Place in the data flow: plans (:mod:`producer.catalog.plan`) → ``POST /v1/catalog/lookup`` →
``POST /v1/batches`` in chunks (:mod:`producer.catalog.chunks`) → batch polling → outcomes per
content key → the report (:mod:`producer.catalog.report`). Every API call goes through
:class:`RenderClient`, whose retry policy rides out 429s and API restarts; chunks carry an
idempotency key derived from their keys.

An item is skipped only on the farm's word that its image exists: the lookup answers
``succeeded`` only after a HEAD of the image (:mod:`infra.state.catalog_index`). That holds for items
a ``--state-dir`` records as done too: they are looked up with the others (10,000 keys per
request, :attr:`CatalogRun.concurrency` requests in flight), and one whose image is gone (a wiped
bucket, a deleted object) is rendered again and recorded anew.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from infra.schemas import MAX_LOOKUP_KEYS
from producer.catalog.chunks import ChunkSubmitter
from producer.catalog.plan import Plan
from producer.catalog.report import Outcome, build_report
from producer.client import NotFoundError, RenderClient, RenderFarmError

#: Most jobs one chunk (one POST /v1/batches) may carry.
MAX_CHUNK = 10_000


class StateDir:
    """``--state-dir``: an append-only ``succeeded.jsonl`` of keys that had an image when their
    run recorded them (the farm still confirms each before a later run skips it; see the module
    docstring). A key recorded twice maps to its last job."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.file = self.path / "succeeded.jsonl"

    def load(self) -> dict[str, str]:
        """Key → job id of every recorded success (a torn last line is ignored)."""
        out = {}
        if self.file.exists():
            for line in self.file.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                    out[rec["key"]] = rec["job_id"]
                except (ValueError, KeyError, TypeError):
                    continue
        return out

    def add(self, records: Iterable[tuple[str, str]]) -> None:
        """Append ``(key, job_id)`` successes and flush them to disk (on a line of their own after
        a torn last line, which would otherwise swallow the first of them)."""
        lines = "".join(json.dumps({"key": k, "job_id": j}) + "\n" for k, j in records)
        if lines:
            if self.file.exists() and self.file.stat().st_size:
                with self.file.open("rb") as f:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        lines = "\n" + lines
            with self.file.open("a", encoding="utf-8") as f:
                f.write(lines)
                f.flush()


@dataclass
class CatalogRun:
    """One run over planned items (see the module docstring for what is skipped, waited for and
    submitted). Call :meth:`run`; read :attr:`outcomes` and :meth:`report`."""

    client: RenderClient
    plans: list[Plan]
    chunk_size: int = 1000
    concurrency: int = 4
    poll_s: float = 1.0
    polls_per_round: int = 10
    timeout_s: float | None = None
    priority: str = "normal"
    progress: bool = False
    state: StateDir | None = None
    manifest: bool = True                                           # the report asks the farm where the images are
    outcomes: dict[str, Outcome] = field(default_factory=dict)      # key → outcome
    batches: list[str] = field(default_factory=list)
    resumed: int = 0
    recorded: dict[str, int] | None = None                          # --state-dir: recorded, confirmed, unconfirmed
    interrupted: bool = False
    wall_s: float = 0.0

    def __post_init__(self):
        self.requests = {p.key: p.request for p in self.plans if p.key and p.request is not None}  # both or neither
        self.job_key: dict[str, str] = {}                            # job id → key (jobs we wait for)
        self.waiting: dict[str, set[str]] = defaultdict(set)         # batch id → keys
        self.submitted_ok = 0
        self.chunks = ChunkSubmitter(self.client, self.requests, priority=self.priority,
                                     inputs={p.key: p.inputs for p in self.plans if p.key and p.inputs})

    # -- steps ---------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], pool: ThreadPoolExecutor) -> list[str]:
        """Sort keys into skipped / waited-for; return those to submit."""
        chunks = [keys[i:i + MAX_LOOKUP_KEYS] for i in range(0, len(keys), MAX_LOOKUP_KEYS)]
        to_submit = []
        for chunk, entries in zip(chunks, pool.map(lambda chunk: self.client.catalog_lookup(chunk), chunks)):
            for key in chunk:
                entry = entries.get(key)
                if entry is None:
                    to_submit.append(key)
                elif entry["state"] == "succeeded":
                    self.outcomes[key] = Outcome("skipped", entry["job_id"])
                elif entry["state"] in ("queued", "running"):
                    self._wait_for(key, entry["job_id"], entry["batch_id"])
                    self.resumed += 1
                else:
                    self.chunks.prev_job[key] = entry["job_id"]
                    to_submit.append(key)
        return to_submit

    def _wait_for(self, key: str, job_id: str, batch_id: str) -> None:
        self.job_key[job_id] = key
        self.waiting[batch_id].add(key)
        if batch_id not in self.batches:
            self.batches.append(batch_id)

    def _poll(self, batch_id: str) -> None:
        """Resolve the keys of ``batch_id`` once it is done; a vanished batch's keys are resubmitted."""
        try:
            status = self.client.batch(batch_id, limit=0)
        except NotFoundError:
            self._orphans.extend(self.waiting.pop(batch_id, ()))
            return
        self._terminal[batch_id] = sum(status.counts.get(s, 0) for s in ("succeeded", "failed", "canceled"))
        if not status.done:
            return
        jobs = self.client.batch_jobs(batch_id)
        done = []
        for job in jobs:
            key = self.job_key.get(job.job_id)
            if key is None or key in self.outcomes:
                continue
            if job.state == "succeeded":
                self.outcomes[key] = Outcome("rendered", job.job_id)
                done.append((key, job.job_id))
            else:
                error = job.error.model_dump() if job.error else {"type": "Canceled", "message": f"job {job.state}"}
                self.outcomes[key] = Outcome("failed", job.job_id, error)
        if self.state is not None:
            self.state.add(done)
        for key in self.waiting.pop(batch_id, ()):
            self.outcomes.setdefault(key, Outcome("failed", None, {"type": "Lost", "message":
                                                                    f"job not found in batch {batch_id}"}))
        self._terminal.pop(batch_id, None)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> "CatalogRun":
        """Skip, submit and wait until every key has an outcome (or ``timeout_s`` passes).

        Raises ``KeyboardInterrupt`` after recording ``interrupted`` (jobs already submitted keep
        rendering; a re-run waits for them). API errors other than refusals propagate.
        """
        started = time.monotonic()
        self._orphans: list[str] = []
        self._terminal: dict[str, int] = {}
        keys = list(self.requests)
        known = self.state.load() if self.state else {}
        bar = tqdm(total=len(keys), unit="img", desc="catalog", disable=not self.progress, file=sys.stderr,
                   dynamic_ncols=True)
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="catalog")
        try:
            pending = self._lookup(keys, pool)  # the keys --state-dir records too: the farm confirms each image
            recorded_note = ""
            if self.state is not None:
                recorded = [k for k in keys if k in known]
                confirmed = sum(1 for k in recorded if k in self.outcomes and self.outcomes[k].state == "skipped")
                self.recorded = {"recorded": len(recorded), "confirmed": confirmed,
                                 "unconfirmed": len(recorded) - confirmed}
                recorded_note = (f" ({len(recorded)} recorded in --state-dir, {len(recorded) - confirmed} of them "
                                 f"without an image now)")
            tqdm.write(f"catalog: {len(self.plans)} items, {len(keys)} distinct renders (images or videos): "
                       f"{len(self.outcomes)} already rendered{recorded_note}, {self.resumed} in flight from an "
                       f"earlier run, {len(pending)} to submit", file=sys.stderr)
            sys.stderr.flush()
            futures: set[Future] = set()
            round_robin: list[str] = []
            last_log = time.monotonic()
            while True:
                if self._orphans:
                    pending.extend(self._orphans)
                    self._orphans = []
                while pending:
                    chunk, pending = pending[:self.chunk_size], pending[self.chunk_size:]
                    futures.add(pool.submit(self.chunks.submit, chunk))
                for future in [f for f in futures if f.done()]:
                    futures.discard(future)
                    ok, errors = future.result()
                    for key, job_id, batch_id in ok:
                        self._wait_for(key, job_id, batch_id)
                    self.submitted_ok += len(ok)
                    for key, error in errors.items():
                        self.outcomes[key] = Outcome("failed", None, error)
                if not round_robin:
                    round_robin = [b for b in self.waiting]
                for batch_id in round_robin[:self.polls_per_round]:
                    self._poll(batch_id)
                round_robin = [b for b in round_robin[self.polls_per_round:] if b in self.waiting]
                self._show(bar, len(keys))
                if not futures and not self.waiting and not self._orphans:
                    break
                if self.timeout_s is not None and time.monotonic() - started > self.timeout_s:
                    self._time_out()
                    break
                if not self.progress and time.monotonic() - last_log > 30:
                    last_log = time.monotonic()
                    print(f"catalog: {self._done_count()}/{len(keys)} images done, {self._counts()}", file=sys.stderr)
                if futures:
                    wait_futures(futures, timeout=self.poll_s, return_when=FIRST_COMPLETED)
                else:
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            self.interrupted = True
            raise
        finally:
            pool.shutdown(wait=not self.interrupted, cancel_futures=True)
            self._show(bar, len(keys))
            bar.close()
            self.wall_s = time.monotonic() - started
        return self

    def _time_out(self) -> None:
        for keys in self.waiting.values():
            for key in keys:
                self.outcomes.setdefault(key, Outcome("failed", None, {
                    "type": "Timeout", "message": f"not finished after {self.timeout_s:g} s; "
                                                  f"a re-run waits for it"}))
        self.waiting.clear()

    def _counts(self) -> dict[str, int]:
        counts = {"rendered": 0, "skipped": 0, "failed": 0}
        for outcome in self.outcomes.values():
            counts[outcome.state] += 1
        return counts

    def _done_count(self) -> int:
        in_flight = sum(min(self._terminal.get(b, 0), len(ks)) for b, ks in self.waiting.items())
        return len(self.outcomes) + in_flight

    def _show(self, bar: tqdm, total: int) -> None:
        bar.n = min(total, self._done_count())
        bar.set_postfix(self._counts(), refresh=False)
        bar.refresh()

    # -- the report ------------------------------------------------------------------------------
    def report(self, **context: Any) -> dict[str, Any]:
        """The JSON report of this run (:func:`producer.catalog.report.build_report`), with
        ``context`` (file, template, model, times) first and the manifest of the images' S3 keys
        and presigned URLs (one more catalog lookup of the keys that have an image), unless
        :attr:`manifest` is off; with a state dir, ``state_dir``: its keys ``recorded`` in this
        catalog, ``confirmed`` by the farm (skipped) and ``unconfirmed`` (no image now)."""
        imaged = [key for key, outcome in self.outcomes.items() if outcome.state in ("rendered", "skipped")]
        if self.recorded is not None:
            context = {**context, "state_dir": self.recorded}
        if not self.manifest:
            return build_report(self, context)
        located: dict[str, dict | None] = {}
        try:
            for start in range(0, len(imaged), MAX_LOOKUP_KEYS):
                located.update(self.client.catalog_lookup(imaged[start:start + MAX_LOOKUP_KEYS]))
        except (RenderFarmError, NotFoundError, httpx.HTTPError) as exc:
            return build_report(self, context, located, located_error=f"{type(exc).__name__}: {exc}")
        return build_report(self, context, located)
