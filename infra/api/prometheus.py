"""Farm metrics, the read side: Prometheus families and throughput from the sums in Redis.

Data flow: workers add each batch's observations to Redis (:mod:`infra.state.metrics`, the write
side) → **here**, at each scrape of ``GET /metrics``, :class:`FarmCollector` turns the sums into
histogram, counter and gauge families; :func:`throughput` and :func:`with_rates` serve
``GET /v1/throughput``, ``GET /v1/workers`` and the dashboard. Every API replica serves the same
farm-wide totals (the Grafana queries aggregate with ``max by (pool)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from infra import keys
from infra.background import server_time
from infra.broker.depths import queue_depths
from infra.state.metrics import HISTOGRAMS, IMAGE_STATES, Histogram
from infra.state.registry import STARTUP_STATES, live_workers

#: Minutes of per-worker throughput behind ``images_per_s`` in ``GET /v1/workers``.
RATE_WINDOW_MIN = 3

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
    :func:`infra.broker.depths.queue_depths`; a pool seen before reads 0 rather than vanishing)."""

    def __init__(self, client: redis.Redis, heartbeat_ttl_s: float = 20.0,
                 broker: redis.Redis | Sequence[redis.Redis] | None = None):
        self.client = client
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        pools = sorted(self.client.smembers(keys.METRICS_POOLS))
        pipe = self.client.pipeline(transaction=False)
        for pool in pools:
            pipe.hgetall(keys.metrics(pool))
        per_pool = dict(zip(pools, pipe.execute() if pools else []))
        for hist in HISTOGRAMS:
            yield histogram_family(hist, per_pool)
        images = CounterMetricFamily("renderfarm_images", "Jobs that ended, by pool and final state",
                                     labels=["pool", "state"])
        for pool, fields in sorted(per_pool.items()):
            for state in IMAGE_STATES:
                images.add_metric([pool, state], float(fields.get(f"images:{state}", 0)))
        yield images
        live = live_workers(self.client, self.heartbeat_ttl_s)
        rows = {r["pool"]: r for r in queue_depths(self.client, live, broker=self.broker)}
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
        yield from worker_families(live)


def worker_families(live: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-worker figures from the heartbeats (``worker.main``'s ``describe``), labelled
    ``{pool, worker}``: ``renderfarm_recompiles_total`` (TorchDynamo compiles after warm-up; 0 is
    the goal), ``renderfarm_compiled_renders_total`` (pipeline calls since the warm-up that compiled
    code served alone), ``renderfarm_eager_renders_total`` (pipeline calls since the warm-up in
    which a compiled module was seen to run eagerly: a shape the warm-up did not compile; both
    observed by :func:`pipeline.compile_count.observed`), ``renderfarm_warmup_seconds`` (the
    warm-up's wall time), ``renderfarm_worker_warming`` (1 while starting: loading, sizing or
    warming up; 0 once ready) and ``renderfarm_worker_state`` (1 for the start-up state the worker
    is in, labelled ``state``: loading, sizing, warming, ready). A
    worker that does not report a figure (the null model; an older worker) is left out of that family."""
    recompiles = CounterMetricFamily("renderfarm_recompiles", "torch.compile compilations after warm-up",
                                     labels=["pool", "worker"])
    compiled = CounterMetricFamily("renderfarm_compiled_renders", "Pipeline calls since warm-up served by compiled "
                                   "code alone (TorchDynamo graphs, AOTInductor packages, OpenVINO models)",
                                   labels=["pool", "worker"])
    eager = CounterMetricFamily("renderfarm_eager_renders", "Pipeline calls since warm-up in which a compiled module "
                                "ran eagerly (no graph for its shapes, e.g. a size the pool did not declare)",
                                labels=["pool", "worker"])
    seconds = GaugeMetricFamily("renderfarm_warmup_seconds", "Wall time of the worker's warm-up, seconds",
                                labels=["pool", "worker"])
    warming = GaugeMetricFamily("renderfarm_worker_warming", "1 while the worker starts (loading, sizing, warming "
                                "up; takes no jobs), 0 when ready", labels=["pool", "worker"])
    state = GaugeMetricFamily("renderfarm_worker_state", "1 for the start-up state the worker is in (loading, sizing, "
                              "warming, ready)", labels=["pool", "worker", "state"])
    for w in sorted(live, key=lambda w: str(w.get("name"))):
        labels = [str(w.get("pool", "")), str(w.get("name", ""))]
        if isinstance(w.get("recompiles"), int):
            recompiles.add_metric(labels, float(w["recompiles"]))
        if isinstance(w.get("compiled_renders"), int):
            compiled.add_metric(labels, float(w["compiled_renders"]))
        if isinstance(w.get("eager_renders"), int):
            eager.add_metric(labels, float(w["eager_renders"]))
        report = (w.get("warmup") or {}).get("report") or {}
        if isinstance(report.get("seconds"), (int, float)):
            seconds.add_metric(labels, float(report["seconds"]))
        if w.get("state") in STARTUP_STATES:
            warming.add_metric(labels, 0.0 if w["state"] == "ready" else 1.0)
            state.add_metric([*labels, w["state"]], 1.0)
    yield from (recompiles, compiled, eager, seconds, warming, state)


def exposition(client: redis.Redis, heartbeat_ttl_s: float = 20.0,
               broker: redis.Redis | Sequence[redis.Redis] | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics``: every family of :class:`FarmCollector`
    (``broker``: the broker's Redis when it is not ``client``, or every broker shard's:
    :func:`infra.broker.depths.queue_depths`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FarmCollector(client, heartbeat_ttl_s, broker))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def throughput(client: redis.Redis, minutes: int = 60) -> dict[str, Any]:
    """Images succeeded per epoch minute over the last ``minutes`` (the current, partial minute
    last), per pool: ``{"start": epoch s of the first minute, "minute_s": 60, "now": server
    epoch s, "pools": {pool: [count, …]}}``."""
    now = server_time(client)
    current = int(now) // 60
    first = current - minutes + 1
    pools = sorted(client.smembers(keys.METRICS_POOLS))
    pipe = client.pipeline(transaction=False)
    for pool in pools:
        pipe.execute_command("MGET", *[keys.pool_throughput(pool, m) for m in range(first, current + 1)])
    series = {pool: [int(v or 0) for v in values] for pool, values in zip(pools, pipe.execute() if pools else [])}
    return {"start": first * 60, "minute_s": 60, "now": round(now, 3), "pools": series}


def with_rates(client: redis.Redis, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``workers`` (from :func:`infra.state.registry.live_workers`) each with ``images_per_s``: images
    it finished over the last :data:`RATE_WINDOW_MIN` minutes (or since it started, if later)."""
    if not workers:
        return workers
    now = server_time(client)
    current = int(now) // 60
    minutes = range(current - RATE_WINDOW_MIN + 1, current + 1)
    pipe = client.pipeline(transaction=False)
    for w in workers:
        pipe.execute_command("MGET", *[keys.worker_throughput(w["name"], m) for m in minutes])
    for w, values in zip(workers, pipe.execute()):
        since = max(minutes[0] * 60, float(w.get("started_at") or 0))
        elapsed = now - since
        w["images_per_s"] = round(sum(int(v or 0) for v in values) / elapsed, 3) if elapsed > 1 else 0.0
    return workers
