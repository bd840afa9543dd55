"""What ``bench farm`` reads from its private stack while it runs: CPU seconds and RSS of each
process (``/proc``), each worker's heartbeat (``GET /v1/workers``) and the farm's own timing sums
(``GET /metrics``).

Place in the data flow: beside it. :mod:`bench.farm.farm` reads these before and after its
measured rounds; they observe the stack's processes and API and change nothing. Linux only
(``/proc``).
"""

from __future__ import annotations

import os
import time

from prometheus_client.parser import text_string_to_metric_families

#: Sums of the farm's metrics that give the worker's time per batch (see :func:`farm_timing`).
TIMING_SUMS = {"renderfarm_batch_seconds_sum": "worker_s", "renderfarm_render_seconds_per_image_sum": "render_s",
               "renderfarm_batch_size_sum": "jobs", "renderfarm_batch_size_count": "batches"}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_snapshot(processes) -> dict[str, float]:
    """CPU seconds of each live process of ``processes`` (objects with ``name`` and ``pid``), by name;
    a process that is gone or unreadable is left out."""
    out = {}
    for p in processes:
        try:
            out[p.name] = cpu_seconds(p.pid)
        except (OSError, TypeError, ValueError, IndexError):
            pass
    return out


def rss_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of a live process, KiB, from ``/proc/<pid>/status``."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":", 1)
                out[name] = int(value.split()[0])
    return out


def worker_memory(client, workers, since: float, wait_s: float | None = None) -> dict:
    """Per worker process of the stack: ``peak_rss_mib`` (``VmHWM``) and ``rss_mib`` now, from
    ``/proc``; and from its heartbeat in ``GET /v1/workers``: ``batch_size``, ``prefetch_limit``
    (messages held at once), ``prefetch_peak_jobs`` (the most prefetched jobs it held) and
    ``rss_mib_at_prefetch_peak`` (its RSS when it first held that many).

    Waits up to ``wait_s`` seconds (default: two heartbeat periods and a second) for a beat of
    every worker newer than ``since`` (epoch seconds), so the prefetch figures cover the measured
    rounds; a worker without one keeps None there. ``workers``: live
    :class:`infra.localstack.WorkerProcess` objects (their ``pid`` and ``worker_name``).
    """
    from infra.settings import get_settings

    if wait_s is None:
        wait_s = 2 * get_settings().heartbeat_interval_s + 1.0
    names = [w.worker_name for w in workers]
    deadline = time.monotonic() + wait_s
    while True:
        listed = {w["name"]: w for w in client.http.get("/v1/workers").json() if w.get("name") in names}
        fresh = all((listed.get(n) or {}).get("last_heartbeat", 0) >= since for n in names)
        if fresh or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    rows = []
    for worker in workers:
        info = listed.get(worker.worker_name) or {}
        prefetch = info.get("prefetch") or {}
        at_peak = prefetch.get("rss_kib_at_peak")
        row = {"name": worker.worker_name, "batch_size": info.get("batch_size"),
               "prefetch_limit": prefetch.get("limit"), "prefetch_peak_jobs": prefetch.get("peak_jobs"),
               "rss_mib_at_prefetch_peak": None if at_peak is None else round(at_peak / 1024, 1),
               "peak_rss_mib": None, "rss_mib": None}
        try:
            rss = rss_kib(worker.pid)
            row.update(peak_rss_mib=round(rss["VmHWM"] / 1024, 1), rss_mib=round(rss["VmRSS"] / 1024, 1))
        except (OSError, TypeError, KeyError):  # not running, or no /proc
            pass
        rows.append(row)
    return {"workers": rows}


def farm_timing(client) -> dict[str, float]:
    """Worker seconds on pulled batches, render seconds inside them, jobs and batches, summed over
    every pool and worker so far, from the API's ``GET /metrics`` (Prometheus text)."""
    text = client.http.get("/metrics").text
    sums = dict.fromkeys(TIMING_SUMS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in TIMING_SUMS:
                sums[TIMING_SUMS[sample.name]] += sample.value
    return sums


def overhead(before: dict[str, float], after: dict[str, float]) -> dict:
    """Worker time beyond the render between two :func:`farm_timing` reads: batches, jobs, worker and
    render seconds, and ``overhead_ms_per_job`` (None without a job)."""
    jobs, total, render = (after[k] - before[k] for k in ("jobs", "worker_s", "render_s"))
    return {"batches": int(after["batches"] - before["batches"]), "jobs": int(jobs), "worker_s": round(total, 4),
            "render_s": round(render, 4),
            "overhead_ms_per_job": round(1000 * (total - render) / jobs, 3) if jobs else None}
