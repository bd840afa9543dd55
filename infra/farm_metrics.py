"""Farm metrics: what workers observe per batch, summed in Redis, exposed by the status API.

Data flow: worker (after each pulled batch, ``worker.runner``) → :func:`record_batch` → Redis
hashes → :class:`FarmCollector` in the status API → ``GET /metrics`` (Prometheus text); and
per-minute throughput buckets → :func:`throughput` / :func:`with_rates` → ``GET /v1/throughput``,
``GET /v1/workers`` and the dashboard.

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

Keys (prefix ``rf:``):
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
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from infra.queues import queue_depths
from infra.registry import live_workers
from infra.store import job_key

log = logging.getLogger("renderfarm.metrics")

POOLS_KEY = "rf:metrics:pools"
IMAGE_STATES = ("succeeded", "failed", "canceled")
POOL_TPUT_TTL_S = 2 * 3600
WORKER_TPUT_TTL_S = 600
#: Minutes of per-worker throughput behind ``images_per_s`` in ``GET /v1/workers``.
RATE_WINDOW_MIN = 3


def metrics_key(pool: str) -> str:
    return f"rf:metrics:{pool}"


def pool_tput_key(pool: str, minute: int) -> str:
    return f"rf:tput:{pool}:{minute}"


def worker_tput_key(worker: str, minute: int) -> str:
    return f"rf:wtput:{worker}:{minute}"


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
HISTOGRAMS = (QUEUE_WAIT, RENDER_PER_IMAGE, BATCH_SIZE)


class _Sums:
    """One pool's increments of a batch, to be sent in one pipeline."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sums: Counter[str] = Counter()

    def observe(self, hist: Histogram, value: float, times: int = 1) -> None:
        if times <= 0 or not math.isfinite(value):
            return
        value = max(0.0, value)
        self.counts[f"{hist.field}:{hist.bucket(value)}"] += times
        self.sums[f"{hist.field}:sum"] += value * times


# ---- worker side ------------------------------------------------------------------------------
def record_batch(client: redis.Redis, job_ids: Sequence[str], *, worker: str,
                 renders: Iterable[tuple[int, float]] = (), succeeded: int = 0, failed: int = 0) -> None:
    """Add one pulled batch's observations to the farm's metrics. Never raises (a metrics
    write must not fail a batch): a Redis error is logged and the batch's counts are lost.

    Args:
        client: Redis client (``decode_responses=True``).
        job_ids: the jobs this batch started (its size; each one's queue wait is read from
            its record: ``started_at − created_at``).
        worker: the worker's name, for its images/s.
        renders: ``(images, seconds)`` per successful pipeline call.
        succeeded, failed: jobs of the batch that ended so (requeued ones are not counted).
    """
    if not job_ids:
        return
    try:
        _record_batch(client, job_ids, worker, list(renders), succeeded, failed)
    except (redis.RedisError, ValueError) as exc:
        log.warning("batch metrics not recorded: %s: %s", type(exc).__name__, exc)


def _record_batch(client: redis.Redis, job_ids: Sequence[str], worker: str, renders: list[tuple[int, float]],
                  succeeded: int, failed: int) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for job_id in job_ids:
        pipe.hmget(job_key(job_id), "pool", "created_at", "started_at")
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
    for images, elapsed in renders:
        if images > 0:
            batch.observe(RENDER_PER_IMAGE, elapsed / images, images)
    batch.counts["images:succeeded"] += succeeded
    batch.counts["images:failed"] += failed

    minute = int(seconds) // 60
    pipe = client.pipeline(transaction=True)  # a scrape sees all of a batch or none of it
    for pool, s in sums.items():
        pipe.sadd(POOLS_KEY, pool)
        for name, n in s.counts.items():
            if n:
                pipe.hincrby(metrics_key(pool), name, n)
        for name, x in s.sums.items():
            pipe.hincrbyfloat(metrics_key(pool), name, x)
    if succeeded:
        for key, ttl in ((pool_tput_key(main, minute), POOL_TPUT_TTL_S), (worker_tput_key(worker, minute),
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
            pipe.sadd(POOLS_KEY, pool)
            pipe.hincrby(metrics_key(pool), f"images:{state}", n)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("%d %s image(s) not counted: %s", sum(per_pool.values()), state, exc)


# ---- API side ---------------------------------------------------------------------------------
def _server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def histogram_family(hist: Histogram, per_pool: Mapping[str, Mapping[str, str]]) -> HistogramMetricFamily:
    """The Prometheus family of ``hist`` from each pool's metrics hash (cumulative buckets)."""
    family = HistogramMetricFamily(hist.name, hist.help, labels=["pool"])
    for pool, fields in sorted(per_pool.items()):
        cumulative, buckets = 0, []
        for i, bound in enumerate((*hist.bounds, math.inf)):
            cumulative += int(fields.get(f"{hist.field}:{i}", 0))
            buckets.append((floatToGoString(bound), cumulative))  # as prometheus_client's own
        family.add_metric([pool], buckets, sum_value=float(fields.get(f"{hist.field}:sum", 0.0)))
    return family


class FarmCollector:
    """A ``prometheus_client`` collector reading the farm's metrics from Redis at each scrape:
    the three histograms, ``renderfarm_images_total{pool,state}``, and the gauges
    ``renderfarm_outstanding_jobs{pool}`` and ``renderfarm_live_workers{pool}`` (from
    :func:`infra.queues.queue_depths`; a pool seen before reads 0 rather than vanishing)."""

    def __init__(self, client: redis.Redis, heartbeat_ttl_s: float = 20.0):
        self.client = client
        self.heartbeat_ttl_s = heartbeat_ttl_s

    def collect(self) -> Iterator[Metric]:
        pools = sorted(self.client.smembers(POOLS_KEY))
        pipe = self.client.pipeline(transaction=False)
        for pool in pools:
            pipe.hgetall(metrics_key(pool))
        per_pool = dict(zip(pools, pipe.execute() if pools else []))
        for hist in HISTOGRAMS:
            yield histogram_family(hist, per_pool)
        images = CounterMetricFamily("renderfarm_images", "Jobs that ended, by pool and final state",
                                     labels=["pool", "state"])
        for pool, fields in sorted(per_pool.items()):
            for state in IMAGE_STATES:
                images.add_metric([pool, state], float(fields.get(f"images:{state}", 0)))
        yield images
        rows = {r["pool"]: r for r in queue_depths(self.client, live_workers(self.client, self.heartbeat_ttl_s))}
        outstanding = GaugeMetricFamily("renderfarm_outstanding_jobs",
                                        "Queued + reserved (prefetched) + running jobs: the autoscaling signal",
                                        labels=["pool"])
        workers = GaugeMetricFamily("renderfarm_live_workers", "Workers with a fresh heartbeat", labels=["pool"])
        for pool in sorted(set(rows) | set(pools)):
            row = rows.get(pool, {})
            outstanding.add_metric([pool], row.get("outstanding", 0))
            workers.add_metric([pool], row.get("workers", 0))
        yield outstanding
        yield workers


def exposition(client: redis.Redis, heartbeat_ttl_s: float = 20.0) -> tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics``: every family of :class:`FarmCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FarmCollector(client, heartbeat_ttl_s))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def throughput(client: redis.Redis, minutes: int = 60) -> dict[str, Any]:
    """Images succeeded per epoch minute over the last ``minutes`` (the current, partial minute
    last), per pool: ``{"start": epoch s of the first minute, "minute_s": 60, "now": server
    epoch s, "pools": {pool: [count, …]}}``."""
    now = _server_time(client)
    current = int(now) // 60
    first = current - minutes + 1
    pools = sorted(client.smembers(POOLS_KEY))
    pipe = client.pipeline(transaction=False)
    for pool in pools:
        pipe.mget([pool_tput_key(pool, m) for m in range(first, current + 1)])
    series = {pool: [int(v or 0) for v in values] for pool, values in zip(pools, pipe.execute() if pools else [])}
    return {"start": first * 60, "minute_s": 60, "now": round(now, 3), "pools": series}


def with_rates(client: redis.Redis, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``workers`` (from :func:`infra.registry.live_workers`) each with ``images_per_s``: images
    it finished over the last :data:`RATE_WINDOW_MIN` minutes (or since it started, if later)."""
    if not workers:
        return workers
    now = _server_time(client)
    current = int(now) // 60
    minutes = range(current - RATE_WINDOW_MIN + 1, current + 1)
    pipe = client.pipeline(transaction=False)
    for w in workers:
        pipe.mget([worker_tput_key(w["name"], m) for m in minutes])
    for w, values in zip(workers, pipe.execute()):
        since = max(minutes[0] * 60, float(w.get("started_at") or 0))
        elapsed = now - since
        w["images_per_s"] = round(sum(int(v or 0) for v in values) / elapsed, 3) if elapsed > 1 else 0.0
    return workers
