"""The catalog index: content-addressed catalog keys → the job that renders each one.

Data flow: the catalog runner (:mod:`producer.catalog`) computes one content key per item
(SHA-256 of model, prompts, parameters and seed) and sends it as ``metadata["catalog_key"]`` →
submission (:mod:`infra.submission.submitter`) **records key → job here**, before the job records are
written → workers render → the runner's next run asks ``POST /v1/catalog/lookup``, **answered
here**, which items already have an image (skip), which are still in flight (wait for them, never
submit again) and which need a render (unknown, failed or canceled).

Redis keys (:mod:`infra.keys`):
    rf:catalog:{tenant}   hash: catalog key → JSON ``{"job", "batch", "fmt", "t"}`` (``t``:
                          when it was recorded, epoch seconds); once seen
                          succeeded, ``{"job", "batch", "key", "ok": 1}`` ("promoted")

Job records expire after ``job_ttl_s`` (a week by default), images do not. A promoted entry is
answered without its job record, so a nightly catalog finds last month's images; an entry not
yet promoted whose job record has expired is answered by a HEAD of the image's S3 key, and
dropped when there is no image. Every ``succeeded`` answer is confirmed by a HEAD of its image
(``exists``): an entry whose image is gone (the local stack's bucket wiped, an object deleted)
is dropped and answered unknown, so the catalog renders the item again instead of skipping it.
Entries are per tenant: one tenant never learns of, nor skips on, another tenant's renders.
Index writes are compare-and-set, so a lookup never overwrites an entry that a newer submission
wrote meanwhile.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import redis
from pydantic import BaseModel, Field, field_validator

from infra import keys
from infra.schemas import CATALOG_KEY_FIELD, MAX_LOOKUP_KEYS, JobError, JobState
from infra.state.job_store import JobStore, NewJob

#: ``(batch_id, job_id, output_format) → the S3 key of the job's image if the image exists, else
#: None``; the API passes one that asks the bucket (a HEAD), so this module needs no S3 client.
ImageLocator = Callable[[str, str, str], "str | None"]

#: A catalog key: 64 lowercase hex digits (a SHA-256).
KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
#: Seconds an entry whose job record does not exist yet is taken for a submission under way
#: (answered ``queued``), before it counts as a failed submission and is dropped.
SUBMITTING_GRACE_S = 60.0

# Replace (ARGV[3] non-empty) or delete (ARGV[3] empty) field ARGV[1] only if it still holds ARGV[2].
_CAS = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then return redis.call('HDEL', KEYS[1], ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def record(client: redis.Redis, tenant: str, batch_id: str, jobs: Sequence[NewJob]) -> int:
    """Point the catalog key of every job that carries one at that job, in one round trip.

    Called before the job records are written, so an index entry may briefly name a job that
    does not exist yet (or never will, if the submission then fails): for
    :data:`SUBMITTING_GRACE_S` a lookup answers such an entry ``queued``, later it treats it like
    one whose record expired. Returns the number of entries written.
    """
    entries = {}
    for job in jobs:
        key = job.request.metadata.get(CATALOG_KEY_FIELD)
        if key:
            fmt = "mp4" if job.request.is_video else job.request.output_format  # a video's file is {job}.mp4
            entries[key] = json.dumps({"job": job.job_id, "batch": batch_id, "fmt": fmt,
                                       "t": round(time.time(), 3)})
    if entries:
        client.hset(keys.catalog(tenant), mapping=entries)
    return len(entries)


class CatalogLookup(BaseModel):
    """Body of ``POST /v1/catalog/lookup``: up to 10,000 catalog keys."""

    keys: list[str] = Field(min_length=1, max_length=MAX_LOOKUP_KEYS)

    @field_validator("keys")
    @classmethod
    def _hex_keys(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if not KEY_PATTERN.match(key):
                raise ValueError(f"keys[{i}] must be 64 lowercase hex digits (a SHA-256), got {key[:80]!r}")
        return keys


class CatalogEntry(BaseModel):
    """What the farm knows of one catalog key: the job that renders it and that job's state.

    ``result_key`` is the image's S3 key once the job succeeded, ``url`` a presigned GET of it
    (the API adds it); ``error`` is set for a failed job.
    """

    job_id: str
    batch_id: str
    state: JobState
    result_key: str | None = None
    url: str | None = None
    error: JobError | None = None


class CatalogLookupResult(BaseModel):
    """Answer of ``POST /v1/catalog/lookup``: per key asked, its entry, or null when no image
    exists and no job is rendering it."""

    entries: dict[str, CatalogEntry | None]


class CatalogIndex:
    """Lookups in the catalog index of the job-state store's Redis.

    Args:
        store: the job-state store (its Redis client holds the index).
        locate: finds the image of a job whose record has expired (see :data:`ImageLocator`);
            None answers such keys as unknown.
        head_concurrency: ``locate`` and ``exists`` calls in flight at once (S3 HEAD requests).
        exists: whether an S3 key holds an object (a HEAD); every ``succeeded`` answer is
            confirmed with it, and a key whose image is gone (a wiped bucket) is dropped from the
            index and answered unknown, so the catalog renders it again. None: not checked.
    """

    def __init__(self, store: JobStore, locate: ImageLocator | None, head_concurrency: int = 8,
                 exists: Callable[[str], bool] | None = None):
        self.store = store
        self.r = store.r
        self.locate = locate
        self.exists = exists
        self.head_concurrency = head_concurrency
        self._cas = self.r.register_script(_CAS)

    def lookup(self, tenant: str, catalog_keys: Sequence[str]) -> dict[str, CatalogEntry | None]:
        """The entry of each key for ``tenant``: a few round trips whatever the number of keys,
        plus one S3 HEAD per key whose job record expired before the lookup saw it succeed."""
        wanted = list(dict.fromkeys(catalog_keys))
        hkey = keys.catalog(tenant)
        raw = dict(zip(wanted, self.r.hmget(hkey, wanted))) if wanted else {}
        found = {k: (v, json.loads(v)) for k, v in raw.items() if v}
        out: dict[str, CatalogEntry | None] = dict.fromkeys(wanted)
        live = [k for k, (_, e) in found.items() if not e.get("ok")]
        for key, status in zip(live, self.store.get_jobs([found[k][1]["job"] for k in live])):
            if status is None:
                continue
            result_key = status.result.key if status.result else None
            out[key] = CatalogEntry(job_id=status.job_id, batch_id=status.batch_id, state=status.state,
                                    result_key=result_key, error=status.error)
            if status.state == "succeeded" and result_key:
                self._promote(hkey, key, found[key][0], found[key][1], result_key)
        for key, (_, entry) in found.items():
            if entry.get("ok"):
                out[key] = CatalogEntry(job_id=entry["job"], batch_id=entry["batch"], state="succeeded",
                                        result_key=entry["key"])
        expired = [k for k in live if out[k] is None]
        if expired:
            self._resolve_expired(hkey, expired, found, out)
        self._confirm_images(hkey, found, out)
        return out

    def _confirm_images(self, hkey: str, found: dict, out: dict) -> None:
        """HEAD the image of every ``succeeded`` answer; one that is gone is dropped from the index
        and answered None (render it again)."""
        done = [k for k, e in out.items() if e is not None and e.state == "succeeded" and e.result_key]
        exists = self.exists
        if exists is None or not done:
            return
        with ThreadPoolExecutor(max_workers=min(self.head_concurrency, len(done))) as pool:
            present = list(pool.map(lambda k: exists(out[k].result_key), done))
        for key, ok in zip(done, present):
            if not ok:
                self._cas(keys=[hkey], args=[key, self.r.hget(hkey, key) or found[key][0], ""])
                out[key] = None

    def _promote(self, hkey: str, key: str, old_raw: str, entry: dict, result_key: str) -> None:
        new = json.dumps({"job": entry["job"], "batch": entry["batch"], "key": result_key, "ok": 1})
        self._cas(keys=[hkey], args=[key, old_raw, new])

    def _resolve_expired(self, hkey: str, expired: list[str], found: dict, out: dict) -> None:
        """Keys whose job record is gone: an image in the bucket makes them succeeded (promoted);
        without one, a fresh entry is a submission under way (``queued``), an older one is dropped."""

        def head(key: str) -> str | None:
            entry = found[key][1]
            return None if self.locate is None else self.locate(entry["batch"], entry["job"],
                                                                entry.get("fmt", "png"))

        with ThreadPoolExecutor(max_workers=min(self.head_concurrency, len(expired))) as pool:
            located = list(pool.map(head, expired))
        now = time.time()
        for key, result_key in zip(expired, located):
            old_raw, entry = found[key]
            if result_key is None and now - float(entry.get("t", 0)) < SUBMITTING_GRACE_S:
                out[key] = CatalogEntry(job_id=entry["job"], batch_id=entry["batch"], state="queued")
            elif result_key is not None:
                self._promote(hkey, key, old_raw, entry, result_key)
                out[key] = CatalogEntry(job_id=entry["job"], batch_id=entry["batch"], state="succeeded",
                                        result_key=result_key)
            else:
                self._cas(keys=[hkey], args=[key, old_raw, ""])
