"""Getting a loaded pipeline ready: restore the compile cache, warm up every bucket, save what compiled.

Place in the data flow: ``renderfarm worker`` (and ``renderfarm bench ready``) → load the pipeline
(:func:`pipeline.warm.prepare_renderer`) → **here** → consume. Storage is the caller's: the worker
passes functions that get and put blobs in S3 (``infra.storage.compile_cache``), the bench passes
functions over files, so nothing here knows S3.

The warm-up plan and the warm-up itself are ``pipeline.warm.warm_plan`` / ``warm_up`` (static
batch buckets × the pool's sizes, the pool's steps and guidance). Where this checkout's
``pipeline.warm`` does not have them yet, :func:`plan_for` and :func:`warm` fall back to a plan of
buckets 1 and 2 (capped by the batch size) at the pool's largest square size, rendered once each
when the recipe compiles (else one small render, as before).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import warm as _warm
from pipeline.compile_cache import (
    CacheKey,
    CacheOutcome,
    cache_key,
    compile_counters,
    export_artifacts,
    import_artifacts,
    log_outcome,
)

log = logging.getLogger("renderfarm.worker")

Fetch = Callable[[CacheKey], "bytes | None"]
Store = Callable[[CacheKey, bytes], None]


@dataclass(frozen=True)
class FallbackPlan:
    """A warm-up plan of the shape of ``pipeline.warm.WarmPlan``: batch sizes ascending, (width,
    height) pixels, denoising steps and the guidance scale."""

    buckets: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]
    steps: int
    guidance_scale: float


def plan_for(renderer, pool, batch_size: int):
    """The warm-up plan for ``renderer`` serving ``pool`` (a :class:`pipeline.warm.PoolOptions` or
    None) at batches of up to ``batch_size`` images: ``pipeline.warm.warm_plan`` where it exists."""
    if hasattr(_warm, "warm_plan"):
        return _warm.warm_plan(renderer, pool, batch_size)
    width, height, _ = _warm.sizing_shape(renderer, pool)
    steps = getattr(pool, "steps", None) or 1
    guidance = 7.5 if renderer.capabilities.guidance_scale else 0.0
    buckets = tuple(b for b in (1, 2) if b <= max(1, batch_size))
    return FallbackPlan(buckets, ((width, height),), steps, guidance)


def warm(renderer, plan, on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Render every (bucket × size) of ``plan`` once; returns ``{"seconds", "renders"}`` (and what
    ``pipeline.warm.warm_up`` adds where it exists). ``on_progress(done, total)`` after each render."""
    if hasattr(_warm, "warm_up"):
        return _warm.warm_up(renderer, plan, on_progress=on_progress)
    started = time.perf_counter()
    if not compiles_anything(renderer):  # nothing to compile: one small render loads kernels and allocators
        return {"seconds": renderer.warmup(), "renders": 1}
    shapes = [(b, w, h) for w, h in plan.sizes for b in plan.buckets]
    for i, (bucket, width, height) in enumerate(shapes):
        requests = _warm.sizing_requests(renderer, bucket, width=width, height=height, steps=plan.steps)
        renderer.render([r.model_copy(update={"guidance_scale": plan.guidance_scale}) for r in requests])
        if on_progress:
            on_progress(i + 1, len(shapes))
    return {"seconds": time.perf_counter() - started, "renders": len(shapes)}


def compiles_anything(renderer) -> bool:
    """Whether the recipe in force compiles a module (else there is no cache to restore or save)."""
    report = (getattr(renderer, "recipe", None) or {}).get("report") or {}
    return "compile" in (report.get("applied") or ())


def restore(key: CacheKey, fetch: Fetch) -> CacheOutcome:
    """Fetch the blob stored under ``key`` and hot-load it; logs one line with the outcome. Never
    raises: a failed fetch is the outcome ``error`` (and the warm-up compiles)."""
    started = time.perf_counter()
    try:
        blob = fetch(key)
    except Exception as exc:
        outcome = CacheOutcome(key.name, "error", f"fetch failed: {type(exc).__name__}: {exc}", 0,
                               time.perf_counter() - started)
    else:
        outcome = import_artifacts(blob, key, seconds=time.perf_counter() - started)
    log_outcome(outcome)
    return outcome


def save(key: CacheKey, outcome: CacheOutcome, store: Store) -> None:
    """After a warm-up that compiled (``fxgraph_cache_miss`` > 0, or a restore that was not a hit),
    export the artifacts and store them under ``key``; records ``outcome.saved``. Never raises."""
    if outcome.outcome == "hit" and compile_counters()["fxgraph_cache_miss"] == 0:
        return
    started = time.perf_counter()
    try:
        blob = export_artifacts(key)
        if blob is None:
            return
        store(key, blob)
    except Exception as exc:
        outcome.saved = {"error": f"{type(exc).__name__}: {exc}"}
        log.warning("compile cache: could not save %s: %s: %s", key.name, type(exc).__name__, exc)
        return
    outcome.saved = {"bytes": len(blob), "seconds": round(time.perf_counter() - started, 3)}
    log.info("compile cache saved: %s (%d bytes, %.2fs)", key.name, len(blob), time.perf_counter() - started)


def get_ready(renderer, profile: dict, plan, *, fetch: Fetch | None, store: Store | None,
              on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Restore, warm up, save: the start-up between loading and consuming.

    Returns ``{"warm_up": <warm()'s report>, "compile_cache": <CacheOutcome.to_dict()> or None,
    "counters": compile_counters() after the warm-up}``. ``compile_cache`` is None when the recipe
    compiles nothing, or no ``fetch`` was given. Storage failures never raise here.
    """
    outcome = None
    if fetch is not None and compiles_anything(renderer):
        key = cache_key(renderer.model, renderer.recipe, profile, plan)
        outcome = restore(key, fetch)
    report = warm(renderer, plan, on_progress=on_progress)
    if outcome is not None and store is not None:
        save(key, outcome, store)
    return {"warm_up": report, "compile_cache": outcome.to_dict() if outcome else None,
            "counters": compile_counters()}


__all__ = ["FallbackPlan", "compiles_anything", "get_ready", "plan_for", "restore", "save", "warm"]
