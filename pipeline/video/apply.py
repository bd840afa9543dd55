"""Apply a :class:`~pipeline.video.recipes.VideoRecipe` to a loaded video pipeline (Wan, LTX-Video).

Place in the data flow: :func:`pipeline.video.prepare.prepare_video_renderer` → here, once, on the
warm pipeline. Like :func:`pipeline.optimize.apply_recipe`, every step is guarded: one that raises
is recorded under ``skipped`` with its reason and the pipeline stays usable.

Steps (diffusers 0.42.1 APIs, read from its source): the VAE's dtype (float32 for Wan, per its
card), placement (``pipe.to(device)`` or ``enable_model_cpu_offload``), ``vae.enable_slicing()`` /
``vae.enable_tiling()`` (``AutoencoderKLWan`` and ``AutoencoderKLLTXVideo`` both have them),
regional compilation (``ModelMixin.compile_repeated_blocks``, which compiles every submodule
whose class is in the transformer's ``_repeated_blocks``: ``WanTransformerBlock``,
``LTXVideoTransformerBlock``), and First Block Cache (``CacheMixin.enable_cache`` with
``diffusers.FirstBlockCacheConfig``; diffusers' ``hooks/first_block_cache.py`` registers a
``fbc_leader_block_hook`` on the first transformer block and ``fbc_block_hook`` on the others,
both in the block's ``HookRegistry``; the Wan and LTX blocks are in its ``TransformerBlockRegistry``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.video.recipes import VideoRecipe

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The hook names First Block Cache registers (diffusers/hooks/first_block_cache.py).
FBC_HOOKS = ("fbc_leader_block_hook", "fbc_block_hook")


def apply_video_recipe(pipe, recipe: VideoRecipe, device: str | None = None) -> dict:
    """Apply ``recipe`` to ``pipe`` in place; returns ``{"recipe", "family", "device", "applied"
    (step → value), "skipped" (step → reason), "approximations", "seconds"}``."""
    t0 = time.perf_counter()
    applied: dict[str, object] = {}
    skipped: dict[str, str] = {}

    def step(name: str, fn: Callable[[], object]) -> None:
        try:
            applied[name] = fn()
        except Exception as e:  # a failed optimization must not take the worker down
            skipped[name] = f"{type(e).__name__}: {e}"

    applied["dtype"] = recipe.dtype
    if recipe.vae_dtype != recipe.dtype:
        step("vae_dtype", lambda: _vae_dtype(pipe, recipe.vae_dtype))
    if device is not None:
        step("cpu_offload" if recipe.cpu_offload else "device", lambda: _place(pipe, device, recipe.cpu_offload))
    if recipe.vae_slicing:
        step("vae_slicing", lambda: _vae(pipe, "enable_slicing"))
    if recipe.vae_tiling:
        step("vae_tiling", lambda: _vae(pipe, "enable_tiling"))
    if recipe.step_cache:
        step("step_cache", lambda: enable_step_cache(pipe.transformer, recipe.step_cache_threshold))
    if recipe.compile_regional:
        step("compile", lambda: _compile(pipe, recipe.compile_mode, device))
    return {"recipe": recipe.name, "family": recipe.family, "device": device, "applied": applied,
            "skipped": skipped, "approximations": recipe.approximations(),
            "seconds": round(time.perf_counter() - t0, 3)}


def enable_step_cache(transformer, threshold: float) -> dict:
    """Turn on diffusers' First Block Cache on ``transformer`` with ``threshold`` (> 0; the absmean
    relative change of the first block's residual under which the remaining blocks are skipped and
    their cached residual reused). Returns ``{"method": "first_block_cache", "threshold", "blocks"}``
    (``blocks``: transformer blocks carrying a cache hook).

    Raises:
        ValueError: ``threshold`` ≤ 0, or the transformer has no ``enable_cache`` (no CacheMixin).
    """
    from diffusers import FirstBlockCacheConfig

    if not threshold > 0:
        raise ValueError(f"step cache threshold must be > 0, got {threshold!r}")
    if not hasattr(transformer, "enable_cache"):
        raise ValueError(f"{type(transformer).__name__} has no enable_cache (diffusers CacheMixin)")
    transformer.enable_cache(FirstBlockCacheConfig(threshold=float(threshold)))
    return {"method": "first_block_cache", "threshold": float(threshold),
            "blocks": len(cache_hooked_blocks(transformer))}


def cache_hooked_blocks(transformer) -> list[str]:
    """Names of ``transformer``'s submodules that carry a First Block Cache hook (empty when off)."""
    out = []
    for name, module in transformer.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and any(registry.get_hook(h) is not None for h in FBC_HOOKS):
            out.append(name)
    return out


def _vae_dtype(pipe, dtype: str) -> str:
    pipe.vae.to(DTYPES[dtype])
    return dtype


def _place(pipe, device: str, offload: bool) -> str:
    if offload:
        pipe.enable_model_cpu_offload(device=device)
        return device
    pipe.to(device)
    return device


def _vae(pipe, method: str) -> bool:
    getattr(pipe.vae, method)()
    return True


def _compile(pipe, mode: str, device: str | None) -> dict:
    """Regional compilation of the transformer's repeated blocks, static shapes; with CUDA graphs
    asked for, the blocks compile without them (:func:`pipeline.optimize.compile.regional_mode`:
    one block graph replayed for every block would overwrite the output the next block reads)."""
    from pipeline.optimize.compile import CUDAGRAPH_MODES, compile_kwargs, regional_mode

    transformer = pipe.transformer
    blocks = list(getattr(transformer, "_repeated_blocks", None) or ())
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} declares no _repeated_blocks")
    graphs = str(device or "").startswith("cuda") and mode in CUDAGRAPH_MODES
    block_mode, why = regional_mode(mode, graphs)
    transformer.compile_repeated_blocks(**compile_kwargs(block_mode, False))
    return {"regional": blocks, "mode": block_mode, **({"note": why} if why else {})}
