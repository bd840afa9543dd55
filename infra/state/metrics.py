"""Farm metrics, the write side: what workers observe per batch, summed in Redis.

Data flow: worker (after each pulled batch, :mod:`worker.post_stage`) → :func:`record_batch` → Redis
hashes → the status API's read side (:mod:`infra.api.prometheus`) → ``GET /metrics`` (Prometheus
text); and per-minute throughput buckets → ``GET /v1/throughput``, ``GET /v1/workers`` and the
dashboard.

Why Redis and not a ``prometheus_client`` registry in each worker: workers are processes that
KEDA starts and stops (scale from zero), with no Service to scrape, and a worker's counts would
vanish with it. Instead a worker adds its batch's observations to Redis hashes with HINCRBY and
HINCRBYFLOAT in one MULTI/EXEC round trip per batch (plus one to read its jobs' timestamps and
the server clock), so any number of workers add at once and a scrape sees all of a batch or
none of it. The API's custom collector turns the sums into ordinary histogram, counter and
gauge families. Every API replica serves the same farm-wide totals, which is why the Grafana
queries aggregate with ``max by (pool)``. The totals live as long as the Redis data
(``rate()`` copes with a reset).

Where each count is made: rendered images and their failures by the worker here; cancellations
by the API's cancel routes (:func:`count_images`). Failures decided by the reaper (a job's last
attempt lost with its worker) are not counted yet.

Keys (prefix ``rf:{metrics}:``, one Redis Cluster slot for the batch's MULTI/EXEC; named in
:mod:`infra.keys`):
    metrics:pools             set of the pool names that have recorded anything
    metrics:{pool}            hash: ``{histogram}:{i}`` observations in bucket ``i`` (not
                              cumulative; ``i == len(bounds)`` is ``+Inf``), ``{histogram}:sum``,
                              and ``images:{state}``
    tput:{pool}:{minute}      images succeeded in that epoch minute (expires after 2 h)
    wtput:{worker}:{minute}   the same for one worker (expires after 10 min)
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from infra import keys

log = logging.getLogger("renderfarm.metrics")

IMAGE_STATES = ("succeeded", "failed", "canceled")
POOL_TPUT_TTL_S = 2 * 3600
WORKER_TPUT_TTL_S = 600


@dataclass(frozen=True)
class Histogram:
    """One histogram: its field prefix in the pool hash, its Prometheus name and bucket bounds."""

    field: str
    name: str
    help: str
    bounds: tuple[float, ...]

    def bucket(self, value: float) -> int:
        """Index of the bucket that counts ``value`` (``le`` semantics; ``len(bounds)`` is +Inf)."""
        return bisect_left(self.bounds, value)


QUEUE_WAIT = Histogram("queue_wait", "renderfarm_queue_wait_seconds",
                       "Seconds from a job's submission to the start of its (latest) attempt",
                       (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600))
RENDER_PER_IMAGE = Histogram("render_per_image", "renderfarm_render_seconds_per_image",
                             "Seconds of pipeline time per image (a group's render time / its images)",
                             (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
BATCH_SIZE = Histogram("batch_size", "renderfarm_batch_size",
                       "Jobs started per batch a worker pulled from its queue",
                       (1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_SECONDS = Histogram("batch_seconds", "renderfarm_batch_seconds",
                          "Worker seconds per pulled batch, from its start to its last state write "
                          "(render, encoding, uploads, state writes); minus the render seconds, the "
                          "farm's own cost",
                          (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
HISTOGRAMS = (QUEUE_WAIT, RENDER_PER_IMAGE, BATCH_SIZE, BATCH_SECONDS)


class _Sums:
    """One pool's increments of a batch, to be sent in one pipeline."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sums: defaultdict[str, float] = defaultdict(float)

    def observe(self, hist: Histogram, value: float, times: int = 1) -> None:
        if times <= 0 or not math.isfinite(value):
            return
        value = max(0.0, value)
        self.counts[f"{hist.field}:{hist.bucket(value)}"] += times
        self.sums[f"{hist.field}:sum"] += value * times


# ---- worker side ------------------------------------------------------------------------------
def record_batch(client: redis.Redis, job_ids: Sequence[str], *, worker: str,
                 renders: Iterable[tuple[int, float]] = (), succeeded: int = 0, failed: int = 0,
                 batch_seconds: float | None = None) -> None:
    """Add one pulled batch's observations to the farm's metrics. Never raises (a metrics
    write must not fail a batch): a Redis error is logged and the batch's counts are lost.

    Args:
        client: Redis client (``decode_responses=True``).
        job_ids: the jobs this batch started (its size; each one's queue wait is read from
            its record: ``started_at − created_at``).
        worker: the worker's name, for its images/s.
        renders: ``(images, seconds)`` per successful pipeline call.
        succeeded, failed: jobs of the batch that ended so (requeued ones are not counted).
        batch_seconds: the worker's wall seconds on the whole batch (None: not observed).
    """
    if not job_ids:
        return
    try:
        _record_batch(client, job_ids, worker, list(renders), succeeded, failed, batch_seconds)
    except (redis.RedisError, ValueError) as exc:
        log.warning("batch metrics not recorded: %s: %s", type(exc).__name__, exc)


def _record_batch(client: redis.Redis, job_ids: Sequence[str], worker: str, renders: list[tuple[int, float]],
                  succeeded: int, failed: int, batch_seconds: float | None) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("TIME")  # redis-py's cluster pipeline blocks its .time(), not the command
    for job_id in job_ids:
        pipe.hmget(keys.job(job_id), "pool", "created_at", "started_at")
    (seconds, _micros), *rows = pipe.execute()
    pools: Counter[str] = Counter(pool for pool, _, _ in rows if pool)
    if not pools:
        return
    main = pools.most_common(1)[0][0]  # a worker serves one pool: its batch's jobs share it
    sums: dict[str, _Sums] = {}
    for pool, created, started in rows:
        if pool and created and started:
            sums.setdefault(pool, _Sums()).observe(QUEUE_WAIT, float(started) - float(created))
    batch = sums.setdefault(main, _Sums())
    batch.observe(BATCH_SIZE, len(job_ids))
    if batch_seconds is not None:
        batch.observe(BATCH_SECONDS, batch_seconds)
    for images, elapsed in renders:
        if images > 0:
            batch.observe(RENDER_PER_IMAGE, elapsed / images, images)
    batch.counts["images:succeeded"] += succeeded
    batch.counts["images:failed"] += failed

    minute = int(seconds) // 60
    pipe = client.pipeline(transaction=True)  # a scrape sees all of a batch or none of it
    for pool, s in sums.items():
        pipe.sadd(keys.METRICS_POOLS, pool)
        for name, n in s.counts.items():
            if n:
                pipe.hincrby(keys.metrics(pool), name, n)
        for name, x in s.sums.items():
            pipe.hincrbyfloat(keys.metrics(pool), name, x)
    if succeeded:
        for key, ttl in ((keys.pool_throughput(main, minute), POOL_TPUT_TTL_S), (keys.worker_throughput(worker, minute),
                                                                             WORKER_TPUT_TTL_S)):
            pipe.incrby(key, succeeded)
            pipe.expire(key, ttl)
    pipe.execute()


def count_images(client: redis.Redis, pools: Iterable[str], state: str) -> None:
    """Count one image in ``state`` for each pool name given (a pool once per job), in one
    round trip; used by the API for cancellations. Never raises."""
    if state not in IMAGE_STATES:
        raise ValueError(f"unknown image state {state!r}")
    per_pool = Counter(p for p in pools if p)
    if not per_pool:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for pool, n in per_pool.items():
            pipe.sadd(keys.METRICS_POOLS, pool)
            pipe.hincrby(keys.metrics(pool), f"images:{state}", n)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("%d %s image(s) not counted: %s", sum(per_pool.values()), state, exc)
