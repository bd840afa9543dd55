"""Load a video model the way a worker pins it: probe, video recipe, load, apply, renderer.

Place in the data flow: ``renderfarm worker`` → :func:`pipeline.warm.prepare_renderer` (which
delegates here for a video family, :func:`infra.video.is_video_family`) → :class:`VideoRenderer`.
The worker's next start-up steps work on it unchanged: sizing sees ``max_batch_size`` 1 and
measures nothing (:func:`pipeline.sizing.size_batch`); the warm-up renders one short clip per
served size (:func:`pipeline.warm.warm_up`, with compile: once per size for the graphs).
"""

from __future__ import annotations

import logging
import time

from pipeline.capabilities import check_pool_family
from pipeline.device import probe
from pipeline.memory import BatchLimits
from pipeline.models.load import load_pipeline
from pipeline.pool_options import PoolOptions
from pipeline.video.apply import DTYPES, apply_video_recipe
from pipeline.video.frames import largest_size, measure_max_frames
from pipeline.video.recipes import video_recipe
from pipeline.video.render import VideoRenderer

log = logging.getLogger("renderfarm.worker")


def prepare_video_renderer(model: str, device: str = "auto", recipe_name: str = "exact", overrides: str = "",
                           pool: PoolOptions | None = None, *, family: str) -> tuple[VideoRenderer, dict]:
    """Load video ``model`` (family ``family``: ``wan``, ``wan-i2v`` or ``ltx``) on ``device`` with its video recipe.

    Args:
        model: an offline name (``tiny-wan``, ``tiny-ltx``, ``wan2.1-t2v-1.3b-arch``, ``ltx-video-arch``),
            a local directory or a hub id of a Wan / LTX-Video diffusers checkpoint.
        device / recipe_name / overrides / pool: as :func:`pipeline.warm.prepare_renderer`; ``overrides``
            is a JSON object of :class:`pipeline.video.recipes.VideoRecipe` knobs (``vae_tiling``,
            ``step_cache``, ``step_cache_threshold``, ``cpu_offload``, ``compile_regional``, …).
    Returns:
        ``(renderer, device profile as a dict)``. ``renderer.recipe``: the video recipe
        (:meth:`VideoRecipe.to_dict`) with ``report`` (what was applied and skipped) and
        :meth:`VideoRenderer.describe`; ``max_batch_size`` 1; ``limits`` a fresh
        :class:`pipeline.memory.BatchLimits`; ``pool``; ``compiler_warm_up`` None; ``family``. A pool
        that declares ``sizes`` or ``max_pixels`` gets ``renderer.recipe["max_frames"]``: the frames
        that fit ``memory_fraction`` of the device at its largest size, from two short renders
        (:func:`pipeline.video.frames.measure_max_frames`).
    Raises:
        ValueError / FileNotFoundError: the model cannot be loaded, a bad override, or a pool
            whose declared family is not the model's.
    """
    pool = pool or PoolOptions()
    t0 = time.perf_counter()
    profile = probe(device)
    recipe = video_recipe(profile, recipe_name, family, overrides, model)
    target = profile.torch_device
    pipe = load_pipeline(model, device="cpu" if recipe.cpu_offload else target, torch_dtype=DTYPES[recipe.dtype])
    check_pool_family(pipe, pool.family)
    report = apply_video_recipe(pipe, recipe, device=target)
    renderer = VideoRenderer(pipe, model=model, device=target)
    renderer.recipe = {**recipe.to_dict(), "report": report, **renderer.describe()}
    renderer.max_batch_size = 1
    renderer.limits = BatchLimits()
    renderer.pool = pool
    renderer.compiler_warm_up = None
    size = largest_size(pool, renderer.capabilities.size_multiple)
    if size is not None:  # a declared pool: how many frames fit at its largest size
        budget = recipe.memory_fraction * profile.total_memory_bytes
        renderer.recipe["max_frames"] = measure_max_frames(renderer, int(budget), *size)
        log.info("max_frames %d at %dx%d (peaks %s, budget %.0f MiB)", renderer.recipe["max_frames"]["max_frames"],
                 *size, renderer.recipe["max_frames"]["samples"], budget / 2**20)
    log.info("loaded %s (%s video) on %s with recipe %s in %.1fs (applied: %s; skipped: %s)", model,
             renderer.family, target, recipe.name, time.perf_counter() - t0, sorted(report["applied"]),
             report["skipped"])
    return renderer, profile.to_dict()
