"""The worker's start-up: load the renderer, size the batch, then warm every shape up before the
queue is consumed, reporting ``loading``, ``sizing``, ``warming`` and then ``ready``.

Place in the data flow: worker start-up → **here** → pipeline (:func:`pipeline.warm.prepare_renderer`,
:func:`pipeline.sizing.size_batch`, :func:`pipeline.ready.get_ready`) → the worker's heartbeat
(registered before the load) and state file, which say each state with its progress and an
estimate, then ``ready``; only then does the consumer start (:mod:`worker.main`). The pipeline's
lifecycle (load, optimize, size the batch, warm up) is :mod:`pipeline`'s; this module only runs it
for the worker and reports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from infra.heap import freeze_startup_objects
from infra.pools import PoolSpec
from infra.settings import Settings
from infra.state.registry import STARTUP_STATES
from infra.storage.compile_artifacts import CompileCacheStore
from pipeline.null import NULL_MODEL, NullRenderer

log = logging.getLogger("renderfarm.worker")
DEFAULT_NULL_BATCH = 64


def pool_options(spec: PoolSpec | None, settings: Settings):
    """The :class:`pipeline.pool_options.PoolOptions` of the declared pool ``spec``; without one,
    None (or LoRA adapters and ControlNets on when ``RENDERFARM_LORAS`` / ``RENDERFARM_CONTROLS``
    declare some; a compiled worker then warms each declared ControlNet alone, the default of
    ``PoolSpec.control_sets``)."""
    from pipeline.pool_options import PoolOptions

    if spec is None:  # an undeclared pool: RENDERFARM_LORAS and RENDERFARM_CONTROLS declare its inputs
        if not settings.loras and not settings.controls:
            return None
        return PoolOptions(lora_adapters=bool(settings.loras), controlnets=bool(settings.controls))
    return PoolOptions(family=spec.model_family, max_pixels=spec.max_pixels, steps=spec.steps, use_pe=spec.use_pe,
                       batch_invariant=spec.batch_invariant, upscalers=spec.upscalers, sizes=spec.sizes,
                       guidance_scale=spec.guidance_scale, lora_adapters=bool(spec.loras),
                       controlnets=bool(spec.controls), control_sets=spec.control_sets)


def load_renderer(args: argparse.Namespace, settings: Settings, spec: PoolSpec | None,
                  cache: CompileCacheStore | None = None) -> tuple[Any, dict]:
    """The loaded (not yet sized or warmed) renderer for ``args.model`` (the null renderer, or a
    diffusers pipeline) and the device profile. It loads only the declared pool's upscalers, or
    without a declared pool those of ``RENDERFARM_UPSCALERS``. ``cache`` shares the converted
    OpenVINO models between workers (the farm's bucket; a missing or corrupt entry only means
    converting, with one log line)."""
    if args.model == NULL_MODEL:
        return NullRenderer(settings.null_render_ms_per_image), {"kind": "none"}
    from pipeline.warm import prepare_renderer  # heavy: torch and diffusers

    # an undeclared pool loads only RENDERFARM_UPSCALERS, whatever a request names
    return prepare_renderer(args.model, args.device, args.recipe or settings.recipe, settings.recipe_overrides,
                            pool=pool_options(spec, settings), upscalers=settings.upscaler_names, ir_store=cache)


def size_renderer(renderer: Any, profile: dict, args: argparse.Namespace, settings: Settings, spec: PoolSpec | None,
                  cache: CompileCacheStore | None, state: StartupState) -> int:
    """The worker's batch size (images): the flag, the setting, or :func:`pipeline.sizing.size_batch`
    (the sizing record kept in the farm's bucket beside the compile cache, else measured at the
    largest size the pool serves and kept), then capped by the pool's ``max_batch`` when it
    declares one. The null renderer's default is :data:`DEFAULT_NULL_BATCH`. Reports ``sizing``
    with progress in ``state`` while it measures; the sizing report lands in ``state.sizing``."""
    batch_size = args.batch_size or settings.batch_size
    if not batch_size and args.model == NULL_MODEL:
        batch_size = DEFAULT_NULL_BATCH
    if not batch_size:
        from pipeline.sizing import record_name, size_batch

        state.enter("sizing")
        fetch = (lambda key: cache.get(record_name(key))) if cache is not None else None
        store = (lambda key, blob: cache.put(record_name(key), blob, key.fields)) if cache is not None else None
        state.sizing = size_batch(renderer, profile, fetch=fetch, store=store, on_progress=state.update)
        batch_size = state.sizing["batch_size"]
    if spec is not None and spec.max_batch is not None and batch_size > spec.max_batch:
        log.info("batch size %d capped to pool %s's max_batch %d", batch_size, spec.name, spec.max_batch)
        batch_size = spec.max_batch
    return batch_size


class StartupState:
    """The worker's start-up state for its heartbeat and probes: ``loading`` (the pipeline), then
    ``sizing`` (the batch size, :mod:`pipeline.sizing`; skipped when the batch size is given), then
    ``warming`` (every batch bucket × served size), then ``ready`` (takes jobs). ``progress`` is the
    current state's ``{done, total, eta_s}`` (renders; seconds; ``eta_s`` extrapolated from the
    renders so far, else the estimate for the state); ``phases`` the seconds each finished state
    took; ``estimates`` the seconds each state took at the pool's last start (:class:`StartupTimes`;
    empty on a first start). With ``state_file`` set (``RENDERFARM_WORKER_STATE_FILE``) the state is
    also written there, one word, for the chart's exec probes (``grep -qx ready FILE``).
    ``on_change``: called after each update (the worker beats its heartbeat)."""

    STATES = STARTUP_STATES

    def __init__(self, state_file: str = "", estimates: dict[str, float] | None = None,
                 on_change: Callable[[], object] | None = None) -> None:
        self.state = "loading"
        self.state_started = time.time()  # epoch seconds
        self.estimates = dict(estimates or {})
        self.progress: dict = {"done": 0, "total": None, "eta_s": self._estimate_left()}
        self.phases: dict[str, float] = {}
        self.sizing: dict | None = None
        self.report: dict | None = None
        self.ready_at: float | None = None  # epoch seconds
        self.state_file = state_file
        self.on_change = on_change or (lambda: None)
        self._write()

    def enter(self, state: str) -> None:
        """Leave the current state (its seconds go to ``phases``) for ``state`` (one of :attr:`STATES`).

        Raises:
            ValueError: not a start-up state.
        """
        if state not in self.STATES:
            raise ValueError(f"unknown start-up state {state!r}; states: {', '.join(self.STATES)}")
        now = time.time()
        self.phases[self.state] = round(now - self.state_started, 3)
        self.state, self.state_started = state, now
        if state != "ready":  # once ready, the warm-up's last progress stays (done = total)
            self.progress = {"done": 0, "total": None, "eta_s": self._estimate_left()}
        self._write()
        self.on_change()

    def update(self, done: int, total: int, eta_s: float | None) -> None:
        """Progress of the current state (``on_progress`` of the sizing and the warm-up)."""
        if eta_s is None:
            eta_s = self._estimate_left()
        self.progress = {"done": done, "total": total, "eta_s": None if eta_s is None else round(eta_s, 1)}
        self.on_change()

    def ready(self, report: dict | None) -> None:
        """Warm-up done: take jobs."""
        self.report = report
        self.enter("ready")
        self.ready_at = self.state_started

    def describe(self) -> dict:
        """For the heartbeat: ``state``, ``warmup`` (the current state's progress, and once ready the
        warm-up report and ``ready_at``) and ``startup`` (``phases``, ``estimates``,
        ``state_started_at``, the ``sizing`` report)."""
        progress = dict(self.progress)
        if self.state != "ready" and progress.get("total") is None:
            progress["eta_s"] = self._estimate_left()  # no renders yet: the estimate, counted down
        return {"state": self.state, "warmup": {**progress, "report": self.report, "ready_at": self.ready_at},
                "startup": {"phases": self.phases, "estimates": self.estimates, "state_started_at": self.state_started,
                            "sizing": self.sizing}}

    def _estimate_left(self) -> float | None:
        """Seconds left by the last start's time for this state; None without one, or once less
        than 0.05 s of it is left (this start takes longer: a measurement the last one read from
        its record), so that a state the last start passed in an instant never reads as 0 s left."""
        estimate = self.estimates.get(self.state)
        left = None if estimate is None else estimate - (time.time() - self.state_started)
        return None if left is None or left < 0.05 else round(left, 1)

    def _write(self) -> None:
        if not self.state_file:
            return
        tmp = f"{self.state_file}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(self.state + "\n")
        os.replace(tmp, self.state_file)  # atomic: a probe never reads half a word


class StartupTimes:
    """The seconds each start-up state took at a pool's last start, kept in the farm's bucket beside
    the compile cache (``compile-cache/startup-<pool>-<model>.bin``, JSON): the next start's
    estimates (:class:`StartupState`). A hint, not a fact: any failure reads as no estimate."""

    def __init__(self, cache: CompileCacheStore | None, pool: str, model: str):
        self.cache = cache
        self.key = "startup-" + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{pool}-{model}")[-120:]

    def load(self) -> dict[str, float]:
        """``{state: seconds}`` of the last start, or ``{}``."""
        try:
            blob = self.cache.get(self.key) if self.cache is not None else None
            raw = json.loads(blob) if blob else {}
            return {str(k): float(v) for k, v in raw.items() if k in StartupState.STATES}
        except Exception as exc:  # a hint: S3 away or a bad entry only means no estimate
            log.info("no start-up estimate (%s: %s)", type(exc).__name__, exc)
            return {}

    def save(self, phases: dict[str, float]) -> None:
        """Keep ``phases`` for the next start (logged, never raised)."""
        if self.cache is None:
            return
        try:
            self.cache.put(self.key, json.dumps(phases).encode())
        except Exception as exc:
            log.warning("could not keep the start-up times: %s: %s", type(exc).__name__, exc)


class WarmUp:
    """The warm-up as a part of the worker: :meth:`start` enters ``warming`` and warms ``renderer`` up (every batch
    bucket × declared size, :func:`pipeline.warm.warm_up`; nothing for the null renderer),
    reporting each step of its progress to ``state`` (which beats the heartbeat on each change),
    then reports ``ready`` and freezes the start-up objects out of full garbage collections. The shared compile cache is
    restored before the first compile and saved after a warm-up that compiled
    (:func:`pipeline.ready.get_ready`); its outcome is the report's ``compile_cache`` (a missing,
    corrupt or mismatched artifact, or S3 being away, only means compiling, with one log line).

    Args:
        renderer: the loaded renderer (not the fault-injecting wrapper). batch_size: the worker's.
        profile: the device profile. cache: the farm's compile cache in S3.
        state: the state the heartbeat and probe read (its ``on_change`` beats the heartbeat).
        name: the worker's name (logs). started: ``time.perf_counter()`` at the process's start.
    """

    def __init__(self, renderer: Any, batch_size: int, profile: dict, cache: CompileCacheStore, state: StartupState,
                 *, name: str, started: float, times: StartupTimes | None = None):
        self.renderer, self.batch_size, self.profile, self.cache = renderer, batch_size, profile, cache
        self.state, self.name, self.started, self.times = state, name, started, times

    def start(self) -> None:
        """Warm up, then ``ready`` (blocks for the warm-up: seconds to minutes); the states'
        seconds are kept for the next start's estimates (``times``)."""
        self.state.enter("warming")
        self.state.ready(self._warm())  # beats the heartbeat (the state's on_change)
        if self.times is not None:
            self.times.save(self.state.phases)
        freeze_startup_objects("worker")  # the pipeline and the imports: full collections skip them
        log.info("worker %s ready in %.1fs", self.name, time.perf_counter() - self.started)

    def stop(self) -> None:
        """Nothing to stop: the warm-up ended in :meth:`start`."""

    def describe(self) -> dict:
        """For the heartbeat: the start-up state (:meth:`StartupState.describe`), the static batch
        buckets, and the renders counted since (``recompiles``, ``eager_renders``,
        ``compiled_renders``, :mod:`pipeline.compile_count`)."""
        return {**self.state.describe(), "buckets": list(getattr(self.renderer, "buckets", None) or ()),
                "recompiles": self._compiles(),
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
        cache = self.cache
        ready = get_ready(self.renderer, self.profile, plan, fetch=lambda key: cache.get(key.name),
                          store=lambda key, blob: cache.put(key.name, blob, key.fields),
                          on_progress=self.state.update)  # the state beats the heartbeat on each change
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
