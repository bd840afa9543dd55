"""Recipes: the optimizations a device profile and a model family get, as data.

Place in the data flow: worker → :func:`pipeline.device.probe` → :func:`recipe_for` /
:func:`select_recipe` (here) → :func:`pipeline.optimize.apply_recipe` on the warm pipeline. The
recipe in force is reported by the worker's heartbeat (``GET /v1/workers``) via :meth:`Recipe.to_dict`.

Tables (:mod:`.knobs`, :mod:`.table`), read top to bottom: every knob marked exact or approximate
with its source; one recipe per device class; the rules mapping a profile to a class; what a
family changes (reference dtype, fused QKV, regional compile, batch cap, quantization in ``fast``,
offload when its weights do not fit). Approximate knobs are only turned on when the pool allows
them, and an override that turns one on without that permission is an error, never a silent change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from pipeline.device import GB, DeviceProfile
from pipeline.models.families import FAMILY_SPECS, reference_dtype
from pipeline.recipes.knobs import (
    ALIASES,
    ATTENTION,
    COMPILE_MODES,
    DTYPES,
    OPTIMIZATIONS,
    QUANTIZATION,
    Optimization,
    Recipe,
    knob_names,
)
from pipeline.recipes.table import FAMILY_FITS, RECIPE_TABLE, RECIPES, FamilyFit, Rule

__all__ = ["ATTENTION", "BASELINE", "COMPILE_MODES", "DTYPES", "FAMILY_FITS", "OPTIMIZATIONS", "QUANTIZATION",
           "RECIPES", "RECIPE_TABLE", "FamilyFit", "Optimization", "Recipe", "Rule", "apply_overrides",
           "device_class", "fit_adapters", "overrides_from_env", "parse_overrides", "recipe_for", "resolve_conflicts",
           "select_recipe"]
OVERRIDES_ENV = "RENDERFARM_RECIPE_OVERRIDES"
BASELINE = Recipe()


def device_class(profile: DeviceProfile) -> str:
    """The name in :data:`RECIPES` of the first :data:`RECIPE_TABLE` rule the profile matches."""
    for rule in RECIPE_TABLE:
        if rule.matches(profile):
            return rule.recipe
    raise LookupError(f"no recipe rule matches {profile!r}")


def recipe_for(profile: DeviceProfile, name: str = "exact", family: str | None = None, model: str = "") -> Recipe:
    """A named recipe fitted to ``profile`` and ``family``: ``baseline``, ``exact``, ``fast``, or a
    :data:`RECIPES` key.

    ``exact`` is the device-class recipe without approximations (the model's reference dtype on
    the device), ``fast`` keeps them; ``baseline`` is diffusers' defaults at the reference dtype.
    ``family`` None fits no family (a pipeline of unknown family: the generic device recipe).

    Raises:
        ValueError: unknown ``name``.
    """
    reference = reference_dtype(family, profile.kind, model)
    if name == "baseline":
        return replace(BASELINE, dtype=reference, reference_dtype=reference, family=family)
    base = name if name in RECIPES else device_class(profile) if name in ("exact", "fast") else None
    if base is None:
        raise ValueError(f"unknown recipe {name!r}; expected baseline, exact, fast or one of {sorted(RECIPES)}")
    r = _fit_family(_fit_device(RECIPES[base], profile), profile, family, reference)
    if name == "exact":
        return resolve_conflicts(replace(r.without_approximations(), name=f"{base}/exact"))
    return resolve_conflicts(replace(r, name=f"{base}/fast") if name == "fast" else r)


COMPILE_VS_INVARIANCE = (
    "batch_invariant off: torch.compile cannot trace the batch-invariant kernels (TorchDynamo fails on "
    "aten.mkldnn_convolution's oneDNN tensor views in pipeline.invariance), and per-sample calls on "
    "accelerators undo the static batch buckets that compile builds; with compile an image is "
    "reproducible per bucket size, not across buckets")


OPENVINO_VAE_VS_COMPILE = (
    "the VAE decoder is either compiled by Inductor (compile_vae) or converted to OpenVINO (vae_backend), "
    "not both: each replaces the same module")


def resolve_conflicts(recipe: Recipe) -> Recipe:
    """``recipe`` with knobs that cannot combine settled, the reason in :attr:`Recipe.adjusted`.

    Compile (``compile_denoiser``/``compile_vae``) with ``batch_invariant``: the knob that was set by
    configuration (:attr:`Recipe.overridden`) wins and the other is turned off; when neither or
    only compile was configured, batch invariance is turned off (:data:`COMPILE_VS_INVARIANCE`).
    ``compile_vae`` with ``vae_backend: openvino``: the one set by configuration wins; when
    neither was, OpenVINO keeps the decoder (:data:`OPENVINO_VAE_VS_COMPILE`).

    Raises:
        ValueError: both sides were set by configuration (an override or the pool).
    """
    return _invariance_vs_compile(_openvino_vae_vs_compile(recipe))


def _openvino_vae_vs_compile(recipe: Recipe) -> Recipe:
    if not (recipe.compile_vae and recipe.vae_backend == "openvino"):
        return recipe
    configured = {"compile_vae", "vae_backend"} & set(recipe.overridden)
    if len(configured) == 2:
        raise ValueError(f"compile_vae=true cannot combine with vae_backend=openvino: {OPENVINO_VAE_VS_COMPILE}")
    if configured == {"compile_vae"}:
        return replace(recipe, vae_backend="torch",
                       adjusted=(*recipe.adjusted, f"vae_backend torch: compile_vae was configured; "
                                 f"{OPENVINO_VAE_VS_COMPILE}"))
    return replace(recipe, compile_vae=False,
                   adjusted=(*recipe.adjusted, f"compile_vae off: {OPENVINO_VAE_VS_COMPILE}"))


def _invariance_vs_compile(recipe: Recipe) -> Recipe:
    compiles = recipe.compile_denoiser or recipe.compile_vae
    if not (compiles and recipe.batch_invariant):
        return recipe
    set_compile = {"compile_denoiser", "compile_vae"} & set(recipe.overridden)
    if "batch_invariant" in recipe.overridden:
        if set_compile:
            raise ValueError("batch_invariant=true cannot combine with compile_denoiser/compile_vae: "
                             + COMPILE_VS_INVARIANCE.removeprefix("batch_invariant off: "))
        return replace(recipe, compile_denoiser=False, compile_vae=False, compile_regional=False,
                       adjusted=(*recipe.adjusted, "compile off: batch_invariant was configured; "
                                 + COMPILE_VS_INVARIANCE.removeprefix("batch_invariant off: ")))
    return replace(recipe, batch_invariant=False, adjusted=(*recipe.adjusted, COMPILE_VS_INVARIANCE))


ADAPTERS_VS_OPENVINO = (
    "backend torch: the pool declares LoRA adapters, which diffusers' load_lora_weights injects into the "
    "PyTorch denoiser's layers; a model converted to OpenVINO has no such layers to load into")


CONTROLNETS_VS_OPENVINO = (
    "backend torch: the pool declares ControlNets, whose residuals diffusers' ControlNet pipelines pass to the "
    "PyTorch UNet (down_block_additional_residuals) and which ControlNetModel.from_unet builds from its layers; "
    "a model converted to OpenVINO takes no such inputs")


def fit_adapters(recipe: Recipe, reason: str = ADAPTERS_VS_OPENVINO) -> Recipe:
    """``recipe`` for a pool that declares LoRA adapters (or, with ``reason``
    :data:`CONTROLNETS_VS_OPENVINO`, ControlNets): the denoiser stays in PyTorch.

    The OpenVINO backend (and its int8 weight compression) is turned off with ``reason`` in
    :attr:`Recipe.adjusted`; every other knob stays.

    Raises:
        ValueError: ``backend`` was set to ``openvino`` by configuration (an override).
    """
    if recipe.backend != "openvino":
        return recipe
    if "backend" in recipe.overridden:
        raise ValueError("backend=openvino cannot serve this pool: " + reason.removeprefix("backend torch: "))
    quantization = None if recipe.quantization == "openvino_int8" else recipe.quantization
    return replace(recipe, backend="torch", quantization=quantization, adjusted=(*recipe.adjusted, reason))


def _fit_device(r: Recipe, p: DeviceProfile) -> Recipe:
    """Resolve what depends on the probe: flash-attn presence, SDPA presence, CPU thread count."""
    attention = r.attention
    if attention == "flash_attn" and not p.flash_attn_available:
        attention = "sdpa"
    if attention == "sdpa" and not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        attention = "sliced"
    threads = p.cpu_cores if r.num_threads == 0 and p.kind == "cpu" else r.num_threads
    return replace(r, attention=attention, num_threads=threads)


def _fit_family(r: Recipe, p: DeviceProfile, family: str | None, reference: str) -> Recipe:
    """The family's reference dtype and knobs; offload when its weights do not fit (see FamilyFit)."""
    dtype = r.dtype
    if p.kind != "cpu":  # an accelerator runs the card's dtype; pre-Ampere CUDA has no fast bf16
        dtype = reference
        if reference == "bfloat16" and p.kind == "cuda" and (p.compute_capability or (0, 0)) < (8, 0):
            dtype = "float16"  # approximate: only in fast
    r = replace(r, dtype=dtype, reference_dtype=reference, family=family)
    spec, fit = FAMILY_SPECS.get(family or ""), FAMILY_FITS.get(family or "")
    if spec is None or fit is None:
        return r
    unet = spec.denoiser == "unet"
    changes: dict[str, Any] = {
        "fuse_qkv": r.fuse_qkv and spec.fuse_qkv,
        "channels_last": r.channels_last and unet,  # convolutions live in UNets; transformers have few
        "compile_regional": r.compile_denoiser and spec.regional_compile,
        # 1024² latents are 4x SD 1.5's on an accelerator's fixed memory; the CPU's cap is about
        # amortizing weight reads, and its memory is measured anyway
        "max_batch_size": max(1, int(r.max_batch_size * (fit.batch_scale if p.kind != "cpu" else 1))),
    }
    if p.kind == "cuda" and fit.fast_quantization:
        q = fit.fast_quantization
        cc_ok = (p.compute_capability or (0, 0)) >= fit.fp8_min_cc
        if q == "sdnq_uint4" or (q.startswith("torchao") and cc_ok and r.compile_denoiser):
            changes["quantization"] = q
    if p.kind != "cpu" and p.total_memory_bytes:
        budget = r.memory_fraction * p.total_memory_bytes / GB
        if fit.weights_gb > budget:  # exact offloads; fast keeps its quantization and offloads too
            changes.update(cpu_offload=True, compile_denoiser=False, compile_vae=False, compile_regional=False,
                           quantization=None if str(changes.get("quantization", "")).startswith("torchao")
                           else changes.get("quantization"), fuse_qkv=False)
    return replace(r, **changes)


def select_recipe(profile: DeviceProfile, allow_approximate: bool = False,
                  overrides: Mapping[str, Any] | str | None = None, family: str | None = None,
                  model: str = "") -> Recipe:
    """The recipe for ``profile`` and ``family``: ``fast`` if the pool allows approximations, else
    ``exact``, then ``overrides`` (a dict or a JSON object; see :func:`overrides_from_env`)."""
    recipe = recipe_for(profile, "fast" if allow_approximate else "exact", family, model)
    return apply_overrides(recipe, overrides, allow_approximate) if overrides else recipe


def parse_overrides(overrides: Mapping[str, Any] | str | None) -> Mapping[str, Any]:
    """Recipe overrides as a mapping: a JSON object's text parsed, None or blank text as ``{}``
    (the image and the video recipes read them alike).

    Raises:
        ValueError: text that is not JSON, or JSON that is not an object.
    """
    if isinstance(overrides, str):
        overrides = json.loads(overrides) if overrides.strip() else {}
    if not overrides:
        return {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"recipe overrides must be a JSON object, got {type(overrides).__name__}")
    return overrides


def apply_overrides(recipe: Recipe, overrides: Mapping[str, Any] | str | None,
                    allow_approximate: bool = False) -> Recipe:
    """``recipe`` with configured knob values. Unknown fields and bad values raise ValueError; so
    does turning on an approximate knob when ``allow_approximate`` is false. ``compile_unet`` is
    accepted as the old name of ``compile_denoiser``."""
    overrides = parse_overrides(overrides)
    if not overrides:
        return recipe
    overrides = {ALIASES.get(k, k): v for k, v in overrides.items()}
    knobs = knob_names()
    unknown = sorted(k for k in overrides if k not in knobs)
    if unknown:
        raise ValueError(f"unknown recipe field(s) in overrides: {', '.join(unknown)}; "
                         f"overridable: {', '.join(knobs)}")
    new = replace(recipe, **overrides, overridden=tuple(sorted(set(recipe.overridden) | set(overrides))))
    if not allow_approximate:
        turned_on = [k for k in new.approximations() if k in overrides]
        if turned_on:
            raise ValueError(f"override(s) {', '.join(turned_on)} are approximate "
                             "(see recipes.OPTIMIZATIONS); allow approximate recipes for this pool first")
    return resolve_conflicts(new)


def overrides_from_env(environ: Mapping[str, str] = os.environ) -> dict:
    """The JSON object in ``RENDERFARM_RECIPE_OVERRIDES`` (empty dict when unset)."""
    text = environ.get(OVERRIDES_ENV, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OVERRIDES_ENV} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{OVERRIDES_ENV} must be a JSON object, got {type(value).__name__}")
    return value
