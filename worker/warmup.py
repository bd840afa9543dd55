"""The worker's warm-up part: load the renderer and size the batch, then warm every shape up
before the queue is consumed, reporting ``warming`` and then ``ready``.

Place in the data flow: worker start-up → **here** → pipeline (:func:`pipeline.warm.prepare_renderer`,
:func:`pipeline.ready.get_ready`) → the worker's heartbeat and state file, which say ``warming``
with progress, then ``ready``; only then does the consumer start (:mod:`worker.main`). The
pipeline's lifecycle (load, optimize, warm up, size the batch) is :mod:`pipeline.warm`'s; this
module only runs it for the worker and reports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from infra.heap import freeze_startup_objects
from infra.pools import PoolSpec
from infra.settings import Settings
from infra.storage.compile_artifacts import CompileCacheStore
from pipeline.null import NULL_MODEL, NullRenderer

log = logging.getLogger("renderfarm.worker")
DEFAULT_NULL_BATCH = 64


def load_renderer(args: argparse.Namespace, settings: Settings, spec: PoolSpec | None,
                  cache: CompileCacheStore | None = None) -> tuple[Any, dict, int]:
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


class WarmUp:
    """The warm-up as a part of the worker: :meth:`start` warms ``renderer`` up (every batch
    bucket × declared size, :func:`pipeline.warm.warm_up`; nothing for the null renderer),
    calling ``beat`` (a heartbeat) at each step of its progress, then reports ``ready``
    (``state``), beats once more and
    freezes the start-up objects out of full garbage collections. The shared compile cache is
    restored before the first compile and saved after a warm-up that compiled
    (:func:`pipeline.ready.get_ready`); its outcome is the report's ``compile_cache`` (a missing,
    corrupt or mismatched artifact, or S3 being away, only means compiling, with one log line).

    Args:
        renderer: the loaded renderer (not the fault-injecting wrapper). batch_size: the worker's.
        profile: the device profile. cache: the farm's compile cache in S3.
        state: the state the heartbeat and probe read. beat: a heartbeat now (never raises).
        name: the worker's name (logs). started: ``time.perf_counter()`` at the process's start.
    """

    def __init__(self, renderer: Any, batch_size: int, profile: dict, cache: CompileCacheStore, state: WarmState,
                 beat: Callable[[], object], *, name: str, started: float):
        self.renderer, self.batch_size, self.profile, self.cache = renderer, batch_size, profile, cache
        self.state, self.beat, self.name, self.started = state, beat, name, started

    def start(self) -> None:
        """Warm up, then ``ready`` (blocks for the warm-up: seconds to minutes)."""
        self.state.ready(self._warm())
        self.beat()
        freeze_startup_objects("worker")  # the pipeline and the imports: full collections skip them
        log.info("worker %s ready in %.1fs", self.name, time.perf_counter() - self.started)

    def stop(self) -> None:
        """Nothing to stop: the warm-up ended in :meth:`start`."""

    def describe(self) -> dict:
        """For the heartbeat: the state, the warm-up's progress and report, the static batch
        buckets, and the renders counted since (``recompiles``, ``eager_renders``,
        ``compiled_renders``, :mod:`pipeline.compile_count`)."""
        warm = self.state
        return {"state": warm.state, "warmup": {**warm.progress, "report": warm.report, "ready_at": warm.ready_at},
                "buckets": list(getattr(self.renderer, "buckets", None) or ()), "recompiles": self._compiles(),
                "eager_renders": getattr(self.renderer, "eager_renders", 0),
                "compiled_renders": getattr(self.renderer, "compiled_renders", 0)}

    def _warm(self) -> dict | None:
        """The warm-up report, or None for the null renderer (nothing to warm)."""
        if not hasattr(self.renderer, "capabilities"):
            return None
        from pipeline import compile_count
        from pipeline.ready import get_ready
        from pipeline.warm import warm_plan

        plan = warm_plan(self.renderer, getattr(self.renderer, "pool", None), self.batch_size)

        def on_progress(done: int, total: int, eta_s: float | None) -> None:
            self.state.update(done, total, eta_s)
            self.beat()

        cache = self.cache
        ready = get_ready(self.renderer, self.profile, plan, fetch=lambda key: cache.get(key.name),
                          store=lambda key, blob: cache.put(key.name, blob, key.fields), on_progress=on_progress)
        return {**ready["warm_up"], "compiles_before_ready": compile_count.compiles(),
                "compile_cache": ready["compile_cache"]}

    def _compiles(self) -> int | None:
        """TorchDynamo compilations since the warm-up ended (0 is the goal: :mod:`pipeline.compile_count`);
        None before it ends or for the null renderer."""
        report = self.state.report
        if report is None or "compiles_before_ready" not in report:
            return None
        from pipeline import compile_count

        return compile_count.compiles() - report["compiles_before_ready"]
