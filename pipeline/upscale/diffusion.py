"""Diffusion upscalers: diffusers' SD ×4 upscaler and SD ×2 latent upscaler, as upscaling-stage networks.

Place in the data flow: the upscaling stage (:mod:`pipeline.upscale.stage`) loads one of these when a
request's ``upscaler`` names it, and runs it on the group's decoded images with the requests'
prompts, negative prompts and seeds.

Two pipelines of diffusers:

- ``StableDiffusionUpscalePipeline`` (``stabilityai/stable-diffusion-x4-upscaler``): a UNet whose
  input is the 4 noisy latent channels plus the 3 channels of the (noised) low-resolution image,
  7 in all, at the low-resolution size; the image's noise level (``noise_level``, from the
  ``low_res_scheduler``, a DDPM schedule) is its class label; a VAE that upsamples ×4 decodes the
  result. It takes images, so it runs on tiles with overlap (:func:`pipeline.upscale.tiles.upscale_tiled`):
  diffusers' pipeline has no tiling of its own, and the tile bounds the UNet's and the VAE's
  memory. Seams between tiles are not blended: each tile sees ``pad`` pixels of context and keeps
  its own region, so a seam can show where neighbouring tiles' noise disagrees.
- ``StableDiffusionLatentUpscalePipeline`` (``stabilityai/sd-x2-latent-upscaler``, Katherine
  Crowson's k-diffusion latent upscaler): a K-UNet that denoises ×2 latents (EulerDiscrete,
  Karras et al. 2022 preconditioning) conditioned on the nearest-upsampled input latents and the
  prompt's pooled CLIP embedding; the SD VAE encodes the input and decodes the result. It is meant
  to take the base pipeline's latents; here it takes the decoded images (the stage runs after the
  base pipeline's decode, and keeping the latents would cross the renderer's output, which is
  images), so each image is encoded by the VAE once more. It runs on the whole image, untiled.

Upscaler specs (:func:`load_diffusion_upscaler`): an offline name of :data:`OFFLINE_DIFFUSION_UPSCALERS`
(random weights: ``tiny-sd-x4-upscaler`` and ``tiny-sd-x2-latent-upscaler`` for tests,
``sd-x4-upscaler-arch`` the real ×4 architecture for benchmarks), the aliases ``sd-x4-upscaler``
and ``sd-x2-latent-upscaler`` (the hub ids), a hub id, or a local directory with a
``model_index.json`` of one of the two pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from pipeline.models import configs as c
from pipeline.models.offline import OfflineModel
from pipeline.upscale.tiles import upscale_tiled

X4_PIPELINE = "StableDiffusionUpscalePipeline"
LATENT_PIPELINE = "StableDiffusionLatentUpscalePipeline"
#: Output pixels per input pixel, per side, of each pipeline.
PIPELINE_SCALES = {X4_PIPELINE: 4, LATENT_PIPELINE: 2}
#: Short names of the published checkpoints.
ALIASES = {"sd-x4-upscaler": "stabilityai/stable-diffusion-x4-upscaler",
           "sd-x2-latent-upscaler": "stabilityai/sd-x2-latent-upscaler"}

#: stabilityai/stable-diffusion-x4-upscaler: scheduler (DDIM, v-prediction) and low_res_scheduler (DDPM).
X4_SCHEDULER = {**c.SD_BETAS, "prediction_type": "v_prediction", "clip_sample": False, "set_alpha_to_one": False,
                "steps_offset": 1}
X4_LOW_RES_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02,
                        "beta_schedule": "linear", "clip_sample": False}
#: Its UNet (473 M parameters): 7 input channels, the noise level as one of 1000 class labels.
X4_UNET = {"sample_size": 128, "in_channels": 7, "out_channels": 4, "layers_per_block": 2,
           "block_out_channels": [256, 512, 512, 1024],
           "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
           "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
           "cross_attention_dim": 1024, "attention_head_dim": 8, "use_linear_projection": True,
           "only_cross_attention": [True, True, True, False], "num_class_embeds": 1000, "norm_num_groups": 32}
#: Its VAE: three stages (×4), scaling factor 0.08333.
X4_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 256,
          "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
          "block_out_channels": [128, 256, 512], "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu",
          "scaling_factor": 0.08333}
TINY_X4_UNET = {**X4_UNET, "sample_size": 32, "layers_per_block": 1, "block_out_channels": [32, 32, 64],
                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                "cross_attention_dim": 32, "only_cross_attention": [True, True, False], "num_class_embeds": 1000,
                "norm_num_groups": 8}
TINY_X4_VAE = {**X4_VAE, "block_out_channels": [8, 8, 16], "layers_per_block": 1, "norm_num_groups": 4}
#: The latent upscaler's K-UNet at test widths (diffusers' own test shapes: Fourier time embedding,
#: scale-shift ResNets, 1×1 in/out convolutions, 4 + 4 input channels, a fifth unused output channel;
#: the timestep condition is 64 + 64 noise-level features and the pooled text embedding).
TINY_LATENT_UNET = {"in_channels": 8, "out_channels": 5, "block_out_channels": [32, 32, 64, 64],
                    "layers_per_block": 1, "down_block_types": ["KDownBlock2D"] + ["KCrossAttnDownBlock2D"] * 3,
                    "up_block_types": ["KCrossAttnUpBlock2D"] * 3 + ["KUpBlock2D"], "mid_block_type": None,
                    "act_fn": "gelu", "attention_head_dim": 8, "norm_num_groups": None, "cross_attention_dim": 32,
                    "time_cond_proj_dim": 128 + 32, "conv_in_kernel": 1, "conv_out_kernel": 1,
                    "only_cross_attention": False, "resnet_time_scale_shift": "scale_shift",
                    "time_embedding_type": "fourier", "timestep_post_act": "gelu"}
#: stabilityai/sd-x2-latent-upscaler scheduler: EulerDiscrete predicting the sample (k-diffusion's denoiser).
LATENT_SCHEDULER = {**c.SD_BETAS, "prediction_type": "sample", "steps_offset": 1}


def _x4(name: str, description: str, unet: dict, text: dict, vae: dict) -> OfflineModel:
    return OfflineModel(name, description, X4_PIPELINE, {
        "unet": ("diffusers", "UNet2DConditionModel", unet), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "CLIPTextModel", text), "tokenizer": ("tokenizer", "clip", {"pad_token": "!"}),
        "low_res_scheduler": ("scheduler", "DDPMScheduler", X4_LOW_RES_SCHEDULER),
        "scheduler": ("scheduler", "DDIMScheduler", X4_SCHEDULER)}, {"max_noise_level": 350})


#: Offline diffusion upscalers (random weights, seeded): name → components, as the offline models.
OFFLINE_DIFFUSION_UPSCALERS: dict[str, OfflineModel] = {m.name: m for m in (
    _x4("tiny-sd-x4-upscaler", "StableDiffusionUpscalePipeline's classes at test widths.", TINY_X4_UNET,
        c.tiny_clip(32), TINY_X4_VAE),
    _x4("sd-x4-upscaler-arch", "stabilityai/stable-diffusion-x4-upscaler architecture (UNet 473M, ×4 VAE, OpenCLIP "
        "ViT-H text), random weights.", X4_UNET, c.OPENCLIP_H, X4_VAE),
    OfflineModel("tiny-sd-x2-latent-upscaler", "StableDiffusionLatentUpscalePipeline's classes at test widths.",
                 LATENT_PIPELINE, {
                     "unet": ("diffusers", "UNet2DConditionModel", TINY_LATENT_UNET),
                     "vae": ("diffusers", "AutoencoderKL", {**c.SD_VAE, **c.TINY_VAE_BLOCKS}),
                     "text_encoder": ("transformers", "CLIPTextModel", c.tiny_clip(32)),
                     "tokenizer": ("tokenizer", "clip", {}),
                     "scheduler": ("scheduler", "EulerDiscreteScheduler", LATENT_SCHEDULER)}),
)}


def is_diffusion_upscaler(spec: str) -> bool:
    """Whether ``spec`` names a diffusion upscaler rather than an RRDBNet weight file: an offline
    diffusion name or alias, a hub id ``owner/name``, or a local directory."""
    if spec in OFFLINE_DIFFUSION_UPSCALERS or spec in ALIASES:
        return True
    if spec.endswith((".pth", ".pt", ".safetensors")):
        return False
    return Path(spec).expanduser().is_dir() or spec.count("/") == 1


@dataclass(frozen=True)
class DiffusionSettings:
    """How the stage runs a diffusion upscaler: ``steps`` denoising steps, ``guidance_scale``
    (classifier-free guidance; diffusers' default for both pipelines is 9.0), the ×4 pipeline's
    ``noise_level`` (noise added to the low-resolution image, 0…``max_noise_level``; diffusers'
    default 20)."""

    steps: int = 20
    guidance_scale: float = 9.0
    noise_level: int = 20


class DiffusionUpscaler(torch.nn.Module):
    """One loaded upscale pipeline, called on batches of images with their prompts.

    ``pipe``: a ``StableDiffusionUpscalePipeline`` or ``StableDiffusionLatentUpscalePipeline``
    on the stage's device. Not a trained module of its own: it subclasses ``torch.nn.Module`` only
    so that the stage keeps it beside its RRDBNets.

    Raises:
        ValueError: ``pipe`` is neither pipeline.
    """

    def __init__(self, pipe) -> None:
        super().__init__()
        name = type(pipe).__name__
        if name not in PIPELINE_SCALES:
            raise ValueError(f"{name} is not an upscale pipeline ({', '.join(PIPELINE_SCALES)})")
        self.pipe = pipe
        self.kind = name
        self.scale = PIPELINE_SCALES[name]
        unet_factor = 2 ** (len(pipe.unet.config.block_out_channels) - 1)
        vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        # input pixels per UNet cell: the ×4 UNet runs at the input size; the latent one at ×2 latents
        self.multiple = unet_factor if name == X4_PIPELINE else max(1, vae_factor * unet_factor // 2)

    def upscale(self, images: torch.Tensor, prompts: Sequence[str], negative_prompts: Sequence[str | None],
                generators: Sequence[torch.Generator], settings: DiffusionSettings, *, tile: int = 0,
                pad: int = 16) -> torch.Tensor:
        """``(N, 3, H, W)`` images in 0…1 → ``(N, 3, H·scale, W·scale)`` float32 in 0…1.

        Sides that are not a multiple of :attr:`multiple` (the input pixels per cell of the UNet's
        coarsest level) are edge-replicated up to one, and the padding cropped off the result.

        One prompt, negative prompt (None: none) and generator per image. The ×4 pipeline runs
        on ``tile``-pixel input tiles with ``pad`` pixels of context (0: untiled); the latent one
        always untiled. Tiles draw their noise from the images' generators in a fixed order, so
        the result depends only on the seeds.

        Raises:
            ValueError: lengths differ from ``N``.
        """
        n = images.shape[0]
        if not len(prompts) == len(negative_prompts) == len(generators) == n:
            raise ValueError(f"{n} images need as many prompts, negative prompts and generators")
        negatives = [neg or "" for neg in negative_prompts]

        def run(x: torch.Tensor) -> torch.Tensor:
            kwargs = {"noise_level": settings.noise_level} if self.kind == X4_PIPELINE else {}
            height, width = x.shape[-2:]
            pad_h, pad_w = -height % self.multiple, -width % self.multiple
            if pad_h or pad_w:  # edge-replicated to the UNet's multiple, cropped off the result
                x = F.pad(x, (0, pad_w, 0, pad_h), mode="replicate")
            out = self.pipe(prompt=list(prompts), negative_prompt=negatives, image=x,
                            num_inference_steps=settings.steps, guidance_scale=settings.guidance_scale,
                            generator=list(generators), output_type="pt", **kwargs).images
            return out[:, :, :height * self.scale, :width * self.scale].to(x.dtype)

        param = next(self.pipe.unet.parameters())
        x = images.to(device=param.device, dtype=param.dtype)
        with torch.inference_mode():
            out = upscale_tiled(run, x, scale=self.scale, tile=tile if self.kind == X4_PIPELINE else 0, pad=pad)
        return out.float()


def load_diffusion_upscaler(spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                            cache_dir: Path | None = None) -> DiffusionUpscaler:
    """The :class:`DiffusionUpscaler` of ``spec`` (see the module docstring) on ``device`` in ``dtype``.

    Raises:
        ValueError: the checkpoint is not one of the two upscale pipelines.
        OSError: a hub id that cannot be downloaded (offline) or a directory without a pipeline.
    """
    import diffusers

    if spec in OFFLINE_DIFFUSION_UPSCALERS:
        from pipeline.models.build import construct_pipeline

        pipe = construct_pipeline(OFFLINE_DIFFUSION_UPSCALERS[spec], device=device, dtype=dtype)
    else:
        source = ALIASES.get(spec, spec)
        name = diffusers.DiffusionPipeline.load_config(source, cache_dir=cache_dir).get("_class_name")
        if name not in PIPELINE_SCALES:
            raise ValueError(f"upscaler {spec!r} is a {name}, not an upscale pipeline ({', '.join(PIPELINE_SCALES)})")
        pipe = getattr(diffusers, name).from_pretrained(source, torch_dtype=dtype, cache_dir=cache_dir).to(device)
    pipe.set_progress_bar_config(disable=True)
    return DiffusionUpscaler(pipe)
