"""The bench's one coupling to the rest of ``pipeline/``: how a model is loaded, how the farm's
recipe is resolved and applied, how the farm renders, what batch the pool would pick.

Place in the data flow: :mod:`bench.pipeline.subjects` → **here** → ``pipeline.models``
(``load_pipeline``, ``OFFLINE_MODELS``), ``pipeline.recipes``
(``recipe_for``, ``apply_overrides``), ``pipeline.optimize`` (``apply_recipe``),
``pipeline.render`` (``Renderer``) and ``pipeline.sizing`` (``batch_size_from_memory``). Every
other bench module reaches those packages only through the functions below, so a change of
their signatures is re-pointed here alone.

What the bench takes from the pipeline package:

* :func:`recommended_dtype`: the model's reference dtype on the device, from its family's model
  card (:func:`pipeline.models.families.reference_dtype`: float32 on the CPU; float16 for the
  Stable Diffusion 1.x/2.x/XL cards, bfloat16 for FLUX.1, SD3 and ERNIE-Image).
* :func:`default_batch_invariant`: the recipe's own ``batch_invariant`` (on for the CPU classes,
  off on accelerators unless the pool asks).
* Every row loads through :func:`pipeline.models.load_pipeline`, in the dtype asked for, on the
  device (the reference too: loading applies no optimization); offline ``*-arch`` models come
  from ``pipeline.models``' builds (on an accelerator: constructed there in that dtype).
* Recipes are resolved for the device and the model's family (``recipe_for(profile, name,
  family, model)``); the tiny VAE is the family's (the recipe picks the offline build for the
  offline models).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.device import DeviceProfile

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def recommended_dtype(model: str, device_kind: str) -> str:
    """The dtype a user of diffusers loads ``model`` in on ``device_kind`` (see the module docstring)."""
    from pipeline.models.families import reference_dtype
    from pipeline.warm import peek_family

    return reference_dtype(peek_family(model), device_kind, model)


def default_batch_invariant(recipe) -> bool:
    """Whether the farm renders with batch invariance when the pool does not say: the recipe's."""
    return bool(recipe.batch_invariant)


def cache_dir(configured: str | None) -> Path:
    """The offline model cache: ``configured`` or ``Settings.cache_dir`` (``RENDERFARM_CACHE_DIR``)."""
    if configured:
        return Path(configured)
    from infra.settings import get_settings

    return get_settings().cache_dir


def is_offline(model: str) -> bool:
    """Whether ``model`` is one of the offline random-weight builds (``tiny``, ``*-arch``)."""
    from pipeline.models import OFFLINE_MODELS

    return model in OFFLINE_MODELS


def load_reference(model: str, dtype: str, device: str, cache: str | None):
    """``model`` loaded as a user of diffusers loads it, with nothing of the farm's recipes:
    ``pipeline.models.load_pipeline`` (``AutoPipelineForText2Image.from_pretrained`` for hub ids
    and directories; the offline builds from their cache) in ``dtype``, on ``device``, with the
    default attention processors (SDPA), progress bars off.

    Raises:
        ValueError / FileNotFoundError: the model cannot be loaded (``load_pipeline``'s errors).
    """
    from pipeline.models import load_pipeline

    return load_pipeline(model, device=device, torch_dtype=DTYPES[dtype], cache_dir=cache_dir(cache))


def farm_recipe(name: str, overrides: dict[str, Any], profile: DeviceProfile, model: str):
    """The farm's recipe ``name`` (``exact``, ``fast`` or a device class) fitted to ``profile`` and
    the model's family, with ``overrides`` applied; an approximate override needs a recipe other
    than ``exact``.

    Raises:
        ValueError: unknown recipe, unknown knob, or an approximate override on ``exact``.
    """
    from pipeline.recipes import apply_overrides, recipe_for
    from pipeline.warm import peek_family

    recipe = recipe_for(profile, name, peek_family(model), model)
    return apply_overrides(recipe, dict(overrides), allow_approximate=name != "exact")


def load_farm(model: str, recipe, device: str, batch_invariant: bool, cache: str | None):
    """The worker's path: ``load_pipeline`` (in the recipe's dtype, on ``device`` unless the recipe
    offloads) → ``apply_recipe`` → ``Renderer``. Returns (pipe, renderer, report of apply_recipe).
    ``renderer.recipe`` and ``renderer.max_batch_size`` are set as ``pipeline.warm`` sets them."""
    from pipeline.models import load_pipeline
    from pipeline.optimize import apply_recipe
    from pipeline.render import Renderer

    where = "cpu" if recipe.cpu_offload else device
    pipe = load_pipeline(model, device=where, torch_dtype=DTYPES[recipe.dtype], cache_dir=cache_dir(cache))
    report = apply_recipe(pipe, recipe, device=device)
    renderer = Renderer(pipe, device=device, model=model, batch_invariant=batch_invariant)
    renderer.recipe = {**recipe.to_dict(), "report": report}
    renderer.max_batch_size = recipe.max_batch_size
    return pipe, renderer, report


def render_farm(renderer, prompts: list[str], seeds: list[int], width: int, height: int, steps: int,
                guidance_scale: float, on_step: Callable[[int, int], None] | None = None) -> list:
    """One ``Renderer.render`` call for ``prompts`` (prompt i ↔ seed i); returns PIL images."""
    from infra.schemas import RenderRequest

    requests = [RenderRequest(prompt=p, seed=s, model=renderer.model, width=width, height=height,
                              num_inference_steps=steps, guidance_scale=guidance_scale)
                for p, s in zip(prompts, seeds)]
    return renderer.render(requests, on_step=on_step)


def cudagraph_safe(module):
    """The farm's CUDA-graph remedy on ``module`` (:func:`pipeline.optimize.compile.cudagraph_safe`:
    a new CUDAGraph Trees step before each call, the outputs cloned after it); returns ``module``."""
    from pipeline.optimize.compile import cudagraph_safe as safe

    return safe(module)


def default_guidance_scale() -> float:
    """The guidance scale a render request gets when it names none (``RenderRequest``'s default)."""
    from infra.schemas import RenderRequest

    return float(RenderRequest.model_fields["guidance_scale"].default)


def call_kwargs(pipe, **wanted) -> dict[str, Any]:
    """``wanted`` less what ``pipe.__call__`` does not accept; ``use_pe=False`` where it exists
    (ERNIE-Image's prompt enhancer: off, as in the SDNQ model card's validation)."""
    params = inspect.signature(pipe.__call__).parameters
    if "use_pe" in params:
        wanted.setdefault("use_pe", False)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return wanted
    return {k: v for k, v in wanted.items() if k in params}


def pool_batch_size(renderer, profile: DeviceProfile, width: int, height: int, steps: int) -> int:
    """The batch size a worker of this recipe would pick at ``width``×``height``: its measured
    peak per image against the device memory, capped by the recipe (:mod:`pipeline.sizing`; one
    step gives the peak of any step count, so ``steps`` does not change it)."""
    from pipeline.sizing import batch_size_from_memory

    return batch_size_from_memory(renderer, profile.to_dict(), width=width, height=height)


def farm_renderer(model: str, device: str = "auto", recipe: str = "exact", overrides: str = "", pool=None):
    """A worker's warm renderer of ``model`` (``pipeline.warm.prepare_renderer``: the device's
    recipe applied, with ``overrides``, a JSON object of knobs, fitted to ``pool``, a
    :class:`pipeline.pool_options.PoolOptions` or None) and the device profile as a dict; its
    ``upscale_stage()`` is the worker's."""
    from pipeline.warm import prepare_renderer

    return prepare_renderer(model, device, recipe, overrides, pool=pool)
