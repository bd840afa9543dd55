"""The warm-pipeline lifecycle: probe the device, pick the recipe for the device and the model's
family, load the pipeline once in its dtype, optimize it, warm up the shapes its pool serves, and
keep it resident for the worker's life (the batch size between load and warm-up is
:mod:`pipeline.sizing`'s).

Data flow: ``renderfarm worker`` → **here** (once, at start-up) → a :class:`pipeline.Renderer`
that every batch reuses. Nothing here frees memory between batches: no ``empty_cache()`` (the
ERNIE-Image-Turbo SDNQ uint4 model card measured it slowing hot generations).

Pool settings reach the pipeline as :class:`PoolOptions` (the worker builds it from its declared
pool, ``infra.pools.PoolSpec``): the declared ``family`` (checked against the loaded pipeline),
the ``sizes`` and ``max_pixels`` it serves and its ``steps``, ERNIE-Image's ``use_pe``, and
``batch_invariant`` (None: the recipe's default, off on every device class; a pool turns it on).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from infra.schemas import RenderRequest
from infra.video import is_video_family
from pipeline import compile_count
from pipeline.buckets import bucket_sizes
from pipeline.capabilities import check_pool_family
from pipeline.device import probe
from pipeline.memory import BatchLimits, check_allocator_env
from pipeline.models.families import FAMILY_SPECS, family_of_name
from pipeline.models.load import load_pipeline
from pipeline.optimize import DTYPES, apply_recipe
from pipeline.optimize.compile import has_cpp_compiler, start_compiler_warm_up
from pipeline.pool_options import PoolOptions
from pipeline.recipes import CONTROLNETS_VS_OPENVINO, apply_overrides, fit_adapters, recipe_for, resolve_conflicts
from pipeline.render import Renderer
from pipeline.upscale import UpscaleStage
from pipeline.warm_controls import control_units, warm_control_images, warm_control_sets

log = logging.getLogger("renderfarm.worker")


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
                     upscalers: Sequence[str] | None = None, ir_store=None) -> tuple[Renderer, dict]:
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
        ir_store: where converted OpenVINO UNets are shared (:class:`pipeline.optimize.openvino_ir.IRStore`:
            the worker passes the farm's bucket); None converts at every load.
    Returns:
        (renderer, device profile as a dict). ``renderer.recipe`` is the recipe with the report
        of what was applied, the family, its capabilities and the batch invariance in force;
        ``renderer.max_batch_size`` the recipe's batch cap; ``renderer.limits`` the per-shape
        OOM caps (:class:`pipeline.memory.BatchLimits`); ``renderer.compiler_warm_up`` the child
        process of :func:`pipeline.optimize.compile.start_compiler_warm_up` (CPU recipes that
        compile), else None. A video family (:func:`infra.video.is_video_family`) is loaded by
        :func:`pipeline.video.prepare.prepare_video_renderer` instead (a
        :class:`pipeline.video.VideoRenderer`, batch size 1, its video recipe).
    Raises:
        ValueError / FileNotFoundError: the model cannot be loaded, a bad override, a pool whose
            declared family is not the model's, or an allocator configuration that the SDNQ
            model card showed to be harmful.
    """
    check_allocator_env(os.environ)
    pool = pool or PoolOptions()
    family = pool.family or peek_family(model)
    if is_video_family(family):  # Wan, LTX-Video: one request per call, their own recipe table
        from pipeline.video.prepare import prepare_video_renderer

        return prepare_video_renderer(model, device, recipe_name, overrides, pool,  # type: ignore[return-value]
                                      family=family)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    profile = probe(device)
    recipe = apply_overrides(recipe_for(profile, recipe_name, family, model), overrides,
                             allow_approximate=recipe_name != "exact")
    if pool.batch_invariant is not None:  # the pool's choice counts as configured (resolve_conflicts)
        recipe = resolve_conflicts(replace(recipe, batch_invariant=pool.batch_invariant,
                                           overridden=tuple(sorted({*recipe.overridden, "batch_invariant"}))))
    if pool.lora_adapters:
        recipe = fit_adapters(recipe)
    if pool.controlnets:
        recipe = fit_adapters(recipe, CONTROLNETS_VS_OPENVINO)
    target = profile.torch_device
    warm_compiler = None  # the C++ toolchain's first-use work, beside the load below
    if profile.kind == "cpu" and (recipe.compile_denoiser or recipe.compile_vae) and has_cpp_compiler():
        warm_compiler = start_compiler_warm_up()
    pipe = load_pipeline(model, device="cpu" if recipe.cpu_offload else target, torch_dtype=DTYPES[recipe.dtype],
                         use_pe=pool.use_pe)
    check_pool_family(pipe, pool.family)
    report = apply_recipe(pipe, recipe, device=target, ir_store=ir_store)
    upscale = UpscaleStage(device=target, dtype=torch.float32 if profile.kind in ("cpu", "mps") else torch.float16,
                           allowed=pool.upscalers if pool.upscalers is not None else upscalers)
    renderer = Renderer(pipe, device=target, model=model, batch_invariant=recipe.batch_invariant, use_pe=pool.use_pe,
                        upscale=upscale)
    renderer.recipe = {**recipe.to_dict(), "report": report, **renderer.describe()}
    renderer.max_batch_size = recipe.max_batch_size
    renderer.limits = BatchLimits()
    renderer.pool = pool
    renderer.compiler_warm_up = warm_compiler  # get_ready stops it after a compile-cache hit
    log.info("loaded %s (%s) on %s with recipe %s in %.1fs (applied: %s; skipped: %s; batch invariance: %s%s)",
             model, renderer.family, target, recipe.name, time.perf_counter() - t0, sorted(report["applied"]),
             report["skipped"], renderer.invariance, "".join(f"; adjusted: {a}" for a in recipe.adjusted))
    return renderer, profile.to_dict()


def served_sizes(renderer: Renderer, pool: PoolOptions | None = None) -> tuple[tuple[int, int], ...]:
    """The (width, height) pixel sizes a pool's jobs render: its declared ``sizes``, else the size a
    request gets when it names none (``RenderRequest``'s default, 512×512), capped by the pool's
    ``max_pixels`` and rounded down to the pipeline's size multiple. Not the family's native size:
    an SD 2.x or SDXL pool without declared sizes still renders 512² unless its requests say
    otherwise, so warming or sizing at 768² or 1024² would prepare a shape no job asks for."""
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    if pool.sizes:
        return tuple(dict.fromkeys((int(w), int(h)) for w, h in pool.sizes))
    multiple = renderer.capabilities.size_multiple
    fields = RenderRequest.model_fields
    width, height = int(fields["width"].default), int(fields["height"].default)
    if pool.max_pixels and width * height > pool.max_pixels:
        scale = math.sqrt(pool.max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    return ((max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)),)


@dataclass(frozen=True)
class WarmPlan:
    """What a worker renders before it takes jobs: every bucket at every size, once plain and once
    with each ControlNet unit set.

    ``buckets``: batch sizes (images), ascending, e.g. ``(1, 2, 4)``; ``sizes``: ``(width, height)``
    in pixels; ``steps``: the warm renders' ``num_inference_steps``; ``guidance_scale``: theirs
    (classifier-free guidance above 1 doubles the denoiser's batch, so it is part of the shape);
    ``control_sets``: ControlNet names, one tuple per unit set (:mod:`pipeline.warm_controls`).
    """

    buckets: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]
    steps: int
    guidance_scale: float
    control_sets: tuple[tuple[str, ...], ...] = ()

    @property
    def renders(self) -> int:
        """Pipeline calls the plan makes: ``len(buckets) × len(sizes) × (1 + len(control_sets))``."""
        return len(self.buckets) * len(self.sizes) * (1 + len(self.control_sets))

    def to_dict(self) -> dict:
        """JSON-able form (lists), for reports and the heartbeat."""
        return {"buckets": list(self.buckets), "sizes": [list(s) for s in self.sizes], "steps": self.steps,
                "guidance_scale": self.guidance_scale, "control_sets": [list(c) for c in self.control_sets]}


def warm_plan(renderer: Renderer, pool: PoolOptions | None, batch_size: int) -> WarmPlan:
    """The warm-up plan of a worker whose batch size is ``batch_size`` (images, ≥ 1).

    Buckets: powers of two up to ``batch_size`` (:func:`pipeline.buckets.bucket_sizes`). Sizes:
    :func:`served_sizes`. Steps: the pool's ``steps``, else 2 (the compiled shapes do not
    depend on the step count). Guidance: the pool's ``guidance_scale``, else the request default
    (7.5) where the pipeline takes guidance, else 0. Control sets: the pool's, else each declared
    ControlNet alone (:func:`pipeline.warm_controls.warm_control_sets`; the renderer's ControlNets
    must be attached before).

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    sizes = served_sizes(renderer, pool)
    if pool.guidance_scale is not None:
        guidance = float(pool.guidance_scale)
    else:
        guidance = float(RenderRequest.model_fields["guidance_scale"].default) \
            if renderer.capabilities.guidance_scale else 0.0
    return WarmPlan(buckets=bucket_sizes(batch_size), sizes=sizes, steps=pool.steps or 2,
                    guidance_scale=guidance, control_sets=warm_control_sets(renderer, pool))


def warm_up(renderer: Renderer, plan: WarmPlan,
            on_progress: Callable[[int, int, float | None], None] | None = None) -> dict:
    """Render every (bucket × size) of ``plan`` once, plain and with each of its ControlNet unit
    sets (:mod:`pipeline.warm_controls`: the denoiser's calls with ControlNet residuals), so that
    ``torch.compile`` compiles each static shape now and never inside a job; then hold the compiled
    graphs (a shape outside the plan runs eagerly, :func:`pipeline.compile_count.hold_compiled`).
    Where the recipe compiled nothing, one 1-step image of each declared size (no unit set) at the
    plan's guidance loads kernels and allocators at the sizes jobs will ask for instead: OpenVINO
    sets up its kernels for each new input shape at its first inference, and with a 64² warm-up
    the first 256² job of a ``cpu/exact`` sd-turbo-arch worker (OpenVINO UNet and decoder) took
    10.0 s against 5.3 s for the next (2-vCPU AVX2 EPYC; docs/performance/index.md).

    ``on_progress(done, total, eta_s)`` is called before the first render (0, total, None) and after
    each one; ``eta_s`` (seconds) extrapolates the seconds per image so far to the images left.
    Sets ``renderer.buckets`` (the group split) and, when it ends, ``renderer.graphs_warmed``
    (whether graphs were compiled): from then on the renderer counts each pipeline call in
    ``compiled_renders`` or ``eager_renders`` by the code it ran
    (:class:`pipeline.render.Renderer`); the warm-up's own renders are not counted.

    Returns:
        ``{"seconds", "renders", "images", "compiled", "compiles", "fx_graph_cache": {"hits", "misses"},
        "shapes": [{"batch", "width", "height", "controls", "seconds", "compiles"}, …], "plan": plan.to_dict()}``:
        seconds are wall time; ``compiles`` counts TorchDynamo compilations during warm-up.
    Raises:
        whatever a render raises (the worker cannot serve a shape it cannot render).
    """
    compile_count.install()
    compile_count.allow_graphs(2 * plan.renders + 2)
    renderer.buckets, renderer.graphs_warmed = plan.buckets, None
    compiled = "compile" in (getattr(renderer, "recipe", None) or {}).get("report", {}).get("applied", {})
    compiles0, cache0 = compile_count.compiles(), compile_count.fx_graph_cache()
    started = time.perf_counter()
    shapes: list[dict] = []
    # nothing compiled: no graph per bucket to build, one 1-step image per size sets up the kernels
    _render_plan(renderer, plan if compiled else replace(plan, buckets=(1,), steps=1, control_sets=()), shapes,
                 on_progress, started)
    if compiled:
        compile_count.hold_compiled()
    renderer.graphs_warmed = compiled
    cache1 = compile_count.fx_graph_cache()
    report = {"seconds": round(time.perf_counter() - started, 3), "renders": len(shapes),
              "images": sum(s["batch"] for s in shapes), "compiled": compiled,
              "compiles": compile_count.compiles() - compiles0,
              "fx_graph_cache": {k: cache1[k] - cache0[k] for k in cache1}, "shapes": shapes,
              "plan": plan.to_dict()}
    log.info("warm-up: %d renders (%d images) in %.1fs, %d compiles", report["renders"], report["images"],
             report["seconds"], report["compiles"])
    return report


def _render_plan(renderer: Renderer, plan: WarmPlan, shapes: list[dict],
                 on_progress: Callable[[int, int, float | None], None] | None, started: float) -> None:
    """Render every (bucket × size) of ``plan`` once without control units, then once with each of
    its control sets, appending one timing row per render to ``shapes``."""
    images_total, done_images = len(plan.sizes) * sum(plan.buckets) * (1 + len(plan.control_sets)), 0
    if on_progress is not None:
        on_progress(0, plan.renders, None)
    renders = itertools.product(((), *plan.control_sets), plan.sizes, plan.buckets)
    with warm_control_images(renderer) if plan.control_sets else contextlib.nullcontext():
        for names, (width, height), bucket in renders:
            t0, c0 = time.perf_counter(), compile_count.compiles()
            renderer.render([RenderRequest(prompt="warm-up", model=renderer.model, seed=i, width=width, height=height,
                                           num_inference_steps=plan.steps, guidance_scale=plan.guidance_scale,
                                           controls=control_units(names))
                             for i in range(bucket)])
            shapes.append({"batch": bucket, "width": width, "height": height, "controls": list(names),
                           "seconds": round(time.perf_counter() - t0, 3), "compiles": compile_count.compiles() - c0})
            done_images += bucket
            if on_progress is not None:
                elapsed = time.perf_counter() - started
                on_progress(len(shapes), plan.renders, elapsed / done_images * (images_total - done_images))


__all__ = ["PoolOptions", "WarmPlan", "peek_family", "prepare_renderer", "served_sizes", "warm_plan", "warm_up"]
