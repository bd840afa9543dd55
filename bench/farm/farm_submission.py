"""The submission test of ``renderfarm bench farm``: with the workers stopped, seconds to submit
``submit_jobs`` jobs in one request (per ``appendfsync`` policy when asked), the API's RSS
around it, and Redis's bytes per queued job.

Place in the data flow: beside it; :func:`bench.farm.farm.run_farm_bench` calls
:func:`measure_submission` on its private stack after the measured rounds.
"""

from __future__ import annotations

import statistics
import time

from bench.farm.readings import rss_kib
from bench.farm.redis_stats import RedisCounter
from bench.farm.workload import FarmBenchConfig, load_average, requests_for


def measure_submission(client, stack, config: FarmBenchConfig, counter: RedisCounter, result: dict, log) -> None:
    """The submission test, workers stopped: ``result["submission"]`` with the API's RSS around it,
    and Redis's bytes per queued job and one job hash's ``MEMORY USAGE``."""
    api_pid = stack.api.pid
    assert api_pid is not None, "the local stack's API is not running"
    rss_before = rss_kib(api_pid)
    memory_before = counter.used_memory()
    result["submission"] = _submission(client, config, log, stack.redis_url)
    queued = config.submit_jobs * config.submit_repeats * max(1, len(config.submit_appendfsync))
    result["redis"]["bytes_per_queued_job"] = round((counter.used_memory() - memory_before) / queued, 1)
    result["redis"]["job_hash_memory_usage_bytes"] = counter.job_memory(result["submission"].pop("_key"))
    rss_after = rss_kib(api_pid)
    result["submission"]["api_rss_mib"] = {
        "before": round(rss_before["VmRSS"] / 1024, 1), "after": round(rss_after["VmRSS"] / 1024, 1),
        "peak_after": round(rss_after["VmHWM"] / 1024, 1),
        "peak_growth": round((rss_after["VmHWM"] - rss_before["VmRSS"]) / 1024, 1)}


def _submission(client, config: FarmBenchConfig, log, redis_url: str) -> dict:
    """Median seconds of ``submit_repeats`` single-request submissions of ``submit_jobs`` jobs;
    with ``submit_appendfsync``, that per policy too (``by_appendfsync``: each repeat submits
    once under each policy, set live with ``CONFIG SET appendfsync``, the order alternating)."""
    import redis

    from infra import keys

    policies: list[str | None] = list(config.submit_appendfsync) or [None]
    seconds: dict[str | None, list[float]] = {policy: [] for policy in policies}
    admin = redis.Redis.from_url(redis_url)
    n = 0
    for r in range(config.submit_repeats):
        for policy in policies if r % 2 == 0 else policies[::-1]:
            if policy is not None:
                admin.config_set("appendfsync", policy)
            requests = requests_for(config, config.submit_jobs, offset=20_000_000 + n * config.submit_jobs)
            n += 1
            t0 = time.perf_counter()
            accepted = client.submit_batch(requests)
            seconds[policy].append(round(time.perf_counter() - t0, 4))
            log(f"submitted {config.submit_jobs} jobs in {seconds[policy][-1]:.3f} s"
                + (f" (appendfsync {policy})" if policy else "") + f" (load {load_average()[0]})")
    admin.close()
    first = seconds[policies[0]]
    median = statistics.median(first)
    out = {"jobs": config.submit_jobs, "runs_s": first, "median_s": round(median, 4),
           "jobs_per_s": round(config.submit_jobs / median, 1), "_key": keys.job(accepted.job_ids[0])}
    if config.submit_appendfsync:
        out["by_appendfsync"] = {
            policy: {"runs_s": runs, "median_s": round(statistics.median(runs), 4),
                     "ms_per_job": round(1000 * statistics.median(runs) / config.submit_jobs, 4)}
            for policy, runs in seconds.items()}
    return out
