"""Redis's share of the farm: commands and bytes per job, bytes per queued job, and where one
redis-server saturates (``renderfarm bench farm`` rows and ``renderfarm bench redis``).

Place in the data flow: beside it, like :mod:`bench.farm.farm`, whose private stack (its own
redis-server) these figures come from:

* **per job, over its whole life** (:class:`bench.farm.redis_stats.RedisCounter`): ``CONFIG RESETSTAT`` before the
  measured rounds, then ``INFO commandstats`` (calls per command) and ``INFO stats``
  (``total_net_input_bytes``, ``total_net_output_bytes``) after, divided by the jobs that ran:
  submit, dispatch, start, progress, succeed, the acks, every periodic loop (dispatcher,
  reaper, heartbeats) and the bench client's own polling. Expiry costs no command (Redis
  expires the job records itself after ``RENDERFARM_JOB_TTL_S``).
* **bytes per queued job**: ``used_memory`` before and after one submission of N jobs with the
  workers stopped, over N; and ``MEMORY USAGE`` of one queued job's hash.
* **saturation** (:func:`run_saturation`): ``bench farm --model null`` (0 ms renders) with N
  worker processes as N grows: jobs/s end to end and redis-server's CPU (share of one core).
"""

from __future__ import annotations

from dataclasses import replace


def run_saturation(config, workers: tuple[int, ...], log=print) -> dict:
    """``bench farm`` with the null renderer at 0 ms for each worker count in ``workers``: jobs/s
    end to end, redis-server's CPU share of one core and CPU ms per job, per farm process."""
    from bench.farm.farm import run_farm_bench
    from bench.farm.workload import SHARD_NAME
    from pipeline.device import cpu_summary

    rows = []
    for n in workers:
        run = replace(config, workers=n, submit_jobs=0, bare=False, render_ms_per_image=0.0)
        result = run_farm_bench(run, log=log)
        full, cpu = result["full_path"], result["cpu_ms_per_job"]
        jobs_per_s = full["images_per_s"]
        rows.append({"workers": n, "jobs_per_s": jobs_per_s, "worker_span_jobs_per_s": full["worker_images_per_s"],
                     "redis_cpu_ms_per_job": cpu.get("redis"),
                     "redis_core_share": round((cpu.get("redis") or 0) * jobs_per_s / 1000, 3),
                     "redis_state_cpu_ms_per_job": cpu.get("redis-state"),
                     "redis_state_commands_per_job": result.get("redis_state", {}).get("commands_per_job"),
                     "redis_shard_cpu_ms_per_job": cpu.get(f"redis-{SHARD_NAME}"),
                     "redis_shard_commands_per_job": result.get("redis_shard", {}).get("commands_per_job"),
                     "cpu_ms_per_job_total": cpu["total"],
                     "redis_commands_per_job": result.get("redis", {}).get("commands_per_job"),
                     "load_average_after": result["machine"]["load_average_after"][0]})
        log(f"{n} worker(s): {jobs_per_s:.1f} jobs/s, redis at {100 * rows[-1]['redis_core_share']:.1f} % of a core")
    return {"benchmark": "redis-saturation", "config": {"jobs": config.jobs, "batch_size": config.batch_size,
                                                        "split_state": config.split_state,
                                                        "broker_shards": config.broker_shards},
            "machine": {"cpu": cpu_summary()}, "rows": rows}


def saturation_table(result: dict, nproc: int):
    """A rich Table of :func:`run_saturation` (with the state store apart: the broker's and the
    state store's Redis CPU and commands per job in columns of their own; with two broker shards,
    the second broker's too, per job of the whole run: it carries every second job)."""
    from rich.table import Table

    cpu = result.get("machine", {}).get("cpu")
    split = result["config"].get("split_state")
    sharded = result["config"].get("broker_shards", 1) > 1
    what = "a broker and a state-store redis-server" if split else "one redis-server"
    what += " and a second broker (every second job's pool)" if sharded else ""
    table = Table(title=f"{what} as null workers grow (0 ms renders, {result['config']['jobs']} jobs, "
                        f"batch {result['config']['batch_size']}; {nproc} cores shared by every process)",
                  caption=f"{cpu['name']} ({cpu['isa']})" if cpu else None)
    redis = ("broker Redis" if split else "Redis")
    columns = ["workers", "jobs/s end to end", "jobs/s on the workers", f"{redis} CPU ms/job", f"{redis} core share",
               "CPU ms/job all", f"{redis} cmds/job"]
    columns += ["state Redis CPU ms/job", "state Redis cmds/job"] if split else []
    columns += ["broker 2 CPU ms/job", "broker 2 cmds/job"] if sharded else []
    for col in (*columns, "load after"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        cells = [str(r["workers"]), f"{r['jobs_per_s']:.1f}", f"{r['worker_span_jobs_per_s']:.1f}",
                 f"{r['redis_cpu_ms_per_job']:.3f}", f"{100 * r['redis_core_share']:.1f} %",
                 f"{r['cpu_ms_per_job_total']:.2f}", f"{r['redis_commands_per_job']}"]
        if split:
            cells += [f"{r['redis_state_cpu_ms_per_job']:.3f}", f"{r['redis_state_commands_per_job']}"]
        if sharded:
            cells += [f"{r['redis_shard_cpu_ms_per_job']:.3f}", f"{r['redis_shard_commands_per_job']}"]
        table.add_row(*cells, f"{r['load_average_after']}")
    return table
