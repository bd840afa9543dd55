"""``renderfarm bench farm``: the whole path against a bare render loop, in one run.

Place in the data flow: around it. It starts a private local stack (:class:`infra.localstack.LocalStack`
with its own redis-server on a free port, SeaweedFS, the status API and real worker processes),
so the producer → API → Redis → worker → S3 → job state path is the one production runs, and
measures:

* **full path**: images/s from submitting N jobs (one HTTP batch) until the last one's
  ``finished_at``, against the same renders (same requests, seeds, batch size and recipe) in
  a bare in-process loop of :class:`pipeline.render.Renderer` calls; the ratio is the farm's
  efficiency. Rounds alternate the order (bare → farm, then farm → bare) so a drift in machine
  load favours neither; medians are reported.
* **queue + storage path**: the same with ``--model null`` (no model; an image of the request's
  size whose PNG costs what a render's does, :mod:`pipeline.null`; 64×64 unless ``--width`` /
  ``--height`` say otherwise): jobs/s, end to end and between the first start and the last
  finish on the workers. Each run also reports its images' size and mean encoded bytes.
* **submission**: seconds for one ``POST /v1/batches`` of ``submit_jobs`` jobs (client JSON,
  HTTP, validation, job records and wait lanes in Redis), with the workers stopped;
  ``--submit-appendfsync everysec,always`` runs redis-server with the AOF and times the
  submissions under each policy, alternating (what ``renderfarm up``'s ``always`` costs).
* **simulated GPU**: ``--model null --render-ms-per-image MS`` makes the null renderer sleep
  MS per image of each batch (GIL released), a device of that speed; **efficiency** is the
  farm's images/s over the rate the sleep alone allows (``workers × 1000 / MS``).
* **CPU per job**: CPU milliseconds per job of every farm process (API, redis-server, SeaweedFS,
  workers), from ``/proc/<pid>/stat`` before and after the measured rounds.
* **API memory**: the API's RSS before the submission test and its peak (``VmHWM``) after.
* **worker memory**: after the measured rounds, each worker process's peak RSS (``VmHWM`` from
  ``/proc/<pid>/status``) and, from its heartbeat (``GET /v1/workers``, a beat newer than the
  rounds), the most prefetched jobs it held at once (received, not yet started; its prefetch
  limit is 2 × its batch size) and its RSS at the moment it first held that many.
* **overhead**: worker milliseconds per job beyond the pipeline call, from the farm's own metrics
  (``GET /metrics``: ``renderfarm_batch_seconds`` and ``renderfarm_render_seconds_per_image``
  sums, which every worker records per batch), read before and after the measured rounds.

Times are wall seconds on a machine other processes share; the load average is recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from datetime import datetime

from bench.farm.readings import cpu_snapshot, farm_timing, overhead, worker_memory
from bench.farm.redis_stats import RedisCounter
from bench.farm.workload import SHARD_NAME, SHARD_POOLS, FarmBenchConfig, load_average, requests_for, shard_pools

# ---- the farm side -------------------------------------------------------------------------------

def _run_farm(client, config: FarmBenchConfig, n: int, offset: int) -> dict:
    """Submit ``n`` jobs in one batch and wait for all; times from the job records."""
    requests = requests_for(config, n, offset)
    t0 = time.time()
    accepted = client.submit_batch(requests)
    submitted = time.time()
    deadline = time.monotonic() + config.timeout_s
    while True:
        status = client.batch(accepted.batch_id, limit=0)
        if status.done:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"farm run not done after {config.timeout_s} s: {status.counts}")
        time.sleep(0.05 if config.null else 0.5)
    jobs = client.batch_jobs(accepted.batch_id)
    failed = [j for j in jobs if j.state != "succeeded"]
    if failed:
        j = failed[0]
        raise RuntimeError(f"{len(failed)} of {n} jobs did not succeed; first: {j.job_id} {j.state} {j.error}")
    started = min(_epoch(j.started_at) for j in jobs)
    finished = max(_epoch(j.finished_at) for j in jobs)
    results = [j.result for j in jobs if j.result is not None]
    sizes = sorted({f"{r.width}x{r.height}" for r in results})
    return {"jobs": n, "submit_s": round(submitted - t0, 4), "end_to_end_s": round(finished - t0, 4),
            "worker_span_s": round(finished - started, 4),
            "images_per_s": round(n / (finished - t0), 4),
            "worker_images_per_s": round(n / max(finished - started, 1e-9), 4),
            "image_sizes": sizes, "content_types": sorted({r.content_type for r in results}),
            "image_bytes_mean": round(statistics.fmean(r.bytes for r in results)) if results else None}


def _epoch(value: datetime | None) -> float:
    if value is None:
        raise RuntimeError("a succeeded job without started_at/finished_at")
    return value.timestamp()


# ---- the bare side -------------------------------------------------------------------------------

def _bare_renderer(config: FarmBenchConfig):
    """The bare loop's renderer: the workers' recipe, with the same RENDERFARM_RECIPE_OVERRIDES."""
    from infra.settings import get_settings
    from pipeline.warm import prepare_renderer

    renderer, _profile = prepare_renderer(config.model, "auto", config.recipe, get_settings().recipe_overrides)
    return renderer


def _run_bare(renderer, config: FarmBenchConfig, n: int, offset: int) -> dict:
    """The same renders as the farm run, in batches of ``batch_size``, in this process."""
    requests = requests_for(config, n, offset)
    assert config.batch_size is not None, "expects a resolved config"
    t0 = time.perf_counter()
    for i in range(0, n, config.batch_size):
        renderer.render(requests[i:i + config.batch_size])
    seconds = time.perf_counter() - t0
    return {"jobs": n, "seconds": round(seconds, 4), "images_per_s": round(n / seconds, 4)}


# ---- the run ---------------------------------------------------------------------------------------

def run_farm_bench(config: FarmBenchConfig, log=print) -> dict:
    """Start a private stack, measure, stop it; returns the JSON-able result."""
    from infra.localstack import LocalStack, free_port, patched_environ
    from pipeline.device import cpu_summary
    from producer.client import RenderClient

    config = config.resolved()
    assert config.jobs is not None and config.batch_size is not None  # resolved() fills both
    if config.broker_shards > 1 and config.workers % 2:
        raise ValueError(f"two broker shards need an even number of workers (half on each), not {config.workers}")
    load_before = load_average()
    started = time.time()
    # the bench's own knobs for its private stack: no rate limits, the recipe under test, and a
    # fresh /metrics answer on every read (the timing sums are read right before and after a run)
    env = {"RENDERFARM_RATE_LIMIT_JOBS_PER_S": "0", "RENDERFARM_RATE_LIMIT_REQUESTS_PER_S": "0",
           "RENDERFARM_METRICS_CACHE_S": "0",
           "RENDERFARM_RECIPE": config.recipe,
           "RENDERFARM_NULL_RENDER_MS_PER_IMAGE": str(config.render_ms_per_image)}
    result: dict = {"benchmark": "farm", "config": asdict(config)}
    with contextlib.ExitStack() as apart:
        state = apart.enter_context(_own_redis("redis-state")) if config.split_state else None
        if state is not None:
            env["RENDERFARM_STATE_REDIS_URL"] = state.url
        shard = apart.enter_context(_own_redis(f"redis-{SHARD_NAME}")) if config.broker_shards > 1 else None
        if shard is not None:
            env.update(RENDERFARM_POOLS=json.dumps(shard_pools(config)),
                       RENDERFARM_BROKERS=json.dumps({SHARD_NAME: shard.url}))
        apart.enter_context(patched_environ(env))
        stack = LocalStack(workers=config.workers, model=config.model, batch_size=config.batch_size,
                           redis_url=f"redis://127.0.0.1:{free_port()}/0",
                           appendonly=bool(config.submit_appendfsync), pools=SHARD_POOLS if shard else ())
        log(f"starting a private stack in {stack.run_dir} ({config.workers} worker(s) of {config.model}) …")
        with stack, patched_environ(stack.env), RenderClient(api_url=stack.api.url, timeout_s=600) as client:
            counter = _measure_rounds(client, stack, config, result, log,
                                      {k: v for k, v in (("redis_state", state), ("redis_shard", shard)) if v})
            for worker in stack.workers:  # submission alone: nobody consumes
                worker.stop()
            if config.submit_jobs:
                from bench.farm.farm_submission import measure_submission

                measure_submission(client, stack, config, counter, result, log)
    result["machine"] = {"cpu": cpu_summary(), "load_average_before": load_before,
                         "load_average_after": load_average(), "nproc": os.cpu_count()}
    result["seconds"] = round(time.time() - started, 1)
    return result


@contextlib.contextmanager
def _own_redis(name: str):
    """A redis-server of its own named ``name``: the job-state store's (``split_state``,
    ``redis-state``) or the broker shard's (``broker_shards``)."""
    from infra.localstack import RedisServer

    with tempfile.TemporaryDirectory(prefix=f"rf-bench-{name}-") as tmp, RedisServer(name=name, run_dir=tmp) as server:
        yield server


def _measure_rounds(client, stack, config: FarmBenchConfig, result: dict, log, others=None) -> RedisCounter:
    """Warm up, then ``config.rounds`` farm and bare runs in alternating order; fills ``result``'s
    throughput, Redis, memory, overhead and CPU figures. ``others``: the redis-servers beside the
    stack's, by result key (``redis_state``, ``redis_shard``), each counted as ``result["redis"]`` is.
    Returns the Redis counter (reset after the warm-up) the submission test goes on reading."""
    from bench.farm.core_figures import per_core

    assert config.jobs is not None and config.batch_size is not None  # a resolved config
    warm = config.workers * config.batch_size
    log(f"warm-up: {warm} job(s) …")
    _run_farm(client, config, warm, offset=10_000_000)
    bare = _bare_renderer(config) if config.bare and not config.null else None
    if bare is not None:
        _run_bare(bare, config, config.batch_size, offset=10_000_000)  # same warm-up as the workers
    timing_before = farm_timing(client)  # after the warm-up's batches
    others = others or {}
    counter = RedisCounter(stack.redis_url)
    counters = {key: RedisCounter(server.url) for key, server in others.items()}
    for one in (counter, *counters.values()):
        one.reset()
    farm_runs, bare_runs, cpu = _rounds(client, stack, config, bare, log, extra=list(others.values()))
    timing_after = farm_timing(client)
    rounds_end = time.time()
    result["redis"] = counter.read(config.jobs * config.rounds)
    for key, other in counters.items():  # with a state store apart, "redis" is the broker's alone
        result[key] = other.read(config.jobs * config.rounds)
    result["worker_memory"] = worker_memory(client, stack.workers, since=rounds_end)
    result["full_path"] = _summary(farm_runs)
    if bare_runs:
        result["bare_loop"] = _summary(bare_runs)
        result["full_path"]["ratio_to_bare"] = round(
            result["full_path"]["images_per_s"] / result["bare_loop"]["images_per_s"], 4)
    result["overhead"] = overhead(timing_before, timing_after)
    if config.simulated_rate:
        rate = config.simulated_rate
        result["simulated_gpu"] = {
            "ms_per_image": config.render_ms_per_image, "sleep_bound_images_per_s": round(rate, 4),
            "efficiency": round(result["full_path"]["images_per_s"] / rate, 4),
            "worker_span_efficiency": round(result["full_path"]["worker_images_per_s"] / rate, 4)}
    done = config.jobs * len(farm_runs)
    result["cpu_ms_per_job"] = {name: round(1000 * s / done, 3) for name, s in sorted(cpu.items())}
    result["cpu_ms_per_job"]["total"] = round(sum(result["cpu_ms_per_job"].values()), 3)
    result["per_core"] = per_core(result["cpu_ms_per_job"], config.gpu_ms_per_image)
    return counter


def _rounds(client, stack, config: FarmBenchConfig, bare, log,
            extra=()) -> tuple[list[dict], list[dict], dict[str, float]]:
    """The measured rounds: farm runs, bare runs (none without ``bare``) and the CPU seconds each
    farm process (the stack's, and ``extra`` processes) spent in the farm runs, by process name."""
    processes = [*stack.processes, *extra]
    assert config.jobs is not None  # a resolved config
    farm_runs, bare_runs = [], []
    cpu: dict[str, float] = {}
    for r in range(config.rounds):
        order = ("bare", "farm") if r % 2 == 0 else ("farm", "bare")
        for what in order:
            if what == "farm":
                before = cpu_snapshot(processes)
                run = _run_farm(client, config, config.jobs, offset=r * config.jobs)
                for name, seconds in cpu_snapshot(processes).items():
                    cpu[name] = cpu.get(name, 0.0) + seconds - before.get(name, seconds)
                farm_runs.append(run)
                log(f"round {r + 1} farm: {run['images_per_s']:.3f} img/s end to end, "
                    f"{run['worker_images_per_s']:.3f} on the worker(s) (load {load_average()[0]})")
            elif bare is not None:
                run = _run_bare(bare, config, config.jobs, offset=r * config.jobs)
                bare_runs.append(run)
                log(f"round {r + 1} bare: {run['images_per_s']:.3f} img/s (load {load_average()[0]})")
    return farm_runs, bare_runs, cpu


def _summary(runs: list[dict]) -> dict:
    key = "images_per_s"
    out = {"runs": runs, key: round(statistics.median(r[key] for r in runs), 4)}
    if runs and "worker_images_per_s" in runs[0]:
        out["worker_images_per_s"] = round(statistics.median(r["worker_images_per_s"] for r in runs), 4)
    return out
