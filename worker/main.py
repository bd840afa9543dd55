"""``renderfarm worker``: one process, one accelerator, one warm pipeline, one pool's queue.

Data flow: **worker** pulls batches from its pool's queue → pipeline → storage → job-state
store. Start-up: check ``--pool``/``--model`` against the declared pools (``RENDERFARM_POOLS``;
a declared pool's model must match, its ``max_batch`` caps the batch size), register with a
heartbeat as ``loading`` (the worker is listed from its first seconds), probe the device and
load the pipeline once (``loading``), size the batch (``sizing``: the record kept beside the
compile cache, else measured, :mod:`pipeline.sizing`), warm up every batch bucket × served size
(``warming``: :func:`pipeline.warm.warm_up`; the shared compile cache in S3 is restored before
and saved after, :mod:`pipeline.ready`, and reported in the heartbeat as ``compile_cache``),
then report ``ready`` and consume: the Celery consumer starts only then.
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

Parts (as Celery's bootsteps: each a small object with ``start`` and ``stop``, started in this
order and, once the consumer has run, stopped in reverse): the batch runner
(:mod:`worker.runner`; its stop releases jobs still held), the circuit breaker
(:class:`worker.breaker.ConsumerBreaker`; its start checks the S3 credentials), the heartbeat
(:mod:`worker.heartbeat`), the warm-up (:mod:`worker.warmup`), the render watchdog
(:mod:`worker.watchdog`), Celery's worker heartbeat (:class:`worker.observe.CeleryHeartbeat`)
and the consumer (:mod:`worker.consumer`; its start runs Celery's worker until shutdown, its
stop finishes the batches in flight). :func:`run_worker` builds them; :func:`describe` is what
the heartbeat publishes, each part adding its own fields.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

from celery.utils.nodenames import default_nodename

from infra import keys
from infra.broker.app import make_celery
from infra.broker.publish import republish
from infra.pools import PoolConfigError, PoolSpec, pool_for_model, worker_pool
from infra.settings import Settings, get_settings
from infra.state.connect import state_client
from infra.state.job_store import JobStore
from infra.storage.compile_artifacts import CompileCacheStore
from infra.storage.input_images import load_input
from infra.storage.s3 import Storage
from pipeline.null import NULL_MODEL
from worker import faults
from worker.breaker import ConsumerBreaker
from worker.consumer import Consumer
from worker.errors import credentials_problem
from worker.faults import wrap_renderer
from worker.heartbeat import Heartbeat
from worker.inputs import make_adapters, make_controlnets, make_ip_adapters
from worker.observe import CeleryHeartbeat
from worker.runner import BatchRunner
from worker.warmup import StartupState, StartupTimes, WarmUp, load_renderer, size_renderer
from worker.watchdog import RenderWatchdog

log = logging.getLogger("renderfarm.worker")


class Part(Protocol):
    """A part of the worker: started in order, stopped in reverse."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _identity(args: argparse.Namespace, settings: Settings) -> tuple[PoolSpec | None, str, str]:
    """The declared pool this worker serves (None: undeclared), its pool name and its worker name.
    Exits when ``--pool``/``--model`` contradict ``RENDERFARM_POOLS`` (the worker would take the
    wrong jobs)."""
    try:
        spec = worker_pool(settings.pools, args.pool, args.model)
    except PoolConfigError as exc:
        raise SystemExit(f"renderfarm worker: {exc}") from None
    pool = spec.name if spec else (args.pool or pool_for_model(args.model))
    return spec, pool, args.name or f"{pool}@{socket.gethostname()}-{os.getpid()}"


def _attach_inputs(renderer: Any, spec: PoolSpec | None, storage: Storage, settings: Settings) -> None:
    """img2img, inpainting and control units read their input images, and the declared adapters
    and ControlNets their files, from the farm's bucket only."""
    inner = getattr(renderer, "inner", renderer)
    if hasattr(inner, "input_loader"):
        inner.input_loader = functools.partial(load_input, storage, max_pixels=settings.input_max_pixels)
        inner.adapters = make_adapters(inner, spec.loras if spec is not None else settings.loras, storage, settings)
        controls = spec.controls if spec is not None else settings.controls
        inner.controlnets = make_controlnets(inner, controls, storage, settings)
        inner.ip_adapters = make_ip_adapters(inner, controls, settings)


def run_worker(args: argparse.Namespace) -> int:
    """Run one worker until SIGTERM/SIGINT. Returns the process exit status (0 after a warm shutdown).

    Raises:
        SystemExit: ``--pool``/``--model`` contradict the declared pools.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    spec, pool, name = _identity(args, settings)
    queue = keys.queue(pool)
    t0 = time.perf_counter()
    upload_threads = settings.resolved_upload_threads()
    # put_once retries outages for upload_retry_s; one connection per upload thread (+ a spare for deletes)
    storage = Storage(settings, max_attempts=3, max_pool_connections=upload_threads + 2)
    cache = CompileCacheStore(storage)
    client = state_client(settings.state_url)
    static: dict[str, Any] = {"model": args.model, "pool": pool, "queue": queue, "pid": os.getpid(),
                              "host": socket.gethostname(), "started_at": time.time()}
    startup = StartupState(settings.worker_state_file, on_change=lambda: heartbeat.beat_quietly())
    # registered before the load: /v1/workers lists it as loading from its first seconds; the
    # describe and lease renewal of a loaded worker replace these once its parts exist
    heartbeat = Heartbeat(client, name, lambda: {**static, **startup.describe()},
                          interval_s=settings.heartbeat_interval_s, ttl_s=settings.heartbeat_ttl_s)
    heartbeat.start()
    # the null model loads nothing worth estimating: it keeps no start-up times in the bucket
    times = StartupTimes(cache if args.model != NULL_MODEL else None, pool, args.model)
    startup.estimates = times.load()  # the pool's last start: each state's estimate, from now on
    heartbeat.beat_quietly()
    try:
        loaded, device_info = load_renderer(args, settings, spec, cache)
        static.update(device=device_info, recipe=getattr(loaded, "recipe", None))
        _attach_inputs(loaded, spec, storage, settings)  # before the sizing, which keeps the add-ons' bytes free
        batch_size = size_renderer(loaded, device_info, args, settings, spec, cache, startup)
    except BaseException:
        heartbeat.stop()  # a worker that cannot load is gone at once, not after its heartbeat's TTL
        raise
    static["batch_size"] = batch_size
    renderer = wrap_renderer(loaded)
    log.info("worker %s: model %s loaded in %.1fs, batch size %d, queue %s",
             name, args.model, time.perf_counter() - t0, batch_size, queue)
    store = JobStore(client, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                     max_attempts=settings.max_attempts)
    app = make_celery(settings, settings.pool_broker_url(pool))  # its pool's broker shard, else the farm's
    # the parts beat the heartbeat (started above) through lambdas
    breaker = ConsumerBreaker(settings.breaker_failures, settings.breaker_cooldown_s, queue,
                              credentials_problem=functools.partial(credentials_problem, storage),
                              on_change=lambda: heartbeat.beat_quietly())
    watchdog = RenderWatchdog(settings.render_stall_s, on_stall=lambda reason: heartbeat.stop())
    test_counters = faults.counters(client)
    runner = BatchRunner(store, storage, renderer, name, job_timeout_s=settings.job_timeout_s,
                         upload_retry_s=settings.upload_retry_s, upload_threads=upload_threads,
                         on_requeued=lambda ids: republish(store, app, ids),
                         on_rendered=test_counters[0] if test_counters else None,
                         on_written=test_counters[1] if test_counters else None, watchdog=watchdog,
                         s_per_mpx_step=(spec.s_per_mpx_step if spec is not None and spec.s_per_mpx_step
                                         else settings.default_s_per_mpx_step))
    consumer = Consumer(app, runner, store, breaker, settings, queue=queue, name=name, batch_size=batch_size,
                        loglevel=args.loglevel)
    warm_up = WarmUp(loaded, batch_size, device_info, cache, startup, name=name, started=t0, times=times)
    heartbeat.describe = functools.partial(describe, static, warm_up, runner, consumer, breaker)
    heartbeat.on_beat = lambda: store.renew_leases(runner.current_jobs())
    celery_heartbeat = CeleryHeartbeat(app, default_nodename(name), settings.heartbeat_interval_s)
    # the heartbeat (started above) beats once more; the warm-up reports warming with progress while
    # the queue waits; the watchdog watches renders from the end of the warm-up (its compiles are not stalls)
    try:
        run_parts([runner, breaker, heartbeat, warm_up, watchdog, celery_heartbeat, consumer])
    except BaseException:
        heartbeat.stop()  # registered since before the load: a start that failed leaves the registry at once
        raise
    log.info("worker %s stopped", name)
    return 0


def run_parts(parts: Sequence[Part]) -> None:
    """Start each part in order; the last (the consumer) returns at shutdown, then every part is
    stopped, in reverse order. A part whose start raises stops nothing here: the process ends
    with the error (:func:`run_worker` deregisters its heartbeat first)."""
    *before, consumer = parts
    for part in before:
        part.start()
    try:
        consumer.start()
    finally:
        for part in reversed(parts):
            part.stop()


def describe(static: dict, warm_up: WarmUp, runner: BatchRunner, consumer: Consumer,
             breaker: ConsumerBreaker) -> dict:
    """What the worker's heartbeat publishes in the registry (``GET /v1/workers``, the farm
    metrics): ``static`` (model, pool, queue, device, recipe, batch size, pid, host, start time)
    and each part's own fields: the warm-up's state and renders, the jobs done, failed and held,
    the reserved jobs and prefetch, ``healthy`` and the breaker's state, the compile cache's
    outcome."""
    return {**static, **warm_up.describe(), "images_done": runner.images_done, "jobs_failed": runner.jobs_failed,
            "current_jobs": [j.job_id for j in runner.current_jobs()], **consumer.describe(), **breaker.describe(),
            "compile_cache": (warm_up.state.report or {}).get("compile_cache")}


def exit_after(code: int) -> None:
    """Exit with ``code`` once the worker has shut down cleanly, skipping the interpreter's
    final garbage collection of torch and diffusers (seconds, on a busy host), so that a
    SIGTERM'd worker is gone as soon as its batch is done. Logs and streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
