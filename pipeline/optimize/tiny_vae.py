"""The tiny autoencoder that matches the model's VAE (diffusers' "Speed up inference": TAESD).

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`swap_tiny_vae` (here).

``auto`` picks from the VAE's config (:func:`pipeline.models.families.tiny_vae_for`: class,
latent channels, scaling and shift factors), never from the channel count alone: taesd for SD
1.x/2.x, taesdxl for SDXL, taesd3 for SD3, taef1 for FLUX.1, none for FLUX.2 and ERNIE-Image.
Offline models (random weights) get the offline build of the same architecture with random
weights; real models get madebyollin's checkpoint from the hub (or the local cache).
"""

from __future__ import annotations

import torch

from pipeline.models.families import OFFLINE_TINY_VAES, TINY_VAES, tiny_vae_for, vae_signature
from pipeline.optimize.quantize import Skip


def swap_tiny_vae(pipe, source: str, offline: bool):
    """Replace ``pipe.vae`` by a tiny autoencoder; returns its name, or a :class:`Skip` with the reason."""
    from diffusers import AutoencoderTiny

    match = tiny_vae_for(pipe.vae)
    if source == "auto":
        if match is None:
            return Skip(f"no tiny autoencoder is known for this VAE {vae_signature(pipe.vae)}")
        source = match.offline if offline else match.hub
    known = next((t for t in TINY_VAES if source in (t.hub, t.offline)), None)
    if known is not None and known is not match:
        want = f"{match.hub} / {match.offline}" if match else "none"
        return Skip(f"{source} decodes {known.signature} latents, this VAE is {vae_signature(pipe.vae)} "
                    f"(its tiny autoencoder: {want})")
    if source in OFFLINE_TINY_VAES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # random weights, reproducible: for the offline models only
            tiny = AutoencoderTiny(**OFFLINE_TINY_VAES[source])
    else:
        try:
            tiny = AutoencoderTiny.from_pretrained(source)
        except (OSError, ValueError) as e:
            return Skip(f"{source} not available ({type(e).__name__}); pre-download it to enable")
    if tiny.config.latent_channels != pipe.vae.config.latent_channels:
        return Skip(f"{source} has {tiny.config.latent_channels} latent channels, the model's VAE "
                    f"{pipe.vae.config.latent_channels}")
    pipe.vae = tiny.to(device=pipe.vae.device, dtype=pipe.vae.dtype)
    return source
