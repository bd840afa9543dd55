"""Per-core figures of ``renderfarm bench farm``, and ``renderfarm bench cores``: how many host
cores a GPU of a given speed needs, at each image size and output format.

Place in the data flow: beside it. ``bench farm`` measures the CPU seconds each of the farm's
processes spent during its rounds (``/proc/<pid>/stat``); this module turns them into the
figure a GPU node is sized by. SeaweedFS is reported apart: a production bucket is remote.

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

from dataclasses import dataclass, replace

#: processes of the local stack that are not the farm's own host cost
APART = ("seaweedfs",)
SHARED = ("api", "redis")


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


@dataclass(frozen=True)
class CoresConfig:
    """``bench cores``: one ``bench farm --model null`` run (no render time, no submission test,
    no bare loop) per size × format, ``jobs`` jobs in batches of ``batch_size``, one worker."""

    sizes: tuple[int, ...] = (64, 512, 1024)
    formats: tuple[str, ...] = ("png", "jpeg")
    gpu_ms_per_image: tuple[float, ...] = (10.0, 30.0, 100.0)
    jobs: int = 512
    batch_size: int = 16
    rounds: int = 1


def run_cores_bench(config: CoresConfig, log=print) -> dict:
    """Run the farm once per size and format; returns ``{"rows": [{"size", "format", "per_core",
    "cpu_ms_per_job", "images_per_s"}], "machine"}``."""
    from producer.bench_farm import FarmBenchConfig, run_farm_bench

    base = FarmBenchConfig(model="null", jobs=config.jobs, batch_size=config.batch_size, rounds=config.rounds,
                           submit_jobs=0, bare=False, gpu_ms_per_image=config.gpu_ms_per_image)
    rows, machine = [], {}
    for side in config.sizes:
        for fmt in config.formats:
            log(f"{side}² {fmt} …")
            result = run_farm_bench(replace(base, width=side, height=side, output_format=fmt),  # type: ignore[arg-type]
                                    log=log)
            machine = result["machine"]
            rows.append({"size": side, "format": fmt, "per_core": result["per_core"],
                         "cpu_ms_per_job": result["cpu_ms_per_job"],
                         "images_per_s": result["full_path"]["images_per_s"],
                         "load_average": [machine["load_average_before"][0], machine["load_average_after"][0]]})
    return {"benchmark": "cores", "config": config.__dict__, "rows": rows, "machine": machine}


def cores_table(result: dict):
    """A rich table: per size and format, host CPU per job, jobs/s per core, and cores needed."""
    from rich.table import Table

    m = result["machine"]
    table = Table(title="Host cores a GPU needs (bench farm --model null, 1 worker)")
    gpu = [str(ms) for ms in result["config"]["gpu_ms_per_image"]]
    for col in ("size", "format", "host CPU ms/job", "of which worker", "SeaweedFS ms/job", "jobs/s per core",
                *(f"cores @ {ms} ms/img (worker / host)" for ms in gpu), "load"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        pc = r["per_core"]
        table.add_row(f"{r['size']}²", r["format"], f"{pc['host_cpu_ms_per_job']:.2f}",
                      f"{pc['worker_cpu_ms_per_job']:.2f}", f"{r['cpu_ms_per_job'].get('seaweedfs', 0):.2f}",
                      f"{pc['jobs_per_s_per_core']}",
                      *(f"{pc['worker_cores_for_gpu'][ms]:.2f} / {pc['host_cores_for_gpu'][ms]:.2f}" for ms in gpu),
                      " → ".join(str(x) for x in r.get("load_average", [])))
    cpu = m.get("cpu")
    table.caption = (f"{cpu['name']} ({cpu['isa']}), " if cpu else "") + f"{m['nproc']} cores"
    return table
