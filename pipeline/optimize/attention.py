"""Attention for every denoiser: PyTorch SDPA, the flash-attn kernels, cuDNN SDPA, or slicing.

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`set_attention` (here).

UNets (SD 1.x / 2.x / XL) use diffusers' attention *processors*: :class:`FlashAttnProcessor`
for the flash-attn kernels (Dao et al. 2022; the ERNIE-ViLG 2.0 inference article and the
Rapid Diffusion paper both name FlashAttention), ``AttnProcessor2_0`` / ``FusedAttnProcessor2_0``
for SDPA. Transformers (SD3, FLUX, ERNIE-Image) go through diffusers' attention dispatcher
(``set_attention_backend``): ``flash`` (flash-attn 2), ``_flash_3`` (FlashAttention-3 on Hopper,
when ``flash_attn_interface`` imports), ``_native_cudnn`` (PyTorch's cuDNN SDPA); ``sdpa`` keeps
the dispatcher's default, native SDPA.
"""

from __future__ import annotations

import importlib.util
from typing import cast

import torch
from diffusers.models.attention_processor import AttnProcessor2_0, FusedAttnProcessor2_0


def transformer_backend(attention: str, device: str | None) -> str | None:
    """The diffusers dispatcher backend for a transformer, or None to keep native SDPA."""
    if attention == "cudnn":
        return "_native_cudnn"
    if attention != "flash_attn":
        return None
    hopper = (device or "").startswith("cuda") and torch.cuda.is_available() \
        and torch.cuda.get_device_capability(torch.device(cast(str, device))) >= (9, 0)
    if hopper and importlib.util.find_spec("flash_attn_interface") is not None:
        return "_flash_3"
    return "flash"


def set_attention(pipe, denoiser_name: str, attention: str, fused: bool, device: str | None) -> str:
    """Apply ``attention`` to the denoiser (and SDPA to an AutoencoderKL VAE); returns what ran."""
    if attention == "default":
        return "default"
    if attention == "sliced":
        pipe.enable_attention_slicing()
        return "sliced"
    denoiser = getattr(pipe, denoiser_name)
    if denoiser_name == "transformer":
        backend = transformer_backend(attention, device)
        if backend is not None:
            denoiser.set_attention_backend(backend)
        return backend or "sdpa"
    sdpa = FusedAttnProcessor2_0 if fused else AttnProcessor2_0
    for name, model in ((denoiser_name, denoiser), ("vae", getattr(pipe, "vae", None))):
        if model is not None and hasattr(model, "set_attn_processor") and model.attn_processors:
            model.set_attn_processor(FlashAttnProcessor() if attention == "flash_attn" and name == "unet" else sdpa())
    return attention


class FlashAttnProcessor:
    """The flash-attn kernel (Dao et al. 2022) for a UNet's attention.

    Handles plain and fused (``to_qkv``/``to_kv``) projections. Anything the kernel does not
    cover (masks, 4-D inputs, group or spatial norms, fp32, non-CUDA tensors, head_dim > 256 or
    not a multiple of 8) goes to diffusers' SDPA processor, so it is never worse than SDPA.
    """

    def __init__(self, flash_fn=None, devices: tuple[str, ...] = ("cuda",)):
        if flash_fn is None:
            from flash_attn import flash_attn_func

            flash_fn = flash_attn_func
        self.flash_fn, self.devices = flash_fn, devices
        self.sdpa, self.fused_sdpa = AttnProcessor2_0(), FusedAttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        fused = getattr(attn, "fused_projections", False)
        head_dim = attn.inner_dim // attn.heads
        if (attention_mask is not None or hidden_states.ndim != 3 or attn.spatial_norm is not None
                or attn.group_norm is not None or attn.norm_q is not None or attn.norm_k is not None
                or hidden_states.device.type not in self.devices
                or hidden_states.dtype not in (torch.float16, torch.bfloat16)
                or head_dim > 256 or head_dim % 8):
            fallback = self.fused_sdpa if fused else self.sdpa
            return fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        batch = hidden_states.shape[0]
        if fused and encoder_hidden_states is None:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            if encoder_hidden_states is not None and attn.norm_cross:
                context = attn.norm_encoder_hidden_states(context)
            q = attn.to_q(hidden_states)
            k, v = attn.to_kv(context).chunk(2, dim=-1) if fused else (attn.to_k(context), attn.to_v(context))
        q, k, v = (t.reshape(batch, -1, attn.heads, head_dim) for t in (q, k, v))
        out = self.flash_fn(q, k, v, dropout_p=0.0, causal=False)  # (batch, seq, heads, head_dim)
        out = attn.to_out[1](attn.to_out[0](out.reshape(batch, -1, attn.heads * head_dim).to(q.dtype)))
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor

