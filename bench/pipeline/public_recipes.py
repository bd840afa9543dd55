"""Public recipes the farm is measured against, applied to a plain diffusers pipeline exactly as
their authors publish them (not through the farm's recipes).

Place in the data flow: :mod:`bench.pipeline.subjects` loads the reference pipeline, then calls
one of these on it for the ``peer`` and ``sdnq-uint4`` rows.

* :func:`apply_fast_diffusion`: diffusers' tutorial "Accelerate inference of text-to-image
  diffusion models" (``docs/source/en/tutorials/fast_diffusion.md``; SDXL on an A100, "up to
  3x" with PyTorch 2 alone): bfloat16, SDPA, the four Inductor flags below,
  ``fuse_qkv_projections()``, ``channels_last`` for the UNet and the VAE, then
  ``torch.compile(…, mode="max-autotune", fullgraph=True)`` of the denoiser and of
  ``vae.decode``. Transformer pipelines (FLUX, SD3, ERNIE-Image) get the same steps where their
  classes offer them (``transformer.fuse_qkv_projections``; channels_last only where there are
  convolutions). With CUDA graphs (a ``peer:compile_mode`` of ``reduce-overhead`` or
  ``max-autotune`` on CUDA) the compiled denoiser's outputs are cloned after each call, the remedy
  PyTorch's CUDAGraph Trees documentation gives: without it a multistep scheduler (SD 1.5's PNDM)
  reads an output the next replay overwrote, and the row fails.
* :func:`apply_sdnq_uint4`: the ERNIE-Image-Turbo SDNQ uint4 model card
  (WaveCut/ERNIE-Image-Turbo-SDNQ-uint4-static): uint4 weights for ``pe``, ``text_encoder`` and
  ``transformer``, ``dequantize_fp32=False``, and quantized matmul switched on explicitly with
  ``apply_sdnq_options_to_model(…, use_quantized_matmul=True)``, which the card says current
  loaders need. The card quantized its checkpoint offline; random-weight models are quantized
  here after loading (``sdnq_post_load_quant``), on the device.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from bench.pipeline import adapter
from bench.pipeline.render_probes import denoiser_attr

#: The Inductor settings of the tutorial's torch.compile section.
TUTORIAL_INDUCTOR_FLAGS = {
    "conv_1x1_as_mm": True,
    "coordinate_descent_tuning": True,
    "epilogue_fusion": False,
    "coordinate_descent_check_all_directions": True,
}
#: Of those, the ones that benchmark every generated kernel's launch configurations while
#: compiling (``peer:tuning=false`` leaves them out). Measured on an H100: with them, compiling
#: even the ``tiny`` test model's UNet in mode "default" took 450 s (16 host cores).
TUNING_FLAGS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions")
#: Components the SDNQ model card quantizes (plus ``unet`` for UNet families).
SDNQ_COMPONENTS = ("pe", "text_encoder", "transformer", "unet")


def tutorial_flags(tuning: bool = True) -> dict[str, bool]:
    """The Inductor settings :func:`inductor_flags` sets: :data:`TUTORIAL_INDUCTOR_FLAGS` that this
    torch has, less :data:`TUNING_FLAGS` without ``tuning``."""
    import torch._inductor.config as inductor

    return {k: v for k, v in TUTORIAL_INDUCTOR_FLAGS.items()
            if hasattr(inductor, k) and (tuning or k not in TUNING_FLAGS)}


def inductor_flags(tuning: bool = True):
    """A context in which Inductor compiles with :func:`tutorial_flags`. Scoped, so the farm's own
    compiled rows in the same process keep the defaults; Inductor's cache keys include its config,
    so no compiled graph crosses over."""
    import torch._inductor.config as inductor

    flags = tutorial_flags(tuning)
    return inductor.patch(flags) if flags else contextlib.nullcontext()


def apply_fast_diffusion(pipe, *, compile: bool = True, mode: str = "max-autotune", fullgraph: bool = True,
                         tuning: bool = True) -> dict:
    """Apply the tutorial's steps to ``pipe`` in place (already in bfloat16 on its device).

    ``torch.compile`` is lazy: the first render compiles, so renders must run inside
    :func:`inductor_flags` (with the same ``tuning``). Returns ``{"applied": {step: value},
    "skipped": {step: reason}}``; ``applied["compile"]["inductor"]`` is what that context sets
    (what a render saw is in the bench row's ``observed``, :mod:`bench.pipeline.ran_with`).
    """
    from diffusers import AutoencoderKL

    applied: dict[str, object] = {}
    skipped: dict[str, str] = {}
    name = denoiser_attr(pipe)
    denoiser = getattr(pipe, name)
    vae = getattr(pipe, "vae", None)
    fuse_vae = isinstance(vae, AutoencoderKL)
    try:
        if name == "unet" and hasattr(pipe, "fuse_qkv_projections"):
            pipe.fuse_qkv_projections(unet=True, vae=fuse_vae)
            applied["fuse_qkv"] = ["unet", "vae"] if fuse_vae else ["unet"]
        else:
            denoiser.fuse_qkv_projections()
            applied["fuse_qkv"] = [name]
    except (AttributeError, ValueError, NotImplementedError) as e:
        skipped["fuse_qkv"] = f"{type(e).__name__}: {e}"
    layout = []
    for part, module in ((name, denoiser), ("vae", vae)):
        if module is not None and any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
            module.to(memory_format=torch.channels_last)
            layout.append(part)
    applied["channels_last"] = layout
    if not compile:
        skipped["compile"] = "turned off (peer:compile=false; the default on the CPU)"
        return {"applied": applied, "skipped": skipped}
    compiled_denoiser = torch.compile(denoiser, mode=mode, fullgraph=fullgraph)
    setattr(pipe, name, compiled_denoiser)
    if mode in ("reduce-overhead", "max-autotune") and getattr(pipe.device, "type", "") == "cuda":
        # CUDA graphs: each replay overwrites the previous one's outputs, which multistep schedulers
        # (PNDM, DPM-Solver++, UniPC) still read, and CUDAGraph Trees raise on that access. The
        # remedy PyTorch's CUDAGraph Trees documentation gives, as hooks on the compiled wrapper
        # (they run outside the graph): a new step before each call, the outputs cloned after it.
        adapter.cudagraph_safe(compiled_denoiser)
        applied["cuda_graph_outputs"] = "cloned after each denoiser call (CUDAGraph Trees' remedy)"
    compiled = [name]
    if vae is not None:
        vae.decode = torch.compile(vae.decode, mode=mode, fullgraph=fullgraph)
        compiled.append("vae.decode")
    applied["compile"] = {"mode": mode, "fullgraph": fullgraph, "modules": compiled,
                          "inductor": tutorial_flags(tuning)}
    return {"applied": applied, "skipped": skipped}


def apply_sdnq_uint4(pipe, dtype: torch.dtype, quantized_matmul: bool = True) -> dict:
    """Quantize ``pipe``'s card components to SDNQ uint4 in place, then switch quantized matmul
    on explicitly, as the model card's usage section does.

    Raises:
        ModuleNotFoundError: the ``sdnq`` package is not installed.
    """
    if importlib.util.find_spec("sdnq") is None:
        raise ModuleNotFoundError("sdnq-uint4 needs the sdnq package (pip install --no-deps sdnq)")
    from sdnq import sdnq_post_load_quant
    from sdnq.loader import apply_sdnq_options_to_model

    done = []
    for name in SDNQ_COMPONENTS:
        module = getattr(pipe, name, None)
        if not isinstance(module, torch.nn.Module):
            continue
        module = sdnq_post_load_quant(module, weights_dtype="uint4", torch_dtype=dtype, dequantize_fp32=False,
                                      use_quantized_matmul=quantized_matmul)
        module = apply_sdnq_options_to_model(module, use_quantized_matmul=quantized_matmul)
        setattr(pipe, name, module)
        config = getattr(module, "quantization_config", None)
        done.append({"component": name, "use_quantized_matmul": getattr(config, "use_quantized_matmul", None)})
    return {"applied": {"sdnq_uint4": done}, "skipped": {}}
