"""OpenVINO as the CPU backend of the VAE decoder (recipe knob ``vae_backend: openvino``).

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`vae_to_openvino` (here),
beside the UNet's conversion (:mod:`pipeline.optimize.openvino`) and before placement. Only the
``decoder`` of an ``AutoencoderKL`` is converted (SD 1.x/2.x/XL, SD3 and FLUX VAEs): diffusers'
``vae.decode`` keeps its own ``post_quant_conv``, slicing, tiling and the farm's OOM guard around it,
and ``vae.encode`` (image inputs) stays in PyTorch. The tiny autoencoder is left as it is.

Why: an ``exact`` recipe keeps the full VAE decoder, which is a large share of a small image's
time on the CPU. The SD 1.5-architecture decoder at 32×32 latents (256² images), float32 on a
2-vCPU Intel Xeon with AMX, one process, medians of 3 calls: PyTorch 2.59 s at batch 1 and
9.99 s at batch 4, OpenVINO (``f32`` inference precision) 2.00 s and 8.07 s (1.29× / 1.24×),
largest difference 3.2e-5 on outputs in [-1, 1]; converted and compiled in 6.4 s
(docs/performance/index.md). ``f32`` keeps float32 arithmetic on AMX, where OpenVINO would
otherwise infer in bf16.

The converted decoder is shared through the same IR cache as the UNet
(:mod:`pipeline.optimize.openvino_ir`), keyed by its weights and the VAE's config.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from pipeline.optimize.openvino import compile_cpu, converted, dynamic_shapes, precision_of
from pipeline.optimize.quantize import Skip


class DecoderCall(torch.nn.Module):
    """``vae.decoder`` as a function of the latents after ``post_quant_conv`` → the image, in
    [-1, 1]. Carries the VAE's ``config`` and attention processors, so the IR cache key
    (:func:`pipeline.optimize.openvino_ir.ir_key`) names the architecture, not only the weights."""

    def __init__(self, vae):
        super().__init__()
        self.decoder = vae.decoder
        self.config = vae.config
        self.attn_processors = dict(getattr(vae, "attn_processors", {}) or {})

    def forward(self, sample):
        return self.decoder(sample)


class OpenVinoDecoder(torch.nn.Module):
    """A compiled OpenVINO decoder with ``vae.decoder``'s call: ``(B, C_latent, h, w)`` → ``(B, 3,
    8h, 8w)`` for SD's VAE, any batch and size. Inputs go in as float32 NumPy arrays; the output
    comes back in the input's dtype. Raises ValueError for ``latent_embeds`` (spatially conditioned
    decoders, which it was not converted with)."""

    _renderfarm_per_sample_for_invariance = True  # its kernels are not verified batch invariant
    runtime = "openvino"
    _anchor: torch.Tensor  # a registered buffer

    def __init__(self, decoder, compiled, precision: str):
        super().__init__()
        self.source_class = type(decoder).__name__
        self.compiled = compiled
        self.precision = precision
        # diffusers reads these from the decoder (gradient checkpointing, the upcast dtype)
        self.gradient_checkpointing = False
        self.register_buffer("_anchor", torch.zeros(0, dtype=next(decoder.parameters()).dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    def forward(self, sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if latent_embeds is not None:
            raise ValueError("the OpenVINO VAE decoder was converted without latent_embeds")
        out = self.compiled([sample.float().numpy()])[0]
        return torch.from_numpy(np.ascontiguousarray(out)).to(sample.dtype)


def vae_to_openvino(pipe, device: str | None, ir_store=None):
    """Replace ``pipe.vae.decoder`` by its OpenVINO compilation; returns a report dict or a
    :class:`~pipeline.optimize.quantize.Skip` with the reason (not on the CPU, no openvino wheel,
    no VAE, a VAE that is not an ``AutoencoderKL``, e.g. the tiny autoencoder).

    The precision follows the VAE's dtype (float32 → ``f32``, exact up to kernel rounding).
    ``ir_store``: where converted models are shared (None: convert at every load); the report's
    ``ir`` is then the cache outcome. Raises whatever the conversion raises (``apply_recipe``
    records it under ``skipped``; the PyTorch decoder stays).
    """
    if (device or "cpu").partition(":")[0] != "cpu":
        return Skip("the OpenVINO backend runs on the CPU only")
    if importlib.util.find_spec("openvino") is None:
        return Skip("openvino not installed (pip install openvino: it does not touch torch)")
    vae = getattr(pipe, "vae", None)
    if vae is None or type(vae).__name__ != "AutoencoderKL":
        return Skip(f"only AutoencoderKL decoders are converted; this VAE is {type(vae).__name__}")
    import openvino as ov

    call = DecoderCall(vae).eval()
    model, ir = converted(pipe, call, lambda: _convert(call), ir_store, component="vae.decoder")
    precision = precision_of(vae.dtype)
    compiled = compile_cpu(model, precision)
    vae.decoder = OpenVinoDecoder(vae.decoder, compiled, precision)
    report = {"backend": "openvino", "version": ov.__version__, "precision": precision}
    return {**report, "ir": ir} if ir is not None else report


def _convert(call: DecoderCall):
    """``call`` traced into an OpenVINO model with dynamic batch and sides (float32 weights)."""
    import openvino as ov
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder

    channels = call.config.get("latent_channels", 4)
    example = (torch.randn(1, channels, 8, 10),)  # small: the trace runs the decoder once
    dtype = next(call.parameters()).dtype
    try:
        with torch.inference_mode():
            decoder = TorchScriptPythonDecoder(call.float(), example_input=example,
                                               trace_kwargs={"check_trace": False})
            model = ov.convert_model(decoder, example_input=example)
    finally:
        call.to(dtype)
    dynamic_shapes(model)
    return model
