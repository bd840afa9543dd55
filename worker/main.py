"""``renderfarm worker``: one process, one accelerator, one warm pipeline, one pool's queue.

Data flow: **worker** pulls batches from its pool's queue → pipeline → storage → job-state
store. Start-up: check ``--pool``/``--model`` against the declared pools (``RENDERFARM_POOLS``;
a declared pool's model must match, its ``max_batch`` caps the batch size), probe the device,
load the pipeline once, restore the shared compile cache from S3 (``pipeline.ready``), warm it
up, save the compile cache when the warm-up compiled, register with a heartbeat (which reports
the cache's outcome as ``compile_cache``), then consume. SIGTERM is Celery's warm shutdown: no new batch is
taken, the current one finishes, unstarted prefetched messages go back to the queue (kombu
restores unacknowledged messages when the channel closes), the worker leaves the registry and
exits 0. Should a batch still be held at exit (a second signal: cold shutdown), its jobs are
released to ``queued`` and republished instead of waiting for their leases to expire.

Health: a circuit breaker (``worker.breaker``) stops consumption after
``breaker_failures`` consecutive failed batches, or at once on an error of this worker's
infrastructure (``worker.errors``; S3 credentials are also checked at start and before each
re-try), and reports ``healthy: false`` in the registry. A render watchdog
(``worker.watchdog``) ends the process (exit 70) when a render stops making progress for
``render_stall_s`` seconds, so that its jobs' leases expire and other workers take them.

Celery's own tools see it (:mod:`worker.observe`): it answers remote control between batches
(``celery inspect``), and sends worker heartbeats and, when task events are on, a task event
per job (Flower).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from celery import signals
from celery.utils.nodenames import default_nodename

from infra import keys
from infra.broker.app import make_celery
from infra.broker.kombu_redis import flush_acks, install_cheap_acks, install_malformed_message_guard
from infra.broker.publish import republish
from infra.pools import PoolConfigError, PoolSpec, pool_for_model, worker_pool
from infra.settings import get_settings
from infra.state.connect import state_client
from infra.state.jobs import JobStore
from infra.storage.compile_cache import CompileCacheStore
from infra.storage.s3 import Storage
from pipeline.memory import current_bytes
from pipeline.null import NULL_MODEL, NullRenderer
from worker import faults
from worker.breaker import CircuitBreaker
from worker.errors import credentials_problem
from worker.faults import wrap_renderer
from worker.heartbeat import Heartbeat
from worker.observe import CeleryHeartbeat, CeleryVisibility
from worker.runner import BatchRunner, job_ids_from_messages
from worker.tasks import install_render_task
from worker.watchdog import RenderWatchdog

log = logging.getLogger("renderfarm.worker")
DEFAULT_NULL_BATCH = 64


def _job_id(request) -> str | None:
    """The job id a Celery request carries in its kwargs, or None (a malformed message)."""
    kwargs = getattr(request, "kwargs", None)
    job_id = kwargs.get("job_id") if isinstance(kwargs, dict) else None
    return job_id if isinstance(job_id, str) else None


def _load_renderer(args: argparse.Namespace, settings, spec: PoolSpec | None) -> tuple[object, dict, int, dict]:
    """The warm renderer for ``args.model`` (the null renderer, or a diffusers pipeline), the
    device profile, the batch size (the flag, the setting, or measured from memory at the
    declared pool's largest size and steps) and what getting ready did (``compile_cache``: the
    outcome of the shared compile cache, or None). It loads only the declared pool's upscalers,
    or without a declared pool those of ``RENDERFARM_UPSCALERS``.

    Between loading and the batch sizing: restore the compile cache from S3, warm up every
    bucket of the warm-up plan, and save the artifacts when the warm-up compiled
    (:func:`pipeline.ready.get_ready`); a missing, corrupt or mismatched artifact or an S3 error
    only means compiling, with one log line."""
    if args.model == NULL_MODEL:
        batch_size = args.batch_size or settings.batch_size or DEFAULT_NULL_BATCH
        return NullRenderer(settings.null_render_ms_per_image), {"kind": "none"}, batch_size, {"compile_cache": None}
    from pipeline.ready import get_ready, plan_for
    from pipeline.warm import PoolOptions, batch_size_from_memory, prepare_renderer  # heavy: torch and diffusers

    pool = None if spec is None else PoolOptions(family=spec.model_family, max_pixels=spec.max_pixels,
                                                 steps=spec.steps, use_pe=spec.use_pe,
                                                 batch_invariant=spec.batch_invariant, upscalers=spec.upscalers)
    # an undeclared pool loads only RENDERFARM_UPSCALERS, whatever a request names
    renderer, profile = prepare_renderer(args.model, args.device, args.recipe or settings.recipe,
                                         settings.recipe_overrides, pool=pool, upscalers=settings.upscaler_names)
    cache = CompileCacheStore(Storage(settings, max_attempts=3))
    plan = plan_for(renderer, pool, args.batch_size or settings.batch_size or renderer.max_batch_size)
    ready = get_ready(renderer, profile, plan, fetch=lambda key: cache.get(key.name),
                      store=lambda key, blob: cache.put(key.name, blob, key.fields))
    if ready["compile_cache"] is not None:
        ready["compile_cache"]["counters"] = ready["counters"]
        log.info("warm-up: %d render(s) in %.1fs; compile cache %s; Inductor FX graph cache %d hit(s), %d miss(es)",
                 ready["warm_up"].get("renders", 0), ready["warm_up"].get("seconds", 0.0),
                 ready["compile_cache"]["outcome"], ready["counters"]["fxgraph_cache_hit"],
                 ready["counters"]["fxgraph_cache_miss"])
    batch_size = args.batch_size or settings.batch_size or batch_size_from_memory(renderer, profile, pool=pool)
    return renderer, profile, batch_size, ready


class ReservedJobs:
    """Job ids this worker has received but not yet started (celery-batches' buffer: its
    prefetched jobs), reported in its heartbeat so the reaper knows their messages are not lost.

    Also the most it ever held at once (:attr:`peak`) and the process's RSS in KiB at the moment
    it first held that many (:attr:`rss_at_peak_kib`, read only when the peak grows, so at most
    once per prefetch slot over the worker's life), for ``renderfarm bench farm``'s memory rows.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self.peak = 0
        self.rss_at_peak_kib: int | None = None

    def add(self, job_id: str) -> None:
        """Note a job id whose message this worker received."""
        with self._lock:
            self._ids.add(job_id)
            if len(self._ids) > self.peak:
                self.peak = len(self._ids)
                self.rss_at_peak_kib = current_bytes("cpu") // 1024

    def discard(self, job_ids) -> None:
        """Forget job ids handed to a batch (started or skipped)."""
        with self._lock:
            self._ids.difference_update(job_ids)

    def snapshot(self) -> list[str]:
        """The job ids held now, sorted (for the heartbeat)."""
        with self._lock:
            return sorted(self._ids)


def run_worker(args: argparse.Namespace) -> int:
    """Run one worker until SIGTERM/SIGINT. Returns the process exit status (0 after a warm shutdown)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    try:  # a worker whose --pool/--model contradict RENDERFARM_POOLS would take the wrong jobs
        spec = worker_pool(settings.pools, args.pool, args.model)
    except PoolConfigError as exc:
        raise SystemExit(f"renderfarm worker: {exc}") from None
    pool = spec.name if spec else (args.pool or pool_for_model(args.model))
    queue = keys.queue(pool)
    name = args.name or f"{pool}@{socket.gethostname()}-{os.getpid()}"
    t0 = time.perf_counter()
    renderer, device_info, batch_size, ready = _load_renderer(args, settings, spec)
    if spec is not None and batch_size > spec.max_batch:
        log.info("batch size %d capped to pool %s's max_batch %d", batch_size, pool, spec.max_batch)
        batch_size = spec.max_batch
    renderer = wrap_renderer(renderer)
    log.info("worker %s: model %s ready in %.1fs, batch size %d, queue %s",
             name, args.model, time.perf_counter() - t0, batch_size, queue)

    client = state_client(settings.state_url)
    store = JobStore(client, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                     max_attempts=settings.max_attempts)
    upload_threads = 8
    # put_once retries outages for upload_retry_s; one connection per upload thread (+ a spare for deletes)
    storage = Storage(settings, max_attempts=3, max_pool_connections=upload_threads + 2)
    app = make_celery(settings)
    consumer: dict = {}
    reserved = ReservedJobs()

    reopen_timer: list = []

    def arm_reopen(c) -> None:
        """One pending half-open try per cool-down (re-armed at each consumer start: a lost
        broker connection clears the event loop's timers, which would leave the breaker open)."""
        for entry in reopen_timer:
            entry.cancel()
        reopen_timer[:] = [c.timer.call_after(settings.breaker_cooldown_s, reopen)] \
            if settings.breaker_cooldown_s > 0 else []

    def reopen() -> None:
        if credentials_problem(storage):  # still refused: stay open, look again after the cool-down
            arm_reopen(consumer["c"])
            return
        breaker.half_open()
        if "c" in consumer:
            consumer["c"].add_task_queue(queue)
        heartbeat.beat_quietly()

    def on_trip() -> None:
        if "c" in consumer:  # we run inside the consumer's event loop (solo pool): safe to call
            consumer["c"].cancel_task_queue(queue)
            arm_reopen(consumer["c"])
        heartbeat.beat_quietly()

    breaker = CircuitBreaker(settings.breaker_failures, on_trip=on_trip)
    test_counters = faults.counters(client)
    watchdog = RenderWatchdog(settings.render_stall_s, on_stall=lambda reason: heartbeat.stop())
    runner = BatchRunner(store, storage, renderer, name, job_timeout_s=settings.job_timeout_s,
                         upload_retry_s=settings.upload_retry_s, upload_threads=upload_threads,
                         on_requeued=lambda ids: republish(store, app, ids),
                         on_rendered=test_counters[0] if test_counters else None,
                         on_written=test_counters[1] if test_counters else None, watchdog=watchdog)

    visibility = CeleryVisibility()

    def handle(requests) -> None:
        job_ids = job_ids_from_messages(requests, log_rejects=False)  # the runner logs them
        reserved.discard(job_ids)
        if breaker.open:  # still buffered when the breaker tripped: hand them to other workers
            republish(store, app, job_ids)
            visibility.finished(requests, None)
            return
        visibility.started(requests)
        if not settings.worker_overlap:
            try:
                outcomes = [runner.run(requests)]
            finally:
                visibility.finished(requests, store.get_jobs)
            record_outcomes(outcomes)
            return
        try:  # overlapped: returns once the batch is started, with the batches recorded since
            outcomes = runner.run_overlapped(requests)
        except BaseException:
            visibility.finished(requests, store.get_jobs)
            raise
        for request in requests:  # ready (task events, inspect) when their batch is recorded
            job_id = _job_id(request)
            if job_id is None:
                visibility.finished([request], None)
            else:
                awaiting[job_id] = request
        record_outcomes(outcomes)

    awaiting: dict[str, object] = {}  # job id → its Celery request, until its batch is recorded

    def record_outcomes(outcomes) -> None:
        """Runs in Celery's consumer thread (the batch task, or the consumer's timer)."""
        for outcome in outcomes:
            breaker.record(outcome.failed_batch, outcome.infrastructure)
            done = [awaiting.pop(j) for j in outcome.job_ids if j in awaiting]
            if done:
                visibility.finished(done, store.get_jobs)

    def on_received(sender=None, request=None, **_kw) -> None:
        kwargs = getattr(request, "kwargs", None)
        if isinstance(kwargs, dict) and isinstance(kwargs.get("job_id"), str):
            reserved.add(kwargs["job_id"])
        visibility.received(request)

    def on_ready(sender=None, **_kw) -> None:
        consumer.update(c=sender)
        visibility.bind(sender)
        if breaker.open:  # opened before the consumer ran (the credentials check)
            on_trip()

    outcome_timer: list = []

    def on_consumer_start(c) -> None:
        """Every start of the consumer (a lost broker connection clears its event loop's timers)."""
        if breaker.open and "c" in consumer:
            arm_reopen(c)
        if settings.worker_overlap:  # a batch's outcome reaches the breaker when it is recorded,
            # not only when the next batch arrives (which a tripping worker may never get); the
            # timer runs in the consumer's event loop, where on_trip may cancel the queue
            for entry in outcome_timer:
                entry.cancel()
            outcome_timer[:] = [c.timer.call_repeatedly(0.5, lambda: record_outcomes(runner.take_done()))]

    signals.task_received.connect(on_received, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    install_render_task(app, handle, batch_size=batch_size, flush_interval_s=settings.flush_interval_s,
                        on_consumer_start=on_consumer_start)
    started_at = time.time()
    prefetch = 2 * batch_size  # messages held unacked at once (Celery's prefetch, concurrency 1)

    def describe() -> dict:
        return {"model": args.model, "pool": pool, "queue": queue, "device": device_info,
                "recipe": getattr(renderer, "recipe", None), "batch_size": batch_size,
                "pid": os.getpid(), "host": socket.gethostname(), "started_at": started_at,
                "images_done": runner.images_done, "jobs_failed": runner.jobs_failed,
                "current_jobs": [j.job_id for j in runner.current_jobs()], "reserved_jobs": reserved.snapshot(),
                "prefetch": {"limit": prefetch, "peak_jobs": reserved.peak,
                             "rss_kib_at_peak": reserved.rss_at_peak_kib},
                "healthy": not breaker.open, "breaker": breaker.state(), "compile_cache": ready["compile_cache"]}

    heartbeat = Heartbeat(client, name, describe, interval_s=settings.heartbeat_interval_s,
                          ttl_s=settings.heartbeat_ttl_s, on_beat=lambda: store.renew_leases(runner.current_jobs()))
    if problem := credentials_problem(storage):
        breaker.trip(problem)
    heartbeat.beat()
    heartbeat.start()
    watchdog.start()
    celery_heartbeat = CeleryHeartbeat(app, default_nodename(name), settings.heartbeat_interval_s)
    celery_heartbeat.start()
    install_malformed_message_guard()
    install_cheap_acks()
    try:
        # Celery's worker heartbeat stays on: it keeps the worker's event dispatcher, in which
        # `celery control enable_events` (and Flower) switch the task events on.
        app.worker_main([
            "worker", "--pool", "solo", "--concurrency", "1", "--queues", queue,
            "--hostname", name, "--prefetch-multiplier", str(prefetch), "--without-gossip",
            "--without-mingle", "--loglevel", args.loglevel,
        ])
    finally:
        runner.drain()  # rendered groups still being stored: finish them (the heartbeat renews their leases)
        try:
            flush_acks()  # acks the event loop had no iteration left to send
        except Exception as exc:  # Redis away: the reaper clears the unacked entries
            log.warning("could not send the last acks: %s", exc)
        heartbeat.stop()
        celery_heartbeat.stop()
        _release(store, app, runner)
    log.info("worker %s stopped", name)
    return 0


def _release(store: JobStore, app, runner: BatchRunner) -> None:
    """Give back the jobs still held at exit (a cold shutdown interrupted a batch), so they run
    again at once instead of after their lease; a warm shutdown holds none."""
    held = runner.current_jobs()
    if not held:
        return
    try:
        released = store.release(held)
        republish(store, app, [job_id for job_id, _ in released])
        log.warning("released %d running job(s) on shutdown", len(released))
    except Exception as exc:  # Redis away: their leases expire and the reaper requeues them
        log.warning("could not release %d job(s): %s", len(held), exc)


def exit_after(code: int) -> None:
    """Exit with ``code`` once the worker has shut down cleanly, skipping the interpreter's
    final garbage collection of torch and diffusers (seconds, on a busy host), so that a
    SIGTERM'd worker is gone as soon as its batch is done. Logs and streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
