"""``renderfarm bench cores``: how many host cores a GPU of a given speed needs, at each image size
and output format (the figures themselves: :mod:`bench.farm.core_figures`).

Place in the data flow: beside the farm. It runs ``bench farm --model null`` once per size and
format (:func:`run_cores_bench`) and tabulates the per-core section of each result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    from bench.farm.farm import run_farm_bench
    from bench.farm.workload import FarmBenchConfig

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
