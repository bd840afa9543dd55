"""Apply a :class:`~pipeline.recipes.Recipe` to a loaded diffusers pipeline of any family.

Place in the data flow: worker → device probe → recipe → :func:`apply_recipe` (here), once, on
the warm pipeline, before warm-up. The returned report (what was applied, what was skipped and
why) goes into the worker's heartbeat next to the recipe, so ``GET /v1/workers`` shows the
optimizations really in force, not only the ones asked for.

The knobs apply to the pipeline's *denoiser*, whichever it has: ``unet`` (SD 1.x/2.x/XL) or
``transformer`` (SD3, FLUX, ERNIE-Image): fused QKV, attention backend, quantization, compile.
Every step is guarded: a missing package (flash-attn, torchao, sdnq), a missing C++ compiler or
Triton for ``torch.compile``, or a step that raises, is recorded under ``skipped`` with its
reason, and the pipeline stays usable. Sources of each technique: ``recipes.OPTIMIZATIONS``.
Modules: :mod:`.attention`, :mod:`.quantize`, :mod:`.compile`, :mod:`.tiny_vae`, :mod:`.openvino`,
:mod:`.openvino_vae`.
"""

from __future__ import annotations

import time

import torch

from pipeline.models.families import OFFLINE_TINY_VAES, denoiser_of, detect_family
from pipeline.optimize.attention import FlashAttnProcessor, set_attention
from pipeline.optimize.compile import compile_pipeline
from pipeline.optimize.openvino import to_openvino
from pipeline.optimize.openvino_vae import vae_to_openvino
from pipeline.optimize.quantize import Skip, quantize
from pipeline.optimize.tiny_vae import swap_tiny_vae
from pipeline.recipes import Recipe

__all__ = ["DTYPES", "OFFLINE_TINY_VAES", "FlashAttnProcessor", "apply_recipe"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def apply_recipe(pipe, recipe: Recipe, device: str | None = None, offline: bool | None = None,
                 ir_store=None) -> dict:
    """Apply ``recipe`` to ``pipe`` in place and return a JSON-able report.

    ``device`` (e.g. ``"cuda:0"``) is where the pipeline should run; with ``cpu_offload`` the
    pipeline is offloaded to it instead of moved. ``None`` leaves the pipeline where it is.
    ``offline`` says the pipeline is an offline random-weight build (the tiny VAE is then the
    offline one); None reads it from the pipeline (:func:`pipeline.models.load_pipeline` marks it).
    ``ir_store``: where the converted OpenVINO UNet and VAE decoder are shared between workers
    (:class:`pipeline.optimize.openvino_ir.IRStore`; None: converted at every load).
    Report keys: ``recipe``, ``family``, ``denoiser``, ``device``, ``applied`` (step → value),
    ``skipped`` (step → reason), ``approximations`` (approximate knobs in force), ``seconds``.
    """
    t0 = time.perf_counter()
    applied: dict[str, object] = {}
    skipped: dict[str, str] = {}
    denoiser_name, _ = denoiser_of(pipe)
    if offline is None:
        offline = bool(getattr(pipe, "_renderfarm_offline", False))

    def step(name: str, fn) -> None:
        try:
            result = fn()
        except Exception as e:  # a failed optimization must not take the worker down
            skipped[name] = f"{type(e).__name__}: {e}"
            return
        if isinstance(result, Skip):
            skipped[name] = result.reason
        elif result is not None:
            applied[name] = result

    if recipe.num_threads:
        step("num_threads", lambda: _threads(recipe.num_threads))
    if recipe.tiny_vae:
        step("tiny_vae", lambda: swap_tiny_vae(pipe, recipe.tiny_vae, offline))
    step("dtype", lambda: _cast(pipe, recipe.dtype))
    attention = _attention_choice(recipe, skipped)
    if recipe.fuse_qkv:
        step("fuse_qkv", lambda: _fuse_qkv(pipe, denoiser_name, attention))
    step("attention", lambda: set_attention(pipe, denoiser_name, attention, "fuse_qkv" in applied, device))
    if recipe.backend == "openvino":
        step("backend", lambda: to_openvino(pipe, denoiser_name, DTYPES[recipe.dtype], device,
                                            int8_weights=recipe.quantization == "openvino_int8", ir_store=ir_store))
    converted = "backend" in applied
    if recipe.channels_last and not converted:
        step("channels_last", lambda: _channels_last(pipe, denoiser_name))
    if recipe.quantization == "openvino_int8" and converted:
        applied["quantization"] = applied["backend"]["weights"]  # type: ignore[index]
    elif recipe.quantization == "openvino_int8":
        skipped["quantization"] = "openvino_int8 compresses the OpenVINO UNet, and the UNet stayed in PyTorch"
    elif recipe.quantization and converted:
        skipped["quantization"] = "the denoiser runs in OpenVINO"
    elif recipe.quantization:
        step("quantization", lambda: quantize(pipe, recipe.quantization, DTYPES[recipe.dtype], denoiser_name))
    if recipe.vae_backend == "openvino":
        step("vae_backend", lambda: vae_to_openvino(pipe, device, ir_store=ir_store))
    if recipe.vae_tiling:
        step("vae_tiling", lambda: _vae_memory(pipe.vae, "tiling"))
    if recipe.vae_slicing:
        step("vae_slicing", lambda: _vae_memory(pipe.vae, "slicing"))
    if recipe.scheduler_precompute:
        step("scheduler_precompute", lambda: _precompute_scheduler(pipe))
    step("placement", lambda: _place(pipe, device, recipe.cpu_offload))
    if recipe.compile_denoiser or recipe.compile_vae:
        step("compile", lambda: compile_pipeline(
            pipe, denoiser_name, denoiser=recipe.compile_denoiser and not converted,
            vae=recipe.compile_vae and "vae_backend" not in applied,
            regional=recipe.compile_regional, dynamic=recipe.compile_dynamic, mode=recipe.compile_mode,
            device=device, freeze=recipe.compile_freeze, aot=recipe.compile_aot,
            gemm_autotune=recipe.compile_gemm_autotune))
    return {
        "recipe": recipe.name,
        "family": detect_family(pipe),
        "denoiser": denoiser_name,
        "device": device or str(getattr(pipe, "device", "")),
        "applied": applied,
        "skipped": skipped,
        "approximations": recipe.approximations(),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _threads(n: int) -> int:
    torch.set_num_threads(n)
    return n


def _vae_memory(vae, how: str):
    """Tiled (approximate above the tile size) or sliced (exact) VAE decoding."""
    method = getattr(vae, f"enable_{how}", None)
    if method is None:
        return Skip(f"{type(vae).__name__} has no enable_{how}")
    method()
    return True


def _precompute_scheduler(pipe):
    """The scheduler's per-step constants on the device before the loop (exact; the ERNIE-ViLG 2.0
    inference article's precomputed parameters; see :mod:`pipeline.scheduling`)."""
    from pipeline.scheduling import precompute_scheduler, unsupported_reason

    reason = unsupported_reason(pipe.scheduler)
    if reason:
        return Skip(reason)
    pipe.scheduler = precompute_scheduler(pipe.scheduler)
    return type(pipe.scheduler).__name__


def _cast(pipe, dtype: str) -> str:
    """The recipe's dtype; no cast when the pipeline was loaded in it (the normal case)."""
    target = DTYPES[dtype]
    if any(m.dtype != target for m in pipe.components.values() if isinstance(m, torch.nn.Module)):
        pipe.to(dtype=target)
    return dtype


def _attention_choice(recipe: Recipe, skipped: dict[str, str]) -> str:
    if recipe.attention != "flash_attn":
        return recipe.attention
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("flash_attn_interface") is None:
        skipped["flash_attn"] = "flash-attn package not installed; using PyTorch SDPA"
    elif recipe.dtype == "float32":
        skipped["flash_attn"] = "flash-attn needs float16 or bfloat16; using PyTorch SDPA"
    else:
        return "flash_attn"
    return "sdpa"


def _fuse_qkv(pipe, denoiser_name: str, attention: str):
    """Fused QKV projections of the denoiser (and an AutoencoderKL VAE): exact; the ERNIE-ViLG 2.0
    inference article's operator fusion. Needs an SDPA-based processor."""
    from diffusers import AutoencoderKL

    if attention == "sliced":
        return Skip("sliced attention has no fused-projection processor")
    denoiser = getattr(pipe, denoiser_name)
    if not hasattr(denoiser, "fuse_qkv_projections"):
        return Skip(f"{type(denoiser).__name__} has no fuse_qkv_projections (its attention reads q, k, v apart)")
    done = [denoiser_name]
    if denoiser_name == "unet":
        with_vae = isinstance(pipe.vae, AutoencoderKL)
        pipe.fuse_qkv_projections(unet=True, vae=with_vae)
        return done + (["vae"] if with_vae else [])
    denoiser.fuse_qkv_projections()  # SD3 installs its fused processor; FLUX's reads attn.fused_projections
    return done


def _channels_last(pipe, denoiser_name: str):
    """The ERNIE-ViLG 2.0 article's mixed layout computation: NHWC convolutions (exact)."""
    done = []
    for name in (denoiser_name, "vae"):
        model = getattr(pipe, name, None)
        if model is not None and (name == "vae" or denoiser_name == "unet"):
            model.to(memory_format=torch.channels_last)
            done.append(name)
    return done


def _place(pipe, device: str | None, offload: bool):
    if offload:
        target = device or _default_accelerator()
        if target is None or target.startswith("cpu"):
            return Skip("model CPU offload needs an accelerator; the pipeline stays on the CPU")
        pipe.enable_model_cpu_offload(device=target)
        return f"model_cpu_offload:{target}"
    if device is None:
        return None
    pipe.to(device)
    return device


def _default_accelerator() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return str(acc.current_accelerator())
    return None
