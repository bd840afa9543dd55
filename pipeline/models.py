"""Model specs → warm diffusers pipelines: hub ids, local paths, and offline random-init builds.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. A worker calls
:func:`load_pipeline` once at start with the model name of its pool and keeps the result resident.

Offline models need no network: :data:`OFFLINE_MODELS` holds, as plain config data, the exact
architectures of public checkpoints (random weights from a fixed seed, so a build is reproducible)
plus a ``tiny`` model for tests. :func:`build_offline_model` saves one once, with
``save_pretrained`` (safetensors), under ``<cache_dir>/models/<name>/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoPipelineForText2Image,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel

from pipeline.tokenizer import load_clip_tokenizer, write_clip_tokenizer

log = logging.getLogger(__name__)

#: Bump when a build's on-disk layout changes; part of every build's fingerprint.
BUILD_FORMAT = 1
WEIGHT_SEED = 0

# ---- shared config fragments (the public SD 1.x / 2.x configs, written out as data) ----

SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}
SD_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 512,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu",
}
SD1_UNET = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280],
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32, "act_fn": "silu",
    "flip_sin_to_cos": True, "freq_shift": 0, "downsample_padding": 1, "mid_block_scale_factor": 1,
}
CLIP_VIT_L14_TEXT = {  # openai/clip-vit-large-patch14 text tower, as SD 1.x ships it
    "vocab_size": 49408, "max_position_embeddings": 77, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "projection_dim": 768, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}


@dataclass(frozen=True)
class OfflineModel:
    """One offline architecture: component configs as data, built with random weights.

    ``scheduler_cls``/``scheduler`` is the scheduler the public model ships; ``pad_token`` is its
    tokenizer's padding token (SD 2.x pads with ``!``).
    """

    description: str
    unet: dict
    vae: dict
    text_encoder: dict
    scheduler_cls: type
    scheduler: dict
    pad_token: str = "<|endoftext|>"
    notes: str = field(default="", compare=False)

    def fingerprint(self) -> str:
        """A short hash of everything that determines the built weights."""
        blob = json.dumps(
            [BUILD_FORMAT, WEIGHT_SEED, torch.__version__, self.unet, self.vae, self.text_encoder,
             self.scheduler_cls.__name__, self.scheduler, self.pad_token], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def build(self, directory: Path) -> None:
        """Instantiate every component (weights from seed :data:`WEIGHT_SEED`) and save to ``directory``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(WEIGHT_SEED)
            unet = UNet2DConditionModel(**self.unet)
            vae = AutoencoderKL(**self.vae)
            text_encoder = CLIPTextModel(CLIPTextConfig(**self.text_encoder))
        write_clip_tokenizer(directory / "tokenizer", pad_token=self.pad_token)
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=load_clip_tokenizer(directory / "tokenizer"),
            unet=unet, scheduler=self.scheduler_cls(**self.scheduler),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        pipe.save_pretrained(directory, safe_serialization=True)
        write_clip_tokenizer(directory / "tokenizer", pad_token=self.pad_token)  # add vocab.json/merges.txt


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "tiny": OfflineModel(
        description="A very small SD-style model for tests: renders 512x512 in well under a second on CPU.",
        unet={
            "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
            "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32,
            "attention_head_dim": 8, "norm_num_groups": 32,
        },
        vae={
            "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 512,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
        },
        text_encoder={
            "vocab_size": 49408, "max_position_embeddings": 77, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "projection_dim": 32, "hidden_act": "gelu",
        },
        scheduler_cls=DDIMScheduler,
        scheduler={**SD_BETAS, "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1,
                   "timestep_spacing": "trailing"},
    ),
    "sd15-arch": OfflineModel(
        description="Stable Diffusion 1.5 architecture (UNet 860M, VAE, CLIP ViT-L/14 text), random weights.",
        unet=SD1_UNET,
        vae=SD_VAE,
        text_encoder=CLIP_VIT_L14_TEXT,
        scheduler_cls=PNDMScheduler,
        scheduler={**SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1},
    ),
    "sd-turbo-arch": OfflineModel(
        description="stabilityai/sd-turbo architecture (SD 2.1 UNet, OpenCLIP ViT-H text), random weights.",
        unet={**SD1_UNET, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
              "use_linear_projection": True},
        vae=SD_VAE,
        text_encoder={**CLIP_VIT_L14_TEXT, "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 23, "num_attention_heads": 16, "projection_dim": 512,
                      "hidden_act": "gelu"},
        scheduler_cls=EulerDiscreteScheduler,
        scheduler={**SD_BETAS, "prediction_type": "epsilon", "interpolation_type": "linear",
                   "use_karras_sigmas": False, "steps_offset": 1, "timestep_spacing": "trailing"},
        pad_token="!",
        notes="OpenCLIP ViT-H has 24 text layers; SD 2.x ships 23 (it uses the penultimate layer).",
    ),
    "bk-sdm-tiny-arch": OfflineModel(
        description="nota-ai/bk-sdm-tiny architecture (SD 1.x UNet without mid block and innermost stage, "
        "one block per stage; 0.33B UNet), SD 1.x VAE and text encoder, random weights.",
        unet={**SD1_UNET, "layers_per_block": 1, "block_out_channels": [320, 640, 1280],
              "down_block_types": ["CrossAttnDownBlock2D"] * 3, "up_block_types": ["CrossAttnUpBlock2D"] * 3,
              "mid_block_type": None},
        vae=SD_VAE,
        text_encoder=CLIP_VIT_L14_TEXT,
        scheduler_cls=PNDMScheduler,
        scheduler={**SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1},
        notes="UNet config follows the BK-SDM authors' published unet_config/bk_tiny/config.json.",
    ),
}

_STAMP = "renderfarm_build.json"


def build_offline_model(name: str, cache_dir: Path) -> Path:
    """Build offline model ``name`` once and return its directory, ``<cache_dir>/models/<name>/``.

    The build goes into a temporary sibling directory that is renamed into place, under an
    exclusive file lock, so concurrent processes neither corrupt nor duplicate it. A cached build
    whose fingerprint (configs, seed, torch version) no longer matches is rebuilt.
    Size on disk (float32): ``tiny`` 16 MB, ``bk-sdm-tiny-arch`` 2.0 GB, ``sd15-arch`` 4.0 GB,
    ``sd-turbo-arch`` 4.9 GB; building ``sd15-arch`` takes ~20 s and ~5 GB of RAM on 2 cores.

    Raises:
        ValueError: ``name`` is not in :data:`OFFLINE_MODELS`.
    """
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; known: {', '.join(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[name]
    models_dir = Path(cache_dir).expanduser() / "models"
    final = models_dir / name
    if _stamp_matches(final, spec):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then re-check
        if _stamp_matches(final, spec):
            return final
        log.warning("building offline model %r (%s) into %s", name, spec.fingerprint(), final)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=models_dir))
        try:
            spec.build(tmp)
            (tmp / _STAMP).write_text(json.dumps({"name": name, "fingerprint": spec.fingerprint()}))
            if final.exists():  # stale build: move it aside, then swap the new one in
                os.rename(final, models_dir / f".{name}.stale-{os.getpid()}")
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for stale in models_dir.glob(f".{name}.stale-*"):
                shutil.rmtree(stale, ignore_errors=True)
        log.warning("built offline model %r in %.1f s", name, time.perf_counter() - started)
    return final


def _stamp_matches(directory: Path, spec: OfflineModel) -> bool:
    try:
        return json.loads((directory / _STAMP).read_text())["fingerprint"] == spec.fingerprint()
    except (OSError, ValueError, KeyError):
        return False


def load_pipeline(
    spec: str, *, device: str = "cpu", torch_dtype: torch.dtype = torch.float32, cache_dir: Path | None = None
) -> DiffusionPipeline:
    """Load a text-to-image pipeline for ``spec``, on ``device``, progress bars off.

    ``spec`` is an offline name (:data:`OFFLINE_MODELS`, built on first use into ``cache_dir``,
    default ``Settings.cache_dir``), a local directory in diffusers layout, or a Hugging Face hub
    id (e.g. ``stabilityai/sd-turbo``) loaded with ``AutoPipelineForText2Image``. Offline models
    have no safety checker; hub models keep whatever they ship.

    Raises:
        FileNotFoundError: ``spec`` looks like a local path (absolute, ``./``, ``~``) that does not exist.
        ValueError: ``spec`` could not be loaded (unknown hub id, no network, not a pipeline);
            the message names ``spec`` and the cause.
    """
    if spec in OFFLINE_MODELS:
        if cache_dir is None:
            from infra.settings import get_settings

            cache_dir = get_settings().cache_dir
        path = build_offline_model(spec, cache_dir)
        pipe = StableDiffusionPipeline.from_pretrained(
            path, dtype=torch_dtype, safety_checker=None, requires_safety_checker=False, local_files_only=True
        )
    else:
        local = Path(spec).expanduser()
        if spec.startswith(("/", "./", "../", "~")) and not local.exists():
            raise FileNotFoundError(f"model path {spec!r} does not exist")
        try:
            pipe = AutoPipelineForText2Image.from_pretrained(str(local) if local.exists() else spec,
                                                             dtype=torch_dtype)
        except Exception as exc:  # diffusers/hub raise many types (OSError, HTTPError, ValueError...)
            raise ValueError(f"cannot load model {spec!r} (offline names: {', '.join(OFFLINE_MODELS)}): "
                             f"{type(exc).__name__}: {exc}") from exc
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
