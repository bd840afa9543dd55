"""Bench-level knobs: what a profile may call for, tried on any row in the same run.

Place in the data flow: :mod:`bench.pipeline.specs` parses them (``sdpa=…``, ``fp8=true``,
``first_block_cache=0.1``); :mod:`bench.pipeline.subjects` applies them after loading a row and
around its renders. They are experiments beside the farm's recipes, named in the row's report.

* ``sdpa``: pins PyTorch's scaled-dot-product-attention backend for the renders
  (``torch.nn.attention.sdpa_kernel``): ``flash`` (FlashAttention-2 in PyTorch), ``cudnn``
  (cuDNN's fused attention, Hopper's fastest in PyTorch), ``efficient``, ``math``. Exact up to
  kernel rounding.
* ``fp8``: torchao's dynamic float8 quantization of the denoiser's linear layers
  (``Float8DynamicActivationFloat8WeightConfig``, per-row scales), for GPUs of compute capability
  >= 8.9 (FP8 tensor cores). Approximate. torchao's own guidance: pair it with ``torch.compile``
  (a compiled row), which fuses the per-token scaling; eager it is slower.
* ``first_block_cache``: diffusers' First Block Cache (``FirstBlockCacheConfig(threshold=t)``):
  when the first transformer block's output changes less than ``t`` (relative) from the previous
  step, the other blocks' residual is reused. Approximate (the DeepCache family: reuse of the
  denoiser's features between adjacent steps).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from bench.pipeline.render_probes import denoiser_attr, inner_module

SDPA_MEMBERS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "math": "MATH"}


def sdpa_context(backend: str | None):
    """A context that pins ``backend`` (a key of :data:`SDPA_MEMBERS`), or does nothing for None."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_MEMBERS[backend]))


def _fp8(module, device: str) -> str:
    if not device.startswith("cuda") or torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("fp8 needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)")
    if importlib.util.find_spec("torchao") is None:
        raise RuntimeError("torchao not installed")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return "torchao Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()) on the denoiser"


def _first_block_cache(module, threshold: float) -> str:
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    config = FirstBlockCacheConfig(threshold=threshold)
    if hasattr(module, "enable_cache"):
        module.enable_cache(config)
        return f"diffusers FirstBlockCacheConfig(threshold={threshold}) on the denoiser"
    try:
        apply_first_block_cache(module, config)
    except (IndexError, ValueError) as e:  # it found no transformer blocks to hook
        raise RuntimeError(f"{type(module).__name__} has no transformer blocks that diffusers' First Block Cache "
                           f"can hook ({type(e).__name__}: {e})") from e
    return f"diffusers FirstBlockCacheConfig(threshold={threshold}) on the denoiser"


def apply_knobs(pipe, device: str, *, fp8: bool = False, first_block_cache: float | None = None) -> tuple[dict, list]:
    """Apply the knobs asked for to ``pipe``'s denoiser (under any ``torch.compile`` wrapper).

    Returns (report with ``applied``/``skipped``, approximations turned on). A knob that cannot
    apply here (no GPU for fp8, a denoiser without transformer blocks) is skipped with its reason.
    """
    applied: dict[str, str] = {}
    skipped: dict[str, str] = {}
    approximations: list[str] = []
    module = inner_module(getattr(pipe, denoiser_attr(pipe)))
    steps = []
    if fp8:
        steps.append(("fp8", lambda: _fp8(module, device)))
    if first_block_cache is not None:
        steps.append(("first_block_cache", lambda: _first_block_cache(module, first_block_cache)))
    for name, step in steps:
        try:
            applied[name] = step()
            approximations.append(name)
        except Exception as e:  # report, keep the row: the other knobs and the row still measure
            skipped[name] = f"{type(e).__name__}: {e}"
    return {"applied": applied, "skipped": skipped}, approximations
