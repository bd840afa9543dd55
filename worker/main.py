"""``renderfarm worker``: one process, one accelerator, one warm pipeline, one pool's queue.

Data flow: **worker** pulls batches from its pool's queue → pipeline → storage → job-state
store. Start-up: check ``--pool``/``--model`` against the declared pools (``RENDERFARM_POOLS``;
a declared pool's model must match, its ``max_batch`` caps the batch size), probe the device,
load the pipeline once, size the batch, register with a heartbeat as ``warming``, warm up every
batch bucket × declared size (:func:`pipeline.warm.warm_up`; the shared compile cache in S3 is restored
before and saved after, :mod:`pipeline.ready`, and reported in the heartbeat as
``compile_cache``), then report ``ready`` and consume: the Celery consumer starts only then.
SIGTERM is Celery's warm shutdown: no new batch is taken, the current one finishes, unstarted
prefetched messages go back to the queue (kombu restores unacknowledged messages when the
channel closes), the worker leaves the registry and exits 0. Should a batch still be held at
exit (a second signal: cold shutdown), its jobs are released to ``queued`` and republished
instead of waiting for their leases to expire.

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
import functools
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
from infra.heap import freeze_startup_objects
from infra.pools import PoolConfigError, PoolSpec, pool_for_model, worker_pool
from infra.settings import get_settings
from infra.state.connect import state_client
from infra.state.job_store import JobStore
from infra.storage.compile_artifacts import CompileCacheStore
from infra.storage.input_images import load_input
from infra.storage.s3 import Storage
from pipeline.memory import current_bytes
from pipeline.null import NULL_MODEL, NullRenderer
from worker import faults
from worker.breaker import CircuitBreaker
from worker.errors import credentials_problem
from worker.faults import wrap_renderer
from worker.heartbeat import Heartbeat
from worker.inputs import make_adapters
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


def _load_renderer(args: argparse.Namespace, settings, spec: PoolSpec | None,
                   cache: CompileCacheStore | None = None) -> tuple[object, dict, int]:
    """The loaded (not yet warmed) renderer for ``args.model`` (the null renderer, or a diffusers
    pipeline), the device profile, and the batch size: the flag, the setting, or measured from memory
    at the declared pool's largest size and steps, then capped by the pool's ``max_batch`` when it
    declares one. It loads only the declared pool's upscalers, or without a declared pool those of
    ``RENDERFARM_UPSCALERS``. ``cache`` shares the converted OpenVINO UNet between workers (the
    farm's bucket; a missing or corrupt entry only means converting, with one log line)."""
    if args.model == NULL_MODEL:
        batch_size = args.batch_size or settings.batch_size or DEFAULT_NULL_BATCH
        return NullRenderer(settings.null_render_ms_per_image), {"kind": "none"}, batch_size
    from pipeline.warm import PoolOptions, batch_size_from_memory, prepare_renderer  # heavy: torch and diffusers

    if spec is None:  # an undeclared pool: RENDERFARM_LORAS declares its adapters
        pool = PoolOptions(lora_adapters=True) if settings.loras else None
    else:
        pool = PoolOptions(family=spec.model_family, max_pixels=spec.max_pixels, steps=spec.steps,
                           use_pe=spec.use_pe, batch_invariant=spec.batch_invariant, upscalers=spec.upscalers,
                           sizes=spec.sizes, guidance_scale=spec.guidance_scale, lora_adapters=bool(spec.loras))
    # an undeclared pool loads only RENDERFARM_UPSCALERS, whatever a request names
    renderer, profile = prepare_renderer(args.model, args.device, args.recipe or settings.recipe,
                                         settings.recipe_overrides, pool=pool, upscalers=settings.upscaler_names,
                                         ir_store=cache)
    batch_size = args.batch_size or settings.batch_size
    if not batch_size:  # measured eagerly: the sizing shapes need no compiled graph (warm-up builds those)
        from pipeline import compile_count

        with compile_count.eager():
            renderer.warmup()  # first-call allocations stay out of the measured peaks
            batch_size = batch_size_from_memory(renderer, profile, pool=pool)
    if spec is not None and spec.max_batch is not None and batch_size > spec.max_batch:
        log.info("batch size %d capped to pool %s's max_batch %d", batch_size, spec.name, spec.max_batch)
        batch_size = spec.max_batch
    return renderer, profile, batch_size


class WarmState:
    """The worker's start-up state for its heartbeat and probe: ``warming`` with progress
    ``{done, total, eta_s}`` (renders; seconds), then ``ready``; the warm-up report once done.
    With ``state_file`` set (``RENDERFARM_WORKER_STATE_FILE``) the state is also written there, one
    word, for the chart's exec probes (``grep -qx ready FILE``)."""

    def __init__(self, state_file: str = "") -> None:
        self.state = "warming"
        self.progress: dict = {"done": 0, "total": None, "eta_s": None}
        self.report: dict | None = None
        self.ready_at: float | None = None  # epoch seconds
        self.state_file = state_file
        self._write()

    def update(self, done: int, total: int, eta_s: float | None) -> None:
        """``on_progress`` of :func:`pipeline.warm.warm_up`."""
        self.progress = {"done": done, "total": total, "eta_s": None if eta_s is None else round(eta_s, 1)}

    def ready(self, report: dict | None) -> None:
        """Warm-up done: take jobs."""
        self.state, self.report, self.ready_at = "ready", report, time.time()
        self._write()

    def _write(self) -> None:
        if not self.state_file:
            return
        tmp = f"{self.state_file}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(self.state + "\n")
        os.replace(tmp, self.state_file)  # atomic: a probe never reads half a word


def _warm(renderer, batch_size: int, warm: WarmState, heartbeat: Heartbeat, profile: dict,
          cache: CompileCacheStore) -> dict | None:
    """Warm ``renderer`` up before the queue is consumed (:func:`pipeline.warm.warm_up`: every batch
    bucket × declared size), beating with the progress; None for the null renderer. The shared
    compile cache is restored before the first compile and saved after a warm-up that compiled
    (:func:`pipeline.ready.get_ready`); its outcome is the report's ``compile_cache`` (a missing,
    corrupt or mismatched artifact, or S3 being away, only means compiling, with one log line)."""
    if not hasattr(renderer, "capabilities"):  # the null renderer has nothing to warm
        return None
    from pipeline import compile_count
    from pipeline.ready import get_ready
    from pipeline.warm import warm_plan

    plan = warm_plan(renderer, getattr(renderer, "pool", None), batch_size)

    def on_progress(done: int, total: int, eta_s: float | None) -> None:
        warm.update(done, total, eta_s)
        heartbeat.beat_quietly()

    ready = get_ready(renderer, profile, plan, fetch=lambda key: cache.get(key.name),
                      store=lambda key, blob: cache.put(key.name, blob, key.fields), on_progress=on_progress)
    return {**ready["warm_up"], "compiles_before_ready": compile_count.compiles(),
            "compile_cache": ready["compile_cache"]}


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
    warm = WarmState(settings.worker_state_file)
    upload_threads = settings.resolved_upload_threads()
    # put_once retries outages for upload_retry_s; one connection per upload thread (+ a spare for deletes)
    storage = Storage(settings, max_attempts=3, max_pool_connections=upload_threads + 2)
    loaded, device_info, batch_size = _load_renderer(args, settings, spec, CompileCacheStore(storage))
    renderer = wrap_renderer(loaded)
    log.info("worker %s: model %s loaded in %.1fs, batch size %d, queue %s",
             name, args.model, time.perf_counter() - t0, batch_size, queue)

    client = state_client(settings.state_url)
    store = JobStore(client, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                     max_attempts=settings.max_attempts)
    inner = getattr(renderer, "inner", renderer)  # img2img and inpainting read their inputs from the bucket only
    if hasattr(inner, "input_loader"):
        inner.input_loader = functools.partial(load_input, storage, max_pixels=settings.input_max_pixels)
        inner.adapters = make_adapters(inner, spec.loras if spec is not None else settings.loras, storage, settings)
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
                "state": warm.state, "warmup": {**warm.progress, "report": warm.report, "ready_at": warm.ready_at},
                "buckets": list(getattr(loaded, "buckets", None) or ()),
                "recompiles": _compiles(loaded, warm), "eager_renders": getattr(loaded, "eager_renders", 0),
                "compiled_renders": getattr(loaded, "compiled_renders", 0),
                "pid": os.getpid(), "host": socket.gethostname(), "started_at": started_at,
                "images_done": runner.images_done, "jobs_failed": runner.jobs_failed,
                "current_jobs": [j.job_id for j in runner.current_jobs()], "reserved_jobs": reserved.snapshot(),
                "prefetch": {"limit": prefetch, "peak_jobs": reserved.peak,
                             "rss_kib_at_peak": reserved.rss_at_peak_kib},
                "healthy": not breaker.open, "breaker": breaker.state(),
                "compile_cache": (warm.report or {}).get("compile_cache")}

    heartbeat = Heartbeat(client, name, describe, interval_s=settings.heartbeat_interval_s,
                          ttl_s=settings.heartbeat_ttl_s, on_beat=lambda: store.renew_leases(runner.current_jobs()))
    if problem := credentials_problem(storage):
        breaker.trip(problem)
    heartbeat.beat()
    heartbeat.start()  # registered as warming: /v1/workers shows the progress, the queue waits
    warm.ready(_warm(loaded, batch_size, warm, heartbeat, device_info, CompileCacheStore(storage)))
    heartbeat.beat_quietly()
    freeze_startup_objects("worker")  # the pipeline and the imports: full collections skip them
    log.info("worker %s ready in %.1fs", name, time.perf_counter() - t0)
    watchdog.start()  # renders from here on: the warm-up's compiles are not stalls
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


def _compiles(renderer, warm: WarmState) -> int | None:
    """TorchDynamo compilations since the warm-up ended (0 is the goal: :mod:`pipeline.compile_count`);
    None before it ends or for the null renderer."""
    if warm.report is None or "compiles_before_ready" not in warm.report:
        return None
    from pipeline import compile_count

    return compile_count.compiles() - warm.report["compiles_before_ready"]


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
