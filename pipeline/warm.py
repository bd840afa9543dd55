"""The warm-pipeline lifecycle: probe the device, pick its recipe, load and optimize the
pipeline once, size the batch from measured memory, and keep it resident for the worker's life.

Data flow: ``renderfarm worker`` → **here** (once, at start-up) → a :class:`pipeline.Renderer`
that every batch reuses. Nothing here frees memory between batches: no ``empty_cache()``
(seed 002: the SDNQ model card measured it slowing hot generations).
"""

from __future__ import annotations

import logging
import os
import time

from infra.schemas import RenderRequest
from pipeline.device import probe
from pipeline.memory import batch_size_for, check_allocator_env, measure_per_image
from pipeline.models import load_pipeline
from pipeline.optimize import apply_recipe
from pipeline.recipes import apply_overrides, recipe_for
from pipeline.render import Renderer

log = logging.getLogger("renderfarm.worker")


def prepare_renderer(model: str, device: str = "auto", recipe_name: str = "exact",
                     overrides: str = "") -> tuple[Renderer, dict]:
    """Load ``model`` on ``device`` with the device's recipe applied.

    Args:
        model: hub id, local path or offline name (``tiny``, ``sd15-arch``, …).
        device: ``auto`` or a torch device string.
        recipe_name: ``exact`` (no approximation), ``fast`` (the pool allows approximations),
            ``baseline`` or a named recipe.
        overrides: JSON object overriding single knobs (``RENDERFARM_RECIPE_OVERRIDES``).
    Returns:
        (renderer, device profile as a dict). ``renderer.recipe`` is the recipe with the
        report of what was applied; ``renderer.max_batch_size`` the recipe's batch cap.
    Raises:
        ValueError / FileNotFoundError: the model cannot be loaded, a bad override, or an
            allocator configuration that seed 002 showed to be harmful.
    """
    check_allocator_env(os.environ)
    t0 = time.perf_counter()
    profile = probe(device)
    recipe = apply_overrides(recipe_for(profile, recipe_name), overrides, allow_approximate=recipe_name != "exact")
    pipe = load_pipeline(model, device="cpu")
    report = apply_recipe(pipe, recipe, device=profile.torch_device)
    renderer = Renderer(pipe, device=profile.torch_device, model=model)
    renderer.recipe = {**recipe.to_dict(), "report": report}
    renderer.max_batch_size = recipe.max_batch_size
    log.info("loaded %s on %s with recipe %s in %.1fs (applied: %s; skipped: %s)", model, profile.torch_device,
             recipe.name, time.perf_counter() - t0, sorted(report["applied"]), report["skipped"])
    return renderer, profile.to_dict()


def batch_size_from_memory(renderer: Renderer, profile: dict, *, width: int = 512, height: int = 512,
                           steps: int = 2) -> int:
    """Measure peak bytes per image at ``width``×``height`` and return the largest batch whose
    peak stays under the recipe's ``memory_fraction`` of the device memory, capped by its
    ``max_batch_size``."""
    def render(n: int) -> None:
        renderer.render([RenderRequest(prompt="warm-up", model=renderer.model, seed=i, width=width, height=height,
                                       num_inference_steps=steps) for i in range(n)])

    measured = measure_per_image(render, renderer.device)
    size = batch_size_for(measured.per_image_bytes, measured.base_bytes, profile["total_memory_bytes"],
                          renderer.recipe["memory_fraction"], cap=renderer.max_batch_size)
    log.info("peak memory: base %.0f MiB + %.1f MiB per %dx%d image → batch size %d",
             measured.base_bytes / 2**20, measured.per_image_bytes / 2**20, width, height, size)
    return size
