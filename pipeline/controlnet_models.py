"""Which ControlNet class serves which denoiser, and the offline random-weight ControlNet builds.

Place in the data flow: worker → pipeline: :class:`pipeline.controlnet.ControlNets` asks
:func:`controlnet_kind` which ControlNet model class (and multi-ControlNet wrapper) fits the
pinned pipeline's denoiser, loads sources with that class, makes offline ones with
:func:`build_offline_controlnet`, and the renderer wraps a call of a latent-conditioned ControlNet
pipeline in :func:`control_encodes_by_mode`.

The kinds are diffusers' (0.42): a ``UNet2DConditionModel`` (SD 1/2, SDXL) takes a
``ControlNetModel`` whose conditioning embedding reads the control image in pixels, several of them
as one ``MultiControlNetModel``; an ``SD3Transformer2DModel`` takes an ``SD3ControlNetModel``
(``SD3MultiControlNetModel``) and a ``FluxTransformer2DModel`` a ``FluxControlNetModel``
(``FluxMultiControlNetModel``), both of which take the control image *through the VAE*: the
pipeline encodes it to latents and the ControlNet patch-embeds those (InstantX's SD3 and FLUX.1
ControlNets; a FLUX ControlNet with an ``input_hint_block``, XLabs' layout, reads pixels instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Standard deviation of the offline builds' zero-initialised projections (drawn, so that the build
#: visibly controls: diffusers leaves them at zero, no effect until trained).
OFFLINE_ZERO_CONV_STD = 0.5
#: Gain on the offline UNet ControlNet's conditioning-embedding convolutions (PyTorch's default
#: initialisation shrinks an edge map over its 8 layers until the latents alone drive the
#: residuals). Measured on ``tiny`` at 64², 3 steps: zero convolutions at 0.5 without this gain, two
#: control images' renders differ by 0.02 (mean |difference|, 0…255); with about 2 per layer, by 3 to 5.
OFFLINE_COND_GAIN = 2.0


@dataclass(frozen=True)
class ControlNetKind:
    """The ControlNet classes of one denoiser class (see the module docstring).

    ``model`` / ``multi``: diffusers' ControlNet and multi-ControlNet class names. ``latent``: the
    pipeline encodes the control image with the VAE before the ControlNet sees it. ``zero``:
    parameter-name prefixes that diffusers initialises to zero (drawn by the offline build).
    ``gain``: prefixes whose weights the offline build scales by :data:`OFFLINE_COND_GAIN`.
    ``make``: the ControlNet's layout from the pinned denoiser, random weights (float32, CPU).
    """

    model: str
    multi: str
    latent: bool
    zero: tuple[str, ...]
    gain: tuple[str, ...]
    make: Callable[[Any], Any]


def _from_unet(unet):
    from diffusers import ControlNetModel

    return ControlNetModel.from_unet(unet, load_weights_from_unet=False)


def _from_sd3(transformer):
    # SD3ControlNetModel.from_transformer writes num_layers into the transformer's own config (0.42):
    # the same construction from a copy of that config. Two blocks of the tiny transformer's width and
    # no extra conditioning channel (InstantX's SD3 ControlNets; 1 is alimama's inpainting one's mask).
    from diffusers import SD3ControlNetModel

    config = {**dict(transformer.config), "num_layers": min(2, int(transformer.config.num_layers)),
              "extra_conditioning_channels": 0}
    return SD3ControlNetModel.from_config(config)


def _from_flux(transformer):
    from diffusers import FluxControlNetModel

    cfg = transformer.config
    return FluxControlNetModel.from_transformer(
        transformer, num_layers=min(2, int(cfg.num_layers)), num_single_layers=min(2, int(cfg.num_single_layers)),
        attention_head_dim=int(cfg.attention_head_dim), num_attention_heads=int(cfg.num_attention_heads),
        load_weights_from_transformer=False)


#: Denoiser class name → its ControlNet kind.
CONTROLNET_KINDS: dict[str, ControlNetKind] = {
    "UNet2DConditionModel": ControlNetKind(
        "ControlNetModel", "MultiControlNetModel", False,
        ("controlnet_down_blocks.", "controlnet_mid_block.", "controlnet_cond_embedding.conv_out."),
        ("controlnet_cond_embedding.",), _from_unet),
    "SD3Transformer2DModel": ControlNetKind(
        "SD3ControlNetModel", "SD3MultiControlNetModel", True, ("controlnet_blocks.", "pos_embed_input."), (),
        _from_sd3),
    "FluxTransformer2DModel": ControlNetKind(
        "FluxControlNetModel", "FluxMultiControlNetModel", True,
        ("controlnet_blocks.", "controlnet_single_blocks.", "controlnet_x_embedder."), (), _from_flux),
}


def controlnet_kind(pipe) -> ControlNetKind:
    """The ControlNet kind of ``pipe``'s denoiser.

    Raises:
        ValueError: a denoiser diffusers has no ControlNet class for here (FLUX.2, ERNIE-Image, …).
    """
    from pipeline.models.families import denoiser_of

    _, denoiser = denoiser_of(pipe)
    kind = CONTROLNET_KINDS.get(type(denoiser).__name__)
    if kind is None:
        raise ValueError(f"{type(pipe).__name__}'s {type(denoiser).__name__} has no ControlNet class in diffusers "
                         f"(ControlNets serve {', '.join(CONTROLNET_KINDS)})")
    return kind


def controlnet_class(kind: ControlNetKind, multi: bool = False):
    """diffusers' class of ``kind``: the ControlNet, or with ``multi`` its multi-ControlNet wrapper."""
    from diffusers.models import controlnets

    return getattr(controlnets, kind.multi if multi else kind.model)


def build_offline_controlnet(name: str, pipe, cache_dir: Path) -> Path:
    """An offline random-weight ControlNet for ``pipe``'s denoiser, saved once under ``cache_dir``
    (``controlnets/<model hash>/<name>/``, diffusers' layout); returns the directory.

    Made by the kind's ``make`` (``ControlNetModel.from_unet``, ``FluxControlNetModel.from_transformer``,
    ``SD3ControlNetModel`` from the transformer's config) without copying the denoiser's weights, so
    whatever a recipe did to its modules does not matter: every weight is drawn from PyTorch's default
    initialisation under a seed derived from ``name``, the zero-initialised projections from
    N(0, :data:`OFFLINE_ZERO_CONV_STD`²) with a generator of that seed, and a UNet ControlNet's
    conditioning embedding scaled by :data:`OFFLINE_COND_GAIN`, so that a name always builds the same
    ControlNet and its control image visibly changes the images.

    Raises:
        ValueError: ``pipe``'s denoiser has no ControlNet kind (:func:`controlnet_kind`).
    """
    import torch

    from pipeline.models.build import addon_build_dir, name_seed, published_once
    from pipeline.models.families import denoiser_of

    kind = controlnet_kind(pipe)
    final = addon_build_dir(cache_dir, "controlnets", pipe, name)
    if (final / "config.json").is_file():
        return final
    seed = name_seed(name)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        net = kind.make(denoiser_of(pipe)[1]).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in net.named_parameters():
            if param_name.startswith(kind.zero):
                param.copy_(torch.randn(param.shape, generator=generator) * OFFLINE_ZERO_CONV_STD)
            if kind.gain and param_name.startswith(kind.gain) and param_name.endswith(".weight"):
                param.mul_(OFFLINE_COND_GAIN)
    with published_once(final) as tmp:  # another process may build it meanwhile: theirs is kept
        net.save_pretrained(tmp, safe_serialization=True)
    return final


def latent_control_images(pipe) -> int:
    """How many control images a call of ``pipe`` encodes with its VAE: one per ControlNet of a
    latent kind (:attr:`ControlNetKind.latent`) without an ``input_hint_block`` (a FLUX ControlNet
    with one reads pixels); 0 for a pipeline without ControlNets."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return 0
    nets = list(getattr(controlnet, "nets", [controlnet]))
    latent = {k.model for k in CONTROLNET_KINDS.values() if k.latent}
    return sum(type(n).__name__ in latent and getattr(n, "input_hint_block", None) is None for n in nets)


@contextlib.contextmanager
def control_encodes_by_mode(pipe) -> Iterator[None]:
    """During the block, the first :func:`latent_control_images` encodes of ``pipe``'s VAE return a
    posterior whose ``sample`` is its mode (the mean), drawing no noise.

    For the latent-conditioned ControlNet pipelines (SD3's and FLUX.1's): they encode each unit's
    control image first of all their VAE encodes (diffusers 0.42: step 3, "Prepare control image",
    before the latents and any init image), FLUX's drawing the posterior sample from the requests'
    generators and SD3's from the global generator. The mode keeps a seed's starting noise the plain
    render's (weight 0 renders the plain image), the render repeatable and each image independent
    of its batch-mates. A VAE without a posterior (a tiny autoencoder) is left as it is.
    """
    count = latent_control_images(pipe)
    vae = getattr(pipe, "vae", None)
    if count <= 0 or vae is None:
        yield
        return
    original = vae.encode
    remaining = [count]

    def encode(*args, **kwargs):
        out = original(*args, **kwargs)
        dist = getattr(out, "latent_dist", None)
        if remaining[0] > 0 and dist is not None:
            remaining[0] -= 1
            dist.sample = lambda generator=None: dist.mode()
        return out

    vae.encode = encode  # an instance attribute over the method, removed below
    try:
        yield
    finally:
        del vae.encode
