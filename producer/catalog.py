"""``renderfarm catalog``: render a catalog file (CSV or JSON Lines) through the farm, idempotently.

Data flow: catalog file → **here**: one :class:`~infra.schemas.RenderRequest` per item (prompt
from ``--template``, parameters, a seed) and its content key → ``POST /v1/catalog/lookup``
(which keys already have an image, which have a job in flight) → ``POST /v1/batches`` in chunks,
for the rest only → workers → S3 → **here** again: batch polling, a progress bar, the report.

Content-addressed keys: an item's key is the SHA-256 of its model, prompt, negative prompt,
parameters (size, steps, guidance, scheduler, format) and seed. Its seed is the item's ``seed``
field, or else derived from that same content, so a re-run computes the same keys. Each job
carries its key as ``metadata["catalog_key"]``; the API indexes key → job per tenant
(:mod:`infra.state.catalog`), and that index, kept by the farm, is what makes runs idempotent
and resumable on a fresh machine (a CronJob pod has no local state):

* a key whose job succeeded, or whose image is in the bucket, is **skipped**;
* a key whose job is queued or running (an interrupted earlier run) is **waited for**, never
  submitted again;
* a key that is unknown, failed or canceled is **submitted**.

So an unchanged catalog renders nothing, a changed item renders only itself, and a run stopped
with Ctrl-C resumes where it stopped. Each chunk has an ``idempotency_key`` derived from its
keys, so retrying a request whose answer was lost returns the first batch. ``--state-dir`` adds
a local record of succeeded keys, which then skip without asking the farm.

An item's fields fill the template's ``{field}`` placeholders; fields named like parameters
(``seed``, ``width``, ``height``, ``steps``, ``guidance_scale``, ``negative_prompt``,
``scheduler``, ``output_format``, ``model``) also set them, over the command line's defaults.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import string
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError
from tqdm import tqdm

from infra.schemas import RenderRequest
from infra.state.catalog import CATALOG_KEY_FIELD, MAX_LOOKUP_KEYS
from producer.client import NotFoundError, RenderClient, RenderFarmError

__all__ = ["CatalogError", "Item", "Plan", "Template", "content_key", "derive_seed", "plan_items",
           "prepare_catalog", "read_catalog", "run_catalog", "register"]

#: Item fields that set request parameters (field name → RenderRequest field).
PARAM_FIELDS = {"seed": "seed", "width": "width", "height": "height", "steps": "num_inference_steps",
                "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale",
                "negative_prompt": "negative_prompt", "scheduler": "scheduler", "output_format": "output_format",
                "model": "model"}
#: The request fields a content key covers (with ``seed``); metadata is not part of it.
KEY_FIELDS = ("model", "prompt", "negative_prompt", "width", "height", "num_inference_steps", "guidance_scale",
              "scheduler", "output_format")
MAX_CHUNK = 10_000
_RETRY_STATUSES = {429, 500, 502, 503, 504}


class CatalogError(ValueError):
    """The catalog file or the template cannot be used at all (exit status 2); the message says why."""


# ---- reading ------------------------------------------------------------------------------
@dataclass
class Item:
    """One catalog entry: its 0-based ``index``, the 1-based ``line`` it ends on, its fields, or
    the ``problem`` that made the line unreadable."""

    index: int
    line: int
    fields: dict[str, Any]
    problem: str | None = None

    @property
    def id(self) -> str:
        """The item's ``id`` field, else ``line N``."""
        value = self.fields.get("id")
        return str(value) if value not in (None, "") else f"line {self.line}"


def detect_format(path: Path, text: str) -> str:
    """``csv`` or ``jsonl``: by extension (``.csv``; ``.jsonl``, ``.ndjson``, ``.json``), else by
    content (a first non-blank character ``{`` means JSON Lines)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    return "jsonl" if text.lstrip().startswith("{") else "csv"


def read_catalog(path: str | Path, fmt: str = "auto") -> tuple[str, list[Item]]:
    """Read every item of a catalog; returns ``(format, items)``.

    CSV needs a header row; every cell is a string and an empty cell counts as absent. JSON Lines
    holds one object per non-blank line; values keep their JSON types. An unreadable line or row
    becomes an item with a ``problem`` (it fails alone).

    Raises:
        CatalogError: the file is missing, not UTF-8, empty, or a CSV header is unusable.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise CatalogError(f"catalog {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise CatalogError(f"catalog {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise CatalogError(f"catalog {path} cannot be read: {exc.strerror or exc}") from None
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    items = _read_jsonl(text) if fmt == "jsonl" else _read_csv(path, text)
    if not items:
        raise CatalogError(f"catalog {path} holds no items")
    return fmt, items


def _read_csv(path: Path, text: str) -> list[Item]:
    reader = csv.DictReader(io.StringIO(text), restkey="\0extra")
    header = reader.fieldnames
    if not header:
        raise CatalogError(f"catalog {path}: a CSV catalog needs a header row")
    names = [h.strip() for h in header]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates or not all(names):
        raise CatalogError(f"catalog {path}: CSV header has " + (f"duplicate columns {duplicates}" if duplicates
                                                                   else "an empty column name"))
    reader.fieldnames = names
    items = []
    for row in reader:
        extra = row.pop("\0extra", None)
        fields = {k: v for k, v in row.items() if v not in (None, "")}
        problem = f"row has {len(extra)} more cell(s) than the header's {len(names)}" if extra else None
        items.append(Item(len(items), reader.line_num, fields, problem))
    return items


def _read_jsonl(text: str) -> list[Item]:
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            problem = None if isinstance(value, dict) else f"line is JSON {type(value).__name__}, not an object"
        except ValueError as exc:
            value, problem = {}, f"line is not valid JSON: {exc}"
        fields = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else {}
        items.append(Item(len(items), number, fields, problem))
    return items


# ---- templates ----------------------------------------------------------------------------
class TemplateFieldError(KeyError):
    """An item lacks a field its template needs."""


class _Strict(dict):
    def __missing__(self, name):
        raise TemplateFieldError(name)


class Template:
    """A ``str.format`` template over item fields, restricted to plain ``{name}`` placeholders
    (with an optional ``!conversion`` and a ``:spec`` without nested fields).

    Raises:
        CatalogError: unbalanced braces, positional ``{}``/``{0}``, attribute or index access
            (``{a.b}``, ``{a[0]}``), or a nested field in a format spec.
    """

    def __init__(self, text: str, option: str = "--template"):
        self.text, self.option = text, option
        fields: list[str] = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise CatalogError(f"{option} {text!r}: {exc}") from None
        for _literal, name, spec, _conversion in parsed:
            if name is None:
                continue
            if name == "" or name.isdigit():
                raise CatalogError(f"{option} {text!r}: positional placeholder {{{name}}}; name a field, "
                                   f"e.g. {{name}}")
            if "." in name or "[" in name:
                raise CatalogError(f"{option} {text!r}: placeholder {{{name}}} uses attribute or index access, "
                                   f"which templates do not allow; use a plain field name")
            if spec and ("{" in spec or "}" in spec):
                raise CatalogError(f"{option} {text!r}: placeholder {{{name}}} has a nested field in its format spec")
            if name not in fields:
                fields.append(name)
        self.fields = tuple(fields)

    def render(self, values: Mapping[str, Any]) -> str:
        """Fill the placeholders. Raises :class:`TemplateFieldError` (a field is absent) or
        ``ValueError`` (a format spec does not fit the value)."""
        return self.text.format_map(_Strict(values))


# ---- planning -----------------------------------------------------------------------------
def _canonical(request: RenderRequest, with_seed: bool) -> bytes:
    data = {k: getattr(request, k) for k in KEY_FIELDS}
    if with_seed:
        data["seed"] = request.seed
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def derive_seed(request: RenderRequest) -> int:
    """A seed in 0…2³²−1 derived from the request's content (``KEY_FIELDS``, not its seed)."""
    return int.from_bytes(hashlib.sha256(b"renderfarm-catalog-seed\0" + _canonical(request, False)).digest()[:4],
                          "big")


def content_key(request: RenderRequest) -> str:
    """The catalog key of a request: hex SHA-256 of its ``KEY_FIELDS`` and seed (which must be set)."""
    if request.seed is None:
        raise ValueError("a content key needs a seed")
    return hashlib.sha256(_canonical(request, True)).hexdigest()


@dataclass
class Plan:
    """An item, and either its request and key or why it cannot be rendered (``error``:
    ``{"type", "message"}``)."""

    item: Item
    request: RenderRequest | None = None
    key: str | None = None
    error: dict[str, str] | None = None


def _value(v: Any) -> Any:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False) if isinstance(v, (dict, list)) else v


def plan_item(item: Item, template: Template, defaults: Mapping[str, Any],
              negative: Template | None = None) -> Plan:
    """The request and content key of one item, or the reason it has none.

    ``defaults`` are RenderRequest fields from the command line (``model`` is required, so that
    the key never depends on the farm's default model); the item's parameter fields override them.
    """
    if item.problem:
        return Plan(item, error={"type": "InvalidItem", "message": item.problem})
    values = {k: _value(v) for k, v in item.fields.items()}
    try:
        params: dict[str, Any] = {"prompt": template.render(values), **defaults}
        if negative is not None and "negative_prompt" not in values:
            params["negative_prompt"] = negative.render(values)
    except TemplateFieldError as exc:
        have = ", ".join(sorted(values)) or "none"
        return Plan(item, error={"type": "TemplateError", "message": f"item {item.id!r} (line {item.line}) has no "
                                 f"field {exc.args[0]!r} for the template; its fields: {have}"})
    except (ValueError, TypeError) as exc:
        return Plan(item, error={"type": "TemplateError", "message": f"item {item.id!r} (line {item.line}): {exc}"})
    for name, target in PARAM_FIELDS.items():
        if name in values:
            params[target] = values[name]
    try:
        request = RenderRequest.model_validate({**params, "seed": None})
        seed = params.get("seed")
        seed = derive_seed(request) if seed is None else seed
        request = RenderRequest.model_validate({**params, "seed": seed})
    except ValidationError as exc:
        message = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
        return Plan(item, error={"type": "ValidationError", "message": message})
    key = content_key(request)
    metadata = {CATALOG_KEY_FIELD: key, "catalog_item": item.id[:1024]}
    return Plan(item, request.model_copy(update={"metadata": metadata}), key)


def plan_items(items: Sequence[Item], template: Template, defaults: Mapping[str, Any],
               negative: Template | None = None) -> list[Plan]:
    """:func:`plan_item` for every item.

    Raises:
        CatalogError: a template field that no item has (a typo, or the wrong catalog).
    """
    for tmpl in (template, negative):
        for name in (tmpl.fields if tmpl else ()):
            if not any(name in it.fields for it in items if not it.problem):
                raise CatalogError(f"{tmpl.option} {tmpl.text!r}: no item has a field {name!r}")
    return [plan_item(item, template, defaults, negative) for item in items]


# ---- local state --------------------------------------------------------------------------
class StateDir:
    """``--state-dir``: an append-only ``succeeded.jsonl`` of keys known to have an image."""

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
        """Append ``(key, job_id)`` successes and flush them to disk."""
        lines = "".join(json.dumps({"key": k, "job_id": j}) + "\n" for k, j in records)
        if lines:
            with self.file.open("a", encoding="utf-8") as f:
                f.write(lines)
                f.flush()


# ---- the run ------------------------------------------------------------------------------
def _retrying(call: Callable[[], Any], attempts: int = 8) -> Any:
    """``call()``, retried on 429/5xx answers (after ``Retry-After`` when given) and on transport
    errors, with exponential backoff capped at 30 s."""
    for attempt in range(attempts):
        try:
            return call()
        except RenderFarmError as exc:
            if exc.status_code not in _RETRY_STATUSES or attempt == attempts - 1:
                raise
            delay = exc.retry_after if exc.retry_after is not None else min(30.0, 2.0 ** attempt)
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
            delay = min(30.0, 2.0 ** attempt)
        time.sleep(delay)
    raise AssertionError("unreachable")


@dataclass
class _Outcome:
    state: str                      # skipped | rendered | failed
    job_id: str | None = None
    error: dict[str, str] | None = None


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
    outcomes: dict[str, _Outcome] = field(default_factory=dict)      # key → outcome
    batches: list[str] = field(default_factory=list)
    resumed: int = 0
    interrupted: bool = False
    wall_s: float = 0.0

    def __post_init__(self):
        self.requests = {p.key: p.request for p in self.plans if p.key}
        self.job_key: dict[str, str] = {}                            # job id → key (jobs we wait for)
        self.waiting: dict[str, set[str]] = defaultdict(set)         # batch id → keys
        self.prev_job: dict[str, str] = {}                           # key → its failed/canceled job
        self.submitted_ok = 0

    # -- steps ---------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], pool: ThreadPoolExecutor) -> list[str]:
        """Sort keys into skipped / waited-for; return those to submit."""
        chunks = [keys[i:i + MAX_LOOKUP_KEYS] for i in range(0, len(keys), MAX_LOOKUP_KEYS)]
        to_submit = []
        for chunk, entries in zip(chunks, pool.map(lambda c: _retrying(lambda: self.client.catalog_lookup(c)),
                                                   chunks)):
            for key in chunk:
                entry = entries.get(key)
                if entry is None:
                    to_submit.append(key)
                elif entry["state"] == "succeeded":
                    self.outcomes[key] = _Outcome("skipped", entry["job_id"])
                elif entry["state"] in ("queued", "running"):
                    self._wait_for(key, entry["job_id"], entry["batch_id"])
                    self.resumed += 1
                else:
                    self.prev_job[key] = entry["job_id"]
                    to_submit.append(key)
        return to_submit

    def _wait_for(self, key: str, job_id: str, batch_id: str) -> None:
        self.job_key[job_id] = key
        self.waiting[batch_id].add(key)
        if batch_id not in self.batches:
            self.batches.append(batch_id)

    def _submit(self, keys: list[str]) -> tuple[list[tuple[str, str, str]], dict[str, dict]]:
        """POST one chunk; returns ``([(key, job_id, batch_id)…], {key: error})``. A 413 splits
        the chunk in halves; a 422 fails its items with the API's reason."""
        ident = hashlib.sha256("\n".join(f"{k}:{self.prev_job.get(k, '')}" for k in keys).encode()).hexdigest()
        try:
            accepted = _retrying(lambda: self.client.submit_batch(
                [self.requests[k] for k in keys], priority=self.priority, idempotency_key=f"catalog-{ident}"))
        except RenderFarmError as exc:
            if exc.status_code == 413 and len(keys) > 1:
                half = len(keys) // 2
                (ok1, err1), (ok2, err2) = self._submit(keys[:half]), self._submit(keys[half:])
                return ok1 + ok2, {**err1, **err2}
            return [], self._refusal(keys, exc)
        except httpx.HTTPError as exc:
            return [], {k: {"type": "SubmitError", "message": f"{type(exc).__name__}: {exc}"} for k in keys}
        return [(k, j, accepted.batch_id) for k, j in zip(keys, accepted.job_ids)], {}

    @staticmethod
    def _refusal(keys: list[str], exc: RenderFarmError) -> dict[str, dict]:
        per_job: dict[int, str] = {}
        if exc.status_code == 422 and isinstance(exc.detail, list):
            for err in exc.detail:
                loc = err.get("loc", []) if isinstance(err, dict) else []
                if len(loc) > 2 and loc[:2] == ["body", "jobs"] and isinstance(loc[2], int):
                    per_job[loc[2]] = f"{'.'.join(str(x) for x in loc[3:])}: {err.get('msg')}"
        general = f"HTTP {exc.status_code}: {exc.detail}"
        return {k: {"type": "Refused", "message": per_job.get(i, general)[:2000]} for i, k in enumerate(keys)}

    def _poll(self, batch_id: str) -> None:
        """Resolve the keys of ``batch_id`` once it is done; a vanished batch's keys are resubmitted."""
        try:
            status = _retrying(lambda: self.client.batch(batch_id, limit=0))
        except NotFoundError:
            self._orphans.extend(self.waiting.pop(batch_id, ()))
            return
        self._terminal[batch_id] = sum(status.counts.get(s, 0) for s in ("succeeded", "failed", "canceled"))
        if not status.done:
            return
        jobs = _retrying(lambda: self.client.batch_jobs(batch_id))
        done = []
        for job in jobs:
            key = self.job_key.get(job.job_id)
            if key is None or key in self.outcomes:
                continue
            if job.state == "succeeded":
                self.outcomes[key] = _Outcome("rendered", job.job_id)
                done.append((key, job.job_id))
            else:
                error = job.error.model_dump() if job.error else {"type": "Canceled", "message": f"job {job.state}"}
                self.outcomes[key] = _Outcome("failed", job.job_id, error)
        if self.state is not None:
            self.state.add(done)
        for key in self.waiting.pop(batch_id, ()):
            self.outcomes.setdefault(key, _Outcome("failed", None, {"type": "Lost", "message":
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
        for key in keys:
            if key in known:
                self.outcomes[key] = _Outcome("skipped", known[key])
        bar = tqdm(total=len(keys), unit="img", desc="catalog", disable=not self.progress, file=sys.stderr,
                   dynamic_ncols=True)
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="catalog")
        try:
            pending = self._lookup([k for k in keys if k not in self.outcomes], pool)
            tqdm.write(f"catalog: {len(self.plans)} items, {len(keys)} distinct images: {len(self.outcomes)} already "
                       f"rendered, {self.resumed} in flight from an earlier run, {len(pending)} to submit",
                       file=sys.stderr)
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
                    futures.add(pool.submit(self._submit, chunk))
                for future in [f for f in futures if f.done()]:
                    futures.discard(future)
                    ok, errors = future.result()
                    for key, job_id, batch_id in ok:
                        self._wait_for(key, job_id, batch_id)
                    self.submitted_ok += len(ok)
                    for key, error in errors.items():
                        self.outcomes[key] = _Outcome("failed", None, error)
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
                self.outcomes.setdefault(key, _Outcome("failed", None, {
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
        """The JSON report: counts per item (an item sharing its key with an earlier one shares its
        outcome), failures with reasons, wall seconds and images/s (distinct images rendered)."""
        counts = {"rendered": 0, "skipped": 0, "failed": 0, "pending": 0}
        failures = []
        for plan in self.plans:
            outcome = self.outcomes.get(plan.key) if plan.key else _Outcome("failed", None, plan.error)
            state = outcome.state if outcome else "pending"
            counts[state] += 1
            if state == "failed":
                failures.append({"index": plan.item.index, "line": plan.item.line, "id": plan.item.id,
                                 "key": plan.key, "job_id": outcome.job_id, "error": outcome.error})
        rendered_images = sum(1 for o in self.outcomes.values() if o.state == "rendered")
        return {
            **context,
            "items": len(self.plans),
            "distinct_images": len(self.requests),
            **counts,
            "resumed": self.resumed,
            "interrupted": self.interrupted,
            "failures": failures,
            "batches": self.batches,
            "wall_seconds": round(self.wall_s, 3),
            "images_per_second": round(rendered_images / self.wall_s, 3) if self.wall_s > 0 else 0.0,
        }


def prepare_catalog(path: str | Path, template: str, *, model: str, params: Mapping[str, Any] | None = None,
                    negative_template: str | None = None, input_format: str = "auto") -> tuple[list[Plan], dict]:
    """Read and plan a catalog; returns the plans and the report's context (file, format,
    template, model). ``params`` are RenderRequest defaults (``width``, ``num_inference_steps``, …).

    Raises:
        CatalogError: the file or a template is unusable (nothing has been sent).
    """
    tmpl = Template(template)
    negative = Template(negative_template, "--negative-template") if negative_template is not None else None
    fmt, items = read_catalog(path, input_format)
    plans = plan_items(items, tmpl, {"model": model, **(params or {})}, negative)
    return plans, {"catalog": str(path), "format": fmt, "template": template, "model": model}


def run_catalog(path: str | Path, template: str, *, client: RenderClient, model: str,
                params: Mapping[str, Any] | None = None, negative_template: str | None = None,
                input_format: str = "auto", **run_options: Any) -> dict[str, Any]:
    """Read, plan and run a catalog to the end; returns the report. ``run_options`` go to
    :class:`CatalogRun`. Raises :class:`CatalogError` as :func:`prepare_catalog` does."""
    plans, context = prepare_catalog(path, template, model=model, params=params,
                                     negative_template=negative_template, input_format=input_format)
    run = CatalogRun(client, plans, **run_options)
    context["started_at"] = datetime.now(UTC).isoformat()
    run.run()
    return run.report(**context, finished_at=datetime.now(UTC).isoformat())


# ---- CLI ----------------------------------------------------------------------------------
def _write_report(path: str | None, report: dict[str, Any]) -> None:
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        tmp.replace(target)


def cmd_catalog(args: argparse.Namespace) -> int:
    """``renderfarm catalog``. Exit status: 0 all items rendered or skipped, 1 some failed, 2 the
    catalog, template or API could not be used, 130 interrupted (re-run to resume)."""
    from infra.settings import get_settings

    params = {k: v for k, v in {"width": args.width, "height": args.height, "num_inference_steps": args.steps,
                                "guidance_scale": args.guidance_scale, "scheduler": args.scheduler,
                                "output_format": args.format}.items() if v is not None}
    if not 1 <= args.chunk_size <= MAX_CHUNK:
        print(f"error: --chunk-size must be 1…{MAX_CHUNK}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        plans, context = prepare_catalog(args.file, args.template, model=args.model or get_settings().default_model,
                                         params=params, negative_template=args.negative_template,
                                         input_format=args.input_format)
    except CatalogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _write_report(args.report, {"catalog": args.file, "error": str(exc)})
        return 2
    context["started_at"] = datetime.now(UTC).isoformat()
    with RenderClient() as client:
        run = CatalogRun(client, plans, chunk_size=args.chunk_size, poll_s=args.poll_interval,
                         timeout_s=args.timeout, priority=args.priority, progress=progress,
                         state=StateDir(args.state_dir) if args.state_dir else None)
        try:
            run.run()
        except KeyboardInterrupt:
            report = run.report(**context, finished_at=datetime.now(UTC).isoformat())
            _write_report(args.report, report)
            print(f"interrupted: {report['rendered']} rendered, {report['skipped']} skipped, {report['failed']} "
                  f"failed, {report['pending']} pending; jobs already submitted keep rendering, a re-run resumes",
                  file=sys.stderr)
            return 130
        except (RenderFarmError, NotFoundError, httpx.HTTPError) as exc:
            print(f"error: the API failed: {exc}", file=sys.stderr)
            _write_report(args.report, {**context, "error": f"{type(exc).__name__}: {exc}"})
            return 2
    report = run.report(**context, finished_at=datetime.now(UTC).isoformat())
    _write_report(args.report, report)
    for failure in report["failures"][:20]:
        print(f"failed: item {failure['id']!r} (line {failure['line']}): {failure['error']['type']}: "
              f"{failure['error']['message']}", file=sys.stderr)
    if len(report["failures"]) > 20:
        print(f"… and {len(report['failures']) - 20} more failures (see the report)", file=sys.stderr)
    print(f"{report['items']} items: {report['rendered']} rendered, {report['skipped']} skipped, "
          f"{report['failed']} failed in {report['wall_seconds']:.1f} s ({report['images_per_second']:.2f} images/s)",
          file=sys.stderr)
    return 1 if report["failed"] or report["pending"] else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm catalog`` to the CLI."""
    p = subparsers.add_parser("catalog", help="render a CSV / JSON Lines catalog; items already rendered are skipped")
    p.add_argument("file", help="the catalog: CSV with a header row, or JSON Lines")
    p.add_argument("--template", required=True, help='prompt template, e.g. "a photo of {name}, {color}"')
    p.add_argument("--negative-template", help="negative prompt template (an item's negative_prompt field wins)")
    p.add_argument("--model", help="model of every item without a model field (default: RENDERFARM_DEFAULT_MODEL)")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--guidance-scale", type=float)
    p.add_argument("--scheduler")
    p.add_argument("--format", choices=["png", "webp", "jpeg"], help="image format")
    p.add_argument("--input-format", choices=["auto", "csv", "jsonl"], default="auto",
                   help="catalog format (default: by extension, else sniffed)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--state-dir", help="also remember succeeded items here (they skip without asking the farm)")
    p.add_argument("--chunk-size", type=int, default=1000, help=f"jobs per batch, 1…{MAX_CHUNK} (default 1000)")
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--timeout", type=float, help="seconds to wait in all; unfinished items count as failed")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between status polls")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal; else a line every 30 s)")
    p.set_defaults(func=lambda a: sys.exit(cmd_catalog(a)))
