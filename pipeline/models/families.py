"""Model families as data: which pipeline, which denoiser, the reference dtype, the tiny VAE.

Place in the data flow: :func:`pipeline.models.load.load_pipeline` loads a model in its family's
reference dtype; :func:`pipeline.recipes.recipe_for` fits a recipe to the family; the tiny-VAE
step of :mod:`pipeline.optimize` picks the tiny autoencoder that matches the VAE's config.

**Reference dtype** (what "exact" means for a model): diffusers at the dtype its model card
recommends on an accelerator: ``torch_dtype=torch.float16`` in the SD 1.5, SD 2.x / SD-Turbo,
SDXL / SDXL-Turbo and SD3-medium cards and diffusers' "Speed up inference" guide;
``torch.bfloat16`` in the SD 3.5, FLUX.1 / FLUX.2 and ERNIE-Image cards (ERNIE-Image-Turbo SDNQ
uint4 model card's usage); float16 again in the Kolors card. On the CPU the reference is float32
(half precision there is an approximation for every family). The capabilities (negative prompt,
guidance, schedulers, size multiple) are infra's table, :data:`infra.pools.FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.pools import FAMILIES, OFFLINE_FAMILIES


@dataclass(frozen=True)
class Family:
    """One family. ``denoiser`` is the pipeline attribute that is denoised with (``unet`` or
    ``transformer``); ``dtype`` the card's dtype on accelerators; ``native`` the card's size in
    pixels (square); ``steps`` / ``guidance`` the card's defaults for the turbo/base variant."""

    name: str
    pipeline: str
    denoiser: str
    dtype: str
    native: int
    steps: int
    guidance: float
    fuse_qkv: bool = True  # diffusers' fuse_qkv_projections exists and its processor uses it
    regional_compile: bool = False  # compile the repeated blocks instead of the whole denoiser


FAMILY_SPECS: dict[str, Family] = {f.name: f for f in (
    Family("sd1", "StableDiffusionPipeline", "unet", "float16", 512, 25, 7.5),
    Family("sd2", "StableDiffusionPipeline", "unet", "float16", 768, 25, 7.5),
    Family("sdxl", "StableDiffusionXLPipeline", "unet", "float16", 1024, 30, 5.0),
    Family("sd3", "StableDiffusion3Pipeline", "transformer", "float16", 1024, 28, 7.0, regional_compile=True),
    Family("flux-schnell", "FluxPipeline", "transformer", "bfloat16", 1024, 4, 0.0, regional_compile=True),
    Family("flux-dev", "FluxPipeline", "transformer", "bfloat16", 1024, 28, 3.5, regional_compile=True),
    Family("flux2", "Flux2Pipeline", "transformer", "bfloat16", 1024, 28, 4.0, regional_compile=True),
    # ERNIE's attention processor reads to_q/to_k/to_v directly: fused projections would do nothing.
    Family("ernie-image", "ErnieImagePipeline", "transformer", "bfloat16", 1024, 8, 1.0, fuse_qkv=False,
           regional_compile=True),
    # Kwai-Kolors/Kolors-diffusers card: torch_dtype=torch.float16, 50 steps, guidance_scale 5.0.
    Family("kolors", "KolorsPipeline", "unet", "float16", 1024, 50, 5.0),
    # Video (infra.video). Wan-AI/Wan2.1-T2V-1.3B-Diffusers card: torch_dtype=torch.bfloat16 for the
    # transformer (the VAE in float32), 480p (832 x 480), guidance_scale 5.0, 50 steps (the pipeline's
    # default). Lightricks/LTX-Video card: torch.bfloat16, 704 x 480, 50 steps, guidance_scale 3.0.
    Family("wan", "WanPipeline", "transformer", "bfloat16", 480, 50, 5.0, regional_compile=True),
    Family("ltx", "LTXPipeline", "transformer", "bfloat16", 480, 50, 3.0, regional_compile=True),
    # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers card: torch_dtype=torch.bfloat16 (image encoder and VAE loaded in
    # float32), 480P, guidance_scale 5.0; 40 steps, the Wan 2.1 repository's generate.py default for i2v tasks.
    Family("wan-i2v", "WanImageToVideoPipeline", "transformer", "bfloat16", 480, 40, 5.0, regional_compile=True),
)}
assert set(FAMILY_SPECS) == set(FAMILIES), "FAMILY_SPECS out of sync with infra.pools.FAMILIES"

#: Hub ids whose card recommends another dtype than their family's (SD 3.5 cards: bfloat16).
MODEL_DTYPES = {
    "stabilityai/stable-diffusion-3.5-large": "bfloat16",
    "stabilityai/stable-diffusion-3.5-large-turbo": "bfloat16",
    "stabilityai/stable-diffusion-3.5-medium": "bfloat16",
}

# ---- tiny autoencoders ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyVae:
    """A tiny autoencoder for the VAEs whose config matches ``signature``: (class name, latent
    channels, scaling factor, shift factor). ``hub`` is madebyollin's checkpoint; ``offline`` the
    offline random-weight build with its AutoencoderTiny ``config`` (madebyollin's config.json)."""

    signature: tuple[str, int, float, float]
    hub: str
    offline: str
    config: dict


#: Chosen from the VAE's config (class, latent channels, scaling and shift factors), never from the
#: channel count alone: SD 1/2 and SDXL both have 4 channels, SD3 and FLUX.1 both 16.
TINY_VAES: tuple[TinyVae, ...] = (
    TinyVae(("AutoencoderKL", 4, 0.18215, 0.0), "madebyollin/taesd", "taesd-arch", {"latent_channels": 4}),
    TinyVae(("AutoencoderKL", 4, 0.13025, 0.0), "madebyollin/taesdxl", "taesdxl-arch", {"latent_channels": 4}),
    TinyVae(("AutoencoderKL", 16, 1.5305, 0.0609), "madebyollin/taesd3", "taesd3-arch", {"latent_channels": 16}),
    TinyVae(("AutoencoderKL", 16, 0.3611, 0.1159), "madebyollin/taef1", "taef1-arch", {"latent_channels": 16}),
)
OFFLINE_TINY_VAES: dict[str, dict] = {t.offline: t.config for t in TINY_VAES}


def vae_signature(vae) -> tuple[str, int, float, float]:
    """(class name, latent channels, scaling factor, shift factor) of a loaded VAE."""
    cfg = vae.config
    return (type(vae).__name__, int(cfg.get("latent_channels", 0)), round(float(cfg.get("scaling_factor") or 0), 5),
            round(float(cfg.get("shift_factor") or 0.0), 5))


def tiny_vae_for(vae) -> TinyVae | None:
    """The tiny autoencoder matching ``vae``'s config, or None (FLUX.2 / ERNIE-Image VAEs have none)."""
    sig = vae_signature(vae)
    return next((t for t in TINY_VAES if t.signature == sig), None)


# ---- families of loaded pipelines -------------------------------------------------------------


def family_of_name(model: str) -> str | None:
    """The family an offline model name implies (None for hub ids and paths)."""
    return OFFLINE_FAMILIES.get(model)


def detect_family(pipe) -> str | None:
    """The family of a loaded diffusers pipeline, from its class and component configs; None when
    the pipeline is of no known family."""
    name = type(pipe).__name__
    if name == "StableDiffusionPipeline":
        return "sd1" if pipe.unet.config.cross_attention_dim == 768 or _narrow_text(pipe) else "sd2"
    if name == "FluxPipeline":
        return "flux-dev" if pipe.transformer.config.guidance_embeds else "flux-schnell"
    return next((f.name for f in FAMILY_SPECS.values() if f.pipeline == name and f.name != "sd1"), None)


def _narrow_text(pipe) -> bool:  # the tiny SD 1 test model: a narrow CLIP text tower, not OpenCLIP-H
    return pipe.text_encoder.config.hidden_size < 768


def denoiser_of(pipe):
    """The pipeline's denoiser module (``transformer`` or ``unet``) and its attribute name."""
    for name in ("transformer", "unet"):
        module = getattr(pipe, name, None)
        if module is not None:
            return name, module
    raise ValueError(f"{type(pipe).__name__} has neither a transformer nor a unet")


def reference_dtype(family: str | None, device_kind: str, model: str = "") -> str:
    """The dtype a model is exact in on ``device_kind``: float32 on the CPU, else its card's dtype
    (:data:`MODEL_DTYPES`, then the family's; float16 for a pipeline of no known family)."""
    if device_kind == "cpu":
        return "float32"
    if model in MODEL_DTYPES:
        return MODEL_DTYPES[model]
    return FAMILY_SPECS[family].dtype if family in FAMILY_SPECS else "float16"
