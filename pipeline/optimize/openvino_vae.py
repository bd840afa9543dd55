"""OpenVINO as the CPU backend of the VAE decoder (recipe knob ``vae_backend: openvino``).

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`vae_to_openvino` (here),
beside the UNet's conversion (:mod:`pipeline.optimize.openvino`) and before placement. The
``post_quant_conv`` and ``decoder`` of an ``AutoencoderKL`` are converted together (SD 1.x/2.x/XL,
SD3 and FLUX VAEs) and the ``post_quant_conv`` becomes an identity: diffusers' ``vae.decode`` keeps
its slicing, tiling and the farm's OOM guard around them, and ``vae.encode`` (image inputs) stays in
PyTorch. The tiny autoencoder is left as it is.

Why: an ``exact`` recipe keeps the full VAE decoder, which is a large share of a small image's
time on the CPU. The SD 1.5-architecture decoder at 32×32 latents (256² images), float32 on a
2-vCPU Intel Xeon with AMX, one process, medians of 3 calls: PyTorch 2.59 s at batch 1 and
9.99 s at batch 4, OpenVINO (``f32`` inference precision) 2.00 s and 8.07 s (1.29× / 1.24×),
largest difference 3.2e-5 on outputs in [-1, 1]; converted and compiled in 6.4 s
(docs/performance/index.md). ``f32`` keeps float32 arithmetic on AMX, where OpenVINO would
otherwise infer in bf16.

Each image is decoded by its own call (:class:`OpenVinoDecoder`): batch invariant by construction,
for 3 % of the decoder's time at batch 4 (PyTorch's 1×1 ``post_quant_conv`` was not invariant:
ATen picks its kernel by size, so it goes into the same call). The converted decoder is shared
through the same IR cache as the UNet (:mod:`pipeline.optimize.openvino_ir`), keyed by its
weights and the VAE's config.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from pipeline import compile_count
from pipeline.optimize.openvino import OpenVinoModule, compile_cpu, converted, precision_of, trace
from pipeline.optimize.quantize import Skip


class DecoderCall(torch.nn.Module):
    """``vae.post_quant_conv`` (where the VAE has one) then ``vae.decoder``: scaled latents → the
    image, in [-1, 1]. Carries the VAE's ``config`` and attention processors, so the IR cache key
    (:func:`pipeline.optimize.openvino_ir.ir_key`) names the architecture, not only the weights."""

    def __init__(self, vae):
        super().__init__()
        self.post_quant_conv = getattr(vae, "post_quant_conv", None) or torch.nn.Identity()
        self.decoder = vae.decoder
        self.config = vae.config
        self.attn_processors = dict(getattr(vae, "attn_processors", {}) or {})

    def forward(self, sample):
        return self.decoder(self.post_quant_conv(sample))


class OpenVinoDecoder(OpenVinoModule):
    """A compiled OpenVINO ``post_quant_conv`` + decoder with ``vae.decoder``'s call: ``(B, C_latent,
    h, w)`` → ``(B, 3, 8h, 8w)`` for SD's VAE, any batch and size. Inputs go in as float32 NumPy arrays; the output
    comes back in the input's dtype. Raises ValueError for ``latent_embeds`` (spatially conditioned
    decoders, which it was not converted with).

    It decodes one image per OpenVINO call, whatever the batch: every call then has the shape the
    image has alone, so an image's pixels never depend on its batch-mates (OpenVINO's kernels may
    depend on the batch size). Batching bought little to give up: the sd15-arch decoder at batch 4,
    32×32 latents, took 7.08 s in one call and 7.30 s in four (+3 %), against 8.32 s in PyTorch.
    """

    def __init__(self, decoder, compiled, precision: str):
        super().__init__(decoder, compiled, precision)
        self.gradient_checkpointing = False  # diffusers reads it from the decoder

    def forward(self, sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if latent_embeds is not None:
            raise ValueError("the OpenVINO VAE decoder was converted without latent_embeds")
        compile_count.count_call(compiled=True)
        images = [self.compiled([sample[i:i + 1].float().numpy()])[0] for i in range(sample.shape[0])]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(images))).to(sample.dtype)


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
    if getattr(vae, "post_quant_conv", None) is not None:  # now inside the converted model
        vae.post_quant_conv = torch.nn.Identity()
    report = {"backend": "openvino", "version": ov.__version__, "precision": precision}
    return {**report, "ir": ir} if ir is not None else report


def _convert(call: DecoderCall):
    """``call`` traced into an OpenVINO model with dynamic batch and sides (float32 weights)."""
    channels = call.config.get("latent_channels", 4)
    return trace(call, (torch.randn(1, channels, 8, 10),))  # small: the trace runs the decoder once
