"""Getting a loaded pipeline ready: restore the compile cache, warm up every bucket, save what compiled.

Place in the data flow: ``renderfarm worker`` (and ``renderfarm bench ready``) → load the pipeline
(:func:`pipeline.warm.prepare_renderer`) → **here** → consume. The warm-up itself is
:func:`pipeline.warm.warm_up` (every static batch bucket × declared size of a
:class:`pipeline.warm.WarmPlan`); this module wraps it with the shared compile cache
(:mod:`pipeline.compile_cache`): restore before the first compile, save after the last one.
Storage is the caller's: the worker passes functions that get and put blobs in S3
(``infra.storage.compile_artifacts``), the bench passes functions over files, so nothing here knows S3.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from pipeline.compile_cache import (
    CacheKey,
    CacheOutcome,
    cache_key,
    compile_counters,
    compiled_anew,
    export_artifacts,
    import_artifacts,
    log_outcome,
)
from pipeline.optimize.compile import stop_compiler_warm_up, without_precompiled_headers
from pipeline.warm import WarmPlan, warm_up

log = logging.getLogger("renderfarm.worker")

Fetch = Callable[[CacheKey], "bytes | None"]
Store = Callable[[CacheKey, bytes], None]
Progress = Callable[[int, int, "float | None"], None]


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
    """After a warm-up that compiled (``fxgraph_cache_miss`` or ``aot_compiled`` > 0, or a restore
    that was not a hit), export the artifacts and store them under ``key``; records
    ``outcome.saved``. Never raises."""
    if outcome.outcome == "hit" and compiled_anew(compile_counters()) == 0:
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


def get_ready(renderer, profile: dict, plan: WarmPlan, *, fetch: Fetch | None, store: Store | None,
              on_progress: Progress | None = None) -> dict:
    """Restore, warm up, save: the start-up between loading and consuming. After a restore that
    hit, the loader's compiler warm-up child is stopped (``renderer.compiler_warm_up``:
    :func:`pipeline.optimize.compile.stop_compiler_warm_up`) and the warm-up runs
    :func:`pipeline.optimize.compile.without_precompiled_headers`: nothing will compile, so
    neither the child's header nor Inductor's is needed.

    Args:
        renderer: the loaded :class:`pipeline.render.Renderer`.
        profile: its device profile as a dict (part of the cache key).
        plan: the warm-up plan (:func:`pipeline.warm.warm_plan`).
        fetch / store: the blob storage (None: no compile cache).
        on_progress: ``(done, total, eta_s)``, passed to :func:`pipeline.warm.warm_up`.
    Returns:
        ``{"warm_up": <warm_up()'s report>, "compile_cache": <CacheOutcome.to_dict()> with
        ``counters`` (:func:`pipeline.compile_cache.compile_counters` after the warm-up) and
        ``compiler_warm_up`` (after a hit, what :func:`stop_compiler_warm_up` returned, else
        ``"kept"``), or None when the recipe compiles nothing or no ``fetch`` was given}``.
    Raises:
        whatever :func:`pipeline.warm.warm_up` raises; storage failures never raise here.
    """
    outcome, key = None, None
    if fetch is not None and compiles_anything(renderer):
        key = cache_key(renderer.model, renderer.recipe, profile, plan)
        outcome = restore(key, fetch)
    # after a hit every CPU kernel is restored: no precompiled C++ header is needed to load them
    restored = outcome is not None and outcome.outcome == "hit"
    warm_compiler = stop_compiler_warm_up(getattr(renderer, "compiler_warm_up", None)) if restored else "kept"
    with without_precompiled_headers() if restored else contextlib.nullcontext():
        report = warm_up(renderer, plan, on_progress=on_progress)
    if outcome is None or key is None:
        return {"warm_up": report, "compile_cache": None}
    if store is not None:
        save(key, outcome, store)
    counters = compile_counters()
    log.info("compile cache %s: Inductor FX graph cache %d hit(s), %d miss(es); AOTInductor packages %d loaded, "
             "%d compiled after the warm-up", outcome.outcome, counters["fxgraph_cache_hit"],
             counters["fxgraph_cache_miss"], counters["aot_loaded"], counters["aot_compiled"])
    return {"warm_up": report,
            "compile_cache": {**outcome.to_dict(), "counters": counters, "compiler_warm_up": warm_compiler}}


__all__ = ["compiles_anything", "get_ready", "restore", "save"]
