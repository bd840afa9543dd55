"""Per-core figures of ``renderfarm bench farm``: host CPU per job, jobs per second per core, and
the cores a GPU of a given speed needs.

Place in the data flow: ``bench farm`` (:mod:`bench.farm.farm`) measures the CPU seconds
each of the farm's processes spent during its rounds (``/proc/<pid>/stat``); this module turns
them into the figure a GPU node is sized by; ``bench cores`` (:mod:`bench.farm.cores`) runs
``bench farm`` per size and format. SeaweedFS is reported apart: a production bucket is remote.

- host CPU per job: API + Redis + workers, milliseconds;
- jobs per second one core sustains: 1000 / host CPU per job;
- cores for a GPU at ``g`` ms per image: the GPU finishes 1000 / ``g`` images per second, each
  costing the worker ``w`` ms of CPU, so its node needs ``w / g`` cores for the worker process
  (and ``h / g`` for the whole host side, API and Redis included, where they share the node).

With ``--model null`` the worker's CPU includes making each image (one roll and copy of a
cached array, :mod:`pipeline.null`), which a real render spends on the GPU instead, so the
figures are an upper bound for the host side of a real model.
"""

from __future__ import annotations

#: processes of the local stack that are not the farm's own host cost
APART = ("seaweedfs",)
SHARED = ("api", "redis", "redis-state")


def per_core(cpu_ms_per_job: dict[str, float], gpu_ms_per_image: tuple[float, ...]) -> dict:
    """Per-core figures from ``bench farm``'s ``cpu_ms_per_job`` (process name → ms per job;
    workers are every name that is not ``api``, ``redis``, ``seaweedfs`` or ``total``).

    Returns:
        ``{"host_cpu_ms_per_job", "worker_cpu_ms_per_job", "jobs_per_s_per_core",
        "worker_cores_for_gpu": {ms: cores}, "host_cores_for_gpu": {ms: cores}}``.
    """
    worker = sum(v for k, v in cpu_ms_per_job.items() if k not in (*APART, *SHARED, "total"))
    host = worker + sum(cpu_ms_per_job.get(k, 0.0) for k in SHARED)
    return {"host_cpu_ms_per_job": round(host, 3), "worker_cpu_ms_per_job": round(worker, 3),
            "jobs_per_s_per_core": round(1000 / host, 1) if host else None,
            "worker_cores_for_gpu": {str(ms): round(worker / ms, 2) for ms in gpu_ms_per_image},
            "host_cores_for_gpu": {str(ms): round(host / ms, 2) for ms in gpu_ms_per_image}}


def per_core_rows(result: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of a ``bench farm`` result's ``per_core`` section for its table."""
    pc = result.get("per_core")
    if not pc:
        return []
    rows = [("host CPU per job, API + Redis + worker(s), SeaweedFS apart (ms)", f"{pc['host_cpu_ms_per_job']:.3f}"),
            ("jobs/s one host core sustains", f"{pc['jobs_per_s_per_core']}")]
    for ms, cores in pc["worker_cores_for_gpu"].items():
        rows.append((f"cores a GPU at {ms} ms/img needs: worker / whole host side",
                     f"{cores:.2f} / {pc['host_cores_for_gpu'][ms]:.2f}"))
    return rows
