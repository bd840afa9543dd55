"""The warm-pipeline lifecycle: probe the device, pick the recipe for the device and the model's
family, load the pipeline once in its dtype, optimize it, size the batch from measured memory at
the pool's largest size, and keep it resident for the worker's life.

Data flow: ``renderfarm worker`` → **here** (once, at start-up) → a :class:`pipeline.Renderer`
that every batch reuses. Nothing here frees memory between batches: no ``empty_cache()`` (the
ERNIE-Image-Turbo SDNQ uint4 model card measured it slowing hot generations).

Pool settings reach the pipeline as :class:`PoolOptions` (the worker builds it from its declared
pool, ``infra.pools.PoolSpec``): the declared ``family`` (checked against the loaded pipeline),
the largest ``max_pixels`` and the ``steps`` to size the batch at, ERNIE-Image's ``use_pe``, and
``batch_invariant`` (None: the recipe's default, on for the CPU and off on accelerators).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from infra.schemas import RenderRequest
from pipeline.capabilities import check_pool_family
from pipeline.device import probe
from pipeline.memory import BatchLimits, PeakMeasurement, batch_size_for_stages, check_allocator_env, measure_per_image
from pipeline.models.families import FAMILY_SPECS, family_of_name
from pipeline.models.load import load_pipeline
from pipeline.optimize import DTYPES, apply_recipe
from pipeline.recipes import apply_overrides, recipe_for
from pipeline.render import Renderer
from pipeline.upscale import UpscaleStage

log = logging.getLogger("renderfarm.worker")


@dataclass(frozen=True)
class PoolOptions:
    """What a pool declares that the pipeline needs. Pixels are ``width × height``."""

    family: str | None = None
    max_pixels: int | None = None
    steps: int | None = None
    use_pe: bool = False
    batch_invariant: bool | None = None
    upscalers: tuple[str, ...] | None = None  # the upscalers a worker may load (None: any)


def peek_family(model: str) -> str | None:
    """The family of ``model`` before loading it: an offline name's, else the pipeline class named
    in its ``model_index.json`` (FLUX.1 reads as schnell until the loaded transformer says; both
    share their dtype and recipe). None when unknown or unreadable."""
    family = family_of_name(model)
    if family is not None:
        return family
    try:
        from diffusers import DiffusionPipeline

        name = DiffusionPipeline.load_config(model).get("_class_name")
    except Exception:
        return None
    return next((f.name for f in FAMILY_SPECS.values() if f.pipeline == name), None)


def prepare_renderer(model: str, device: str = "auto", recipe_name: str = "exact",
                     overrides: str = "", pool: PoolOptions | None = None,
                     upscalers: Sequence[str] | None = None) -> tuple[Renderer, dict]:
    """Load ``model`` on ``device`` with the recipe of the device and the model's family applied.

    Args:
        model: hub id, local path, single file or offline name (``tiny``, ``tiny-flux``, ``sdxl-arch``, …).
        device: ``auto`` or a torch device string.
        recipe_name: ``exact`` (the model's reference dtype, no approximation), ``fast`` (the pool
            allows approximations), ``baseline`` or a named recipe.
        overrides: JSON object overriding single knobs (``RENDERFARM_RECIPE_OVERRIDES``).
        pool: the pool's settings (:class:`PoolOptions`); None = an undeclared pool.
        upscalers: the upscalers the renderer may load when ``pool`` declares none (``None`` in
            :attr:`PoolOptions.upscalers`): a worker of an undeclared pool passes
            ``RENDERFARM_UPSCALERS``; None = any (a benchmark naming its own). They are not measured.
    Returns:
        (renderer, device profile as a dict). ``renderer.recipe`` is the recipe with the report
        of what was applied, the family, its capabilities and the batch invariance in force;
        ``renderer.max_batch_size`` the recipe's batch cap; ``renderer.limits`` the per-shape
        OOM caps (:class:`pipeline.memory.BatchLimits`).
    Raises:
        ValueError / FileNotFoundError: the model cannot be loaded, a bad override, a pool whose
            declared family is not the model's, or an allocator configuration that the SDNQ
            model card showed to be harmful.
    """
    check_allocator_env(os.environ)
    pool = pool or PoolOptions()
    t0 = time.perf_counter()
    profile = probe(device)
    family = pool.family or peek_family(model)
    recipe = apply_overrides(recipe_for(profile, recipe_name, family, model), overrides,
                             allow_approximate=recipe_name != "exact")
    if pool.batch_invariant is not None:
        recipe = replace(recipe, batch_invariant=pool.batch_invariant)
    target = profile.torch_device
    pipe = load_pipeline(model, device="cpu" if recipe.cpu_offload else target, torch_dtype=DTYPES[recipe.dtype],
                         use_pe=pool.use_pe)
    check_pool_family(pipe, pool.family)
    report = apply_recipe(pipe, recipe, device=target)
    upscale = UpscaleStage(device=target, dtype=torch.float32 if profile.kind in ("cpu", "mps") else torch.float16,
                           allowed=pool.upscalers if pool.upscalers is not None else upscalers)
    renderer = Renderer(pipe, device=target, model=model, batch_invariant=recipe.batch_invariant, use_pe=pool.use_pe,
                        upscale=upscale)
    renderer.recipe = {**recipe.to_dict(), "report": report, **renderer.describe()}
    renderer.max_batch_size = recipe.max_batch_size
    renderer.limits = BatchLimits()
    renderer.pool = pool
    log.info("loaded %s (%s) on %s with recipe %s in %.1fs (applied: %s; skipped: %s; batch invariance: %s)",
             model, renderer.family, target, recipe.name, time.perf_counter() - t0, sorted(report["applied"]),
             report["skipped"], renderer.invariance)
    return renderer, profile.to_dict()


def sizing_shape(renderer: Renderer, pool: PoolOptions | None = None) -> tuple[int, int, int]:
    """(width, height, steps) to measure memory at: the square of the pool's ``max_pixels`` (else the
    family's native size), rounded down to the size multiple, and the pool's steps (else 2)."""
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    spec = FAMILY_SPECS.get(renderer.family or "")
    multiple = renderer.capabilities.size_multiple
    side = int(math.isqrt(pool.max_pixels)) if pool.max_pixels else (spec.native if spec else 512)
    side = max(multiple, min(2048, side) // multiple * multiple)
    return side, side, pool.steps or 2


def sizing_requests(renderer: Renderer, n: int, *, width: int, height: int, steps: int,
                    upscaler: str | None = None) -> list[RenderRequest]:
    """The ``n`` requests a warm-up measurement renders: guidance on where the pipeline takes it
    (classifier-free guidance doubles the denoiser's batch), and with ``upscaler`` an ×4 upscale
    (the larger factor; a ×2 network is then followed by a resize), so that the upscaling stage's
    peak is measured with the diffusion's."""
    guidance = 7.5 if renderer.capabilities.guidance_scale else 0.0
    up = {"upscale": 4, "upscaler": upscaler} if upscaler else {}
    return [RenderRequest(prompt="warm-up", model=renderer.model, seed=i, width=width, height=height,
                          num_inference_steps=steps, guidance_scale=guidance, **up) for i in range(n)]


def batch_size_from_memory(renderer: Renderer, profile: dict, *, width: int | None = None, height: int | None = None,
                           steps: int | None = None, pool: PoolOptions | None = None) -> int:
    """Measure peak bytes per image at the pool's largest size (:func:`sizing_shape`, or the given
    ``width``×``height`` and ``steps``) with guidance on, and return the largest batch whose peak
    stays under the recipe's ``memory_fraction`` of the device memory, capped by its ``max_batch_size``.

    A pool that declares ``upscalers`` is measured once more per upscaler, the renders followed by
    its ×4 upscale (:func:`sizing_requests`), and the smallest batch size wins
    (:func:`pipeline.memory.batch_size_for_stages`): a group's upscale runs on the same device after
    its decode, on the whole group, so its peak bounds the batch as the denoiser's does.
    """
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    w, h, s = sizing_shape(renderer, pool)
    width, height, steps = width or w, height or h, steps or s
    measured: dict[str, PeakMeasurement] = {}
    for upscaler in (None, *(pool.upscalers or ())):
        def render(n: int, upscaler: str | None = upscaler) -> None:
            renderer.render(sizing_requests(renderer, n, width=width, height=height, steps=steps, upscaler=upscaler))

        measured[upscaler or "diffusion"] = measure_per_image(render, renderer.device)
    size = batch_size_for_stages(measured.values(), profile["total_memory_bytes"], renderer.recipe["memory_fraction"],
                                 cap=renderer.max_batch_size)
    for name, m in measured.items():
        log.info("peak memory (%s): base %.0f MiB + %.1f MiB per %dx%d image, %d steps", name, m.base_bytes / 2**20,
                 m.per_image_bytes / 2**20, width, height, steps)
    log.info("batch size %d", size)
    return size


__all__ = ["PoolOptions", "batch_size_from_memory", "peek_family", "prepare_renderer", "sizing_requests",
           "sizing_shape"]
