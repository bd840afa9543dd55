"""``renderfarm worker``: one process, one accelerator, one warm pipeline, one pool's queue.

Data flow: **worker** pulls batches from its pool's queue → pipeline → storage → job-state
store. Start-up: check ``--pool``/``--model`` against the declared pools (``RENDERFARM_POOLS``;
a declared pool's model must match, its ``max_batch`` caps the batch size), probe the device,
load the pipeline once, warm it up with one render,
register with a heartbeat, then consume. SIGTERM is Celery's warm shutdown: no new batch is
taken, the current one finishes, and unstarted prefetched messages go back to the queue.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

import redis

from infra.pools import PoolConfigError, pool_for_model, queue_name, worker_pool
from infra.queue import make_celery
from infra.settings import get_settings
from infra.storage import Storage
from infra.store import JobStore
from worker.heartbeat import Heartbeat
from worker.renderers import NULL_MODEL, NullRenderer
from worker.runner import BatchRunner
from worker.tasks import install_render_task, set_batch_size

log = logging.getLogger("renderfarm.worker")
DEFAULT_NULL_BATCH = 64


def _load_renderer(args: argparse.Namespace, settings) -> tuple[object, dict, int]:
    """The warm renderer for ``args.model`` (the null renderer, or a diffusers pipeline), the
    device profile, and the batch size: the flag, the setting, or measured from memory."""
    if args.model == NULL_MODEL:
        return NullRenderer(), {"kind": "none"}, args.batch_size or settings.batch_size or DEFAULT_NULL_BATCH
    from worker.warm import batch_size_from_memory, prepare_renderer  # heavy: torch and diffusers

    renderer, profile = prepare_renderer(args.model, args.device, args.recipe or settings.recipe,
                                         settings.recipe_overrides)
    renderer.warmup()
    batch_size = args.batch_size or settings.batch_size or batch_size_from_memory(renderer, profile)
    return renderer, profile, batch_size


def run_worker(args: argparse.Namespace) -> int:
    """Run one worker until SIGTERM/SIGINT. Returns the process exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    try:  # a worker whose --pool/--model contradict RENDERFARM_POOLS would take the wrong jobs
        spec = worker_pool(settings.pools, args.pool, args.model)
    except PoolConfigError as exc:
        raise SystemExit(f"renderfarm worker: {exc}") from None
    pool = spec.name if spec else (args.pool or pool_for_model(args.model))
    name = args.name or f"{pool}@{socket.gethostname()}-{os.getpid()}"
    t0 = time.perf_counter()
    renderer, device_info, batch_size = _load_renderer(args, settings)
    if spec is not None and batch_size > spec.max_batch:
        log.info("batch size %d capped to pool %s's max_batch %d", batch_size, pool, spec.max_batch)
        batch_size = spec.max_batch
    log.info("worker %s: model %s ready in %.1fs, batch size %d, queue %s",
             name, args.model, time.perf_counter() - t0, batch_size, queue_name(pool))

    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    store = JobStore(client, job_ttl_s=settings.job_ttl_s)
    storage = Storage(settings)
    app = make_celery(settings)
    state = {"batch_size": batch_size}

    def on_oom(group_size: int) -> None:
        state["batch_size"] = max(1, min(state["batch_size"], group_size) // 2)
        set_batch_size(task, state["batch_size"])
        log.warning("batch size lowered to %d after an out-of-memory error", state["batch_size"])

    runner = BatchRunner(store, storage, renderer, name, on_oom=on_oom)
    task = install_render_task(app, runner, batch_size=batch_size, flush_interval_s=settings.flush_interval_s)
    started_at = time.time()

    def describe() -> dict:
        return {"model": args.model, "pool": pool, "queue": queue_name(pool), "device": device_info,
                "recipe": getattr(renderer, "recipe", None), "batch_size": state["batch_size"],
                "pid": os.getpid(), "host": socket.gethostname(), "started_at": started_at,
                "images_done": runner.images_done, "jobs_failed": runner.jobs_failed,
                "current_jobs": [j.job_id for j in runner.current_jobs()], "healthy": True}

    heartbeat = Heartbeat(client, name, describe, interval_s=settings.heartbeat_interval_s,
                          ttl_s=settings.heartbeat_ttl_s, on_beat=lambda: store.renew_leases(runner.current_jobs()))
    heartbeat.beat()
    heartbeat.start()
    try:
        app.worker_main([
            "worker", "--pool", "solo", "--concurrency", "1", "--queues", queue_name(pool),
            "--hostname", name, "--prefetch-multiplier", str(2 * batch_size), "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel", args.loglevel,
        ])
    finally:
        heartbeat.stop()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm worker`` to the CLI."""
    p = subparsers.add_parser("worker", help="run one worker that renders one pool's jobs")
    p.add_argument("--model", required=True, help="hub id, local path, an offline name (tiny, sd15-arch, …) or null")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps, xpu or npu")
    p.add_argument("--recipe", default=None,
                   help="exact (default: RENDERFARM_RECIPE), fast (allows approximations: half precision, tiny VAE…), baseline, or a named recipe")
    p.add_argument("--pool", default=None, help="pool to serve: a declared pool of RENDERFARM_POOLS whose model must be "
                                                "--model (default: the one declared pool of the model, or, with "
                                                "none declared, derived from the model)")
    p.add_argument("--batch-size", type=int, default=0, help="jobs per batch (default: measured from device memory, capped by the recipe)")
    p.add_argument("--name", default=None, help="worker name (default: pool@host-pid)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=lambda args: sys.exit(run_worker(args)))
