"""Offline models: real architectures (or small ones with the real classes) as data, random weights.

Place in the data flow: :func:`pipeline.models.load.load_pipeline` builds one on first use
(:mod:`pipeline.models.build`) when a worker pins an offline name; benchmarks and tests use them
because no weights can be downloaded here.

Per family there is a full-size ``*-arch`` build for benchmarks and a small ``tiny-*`` build for
tests. Full-size FLUX / SD3 / ERNIE builds are tens of GB: they are constructed directly on the
target device in the target dtype (:func:`pipeline.models.build.construct_pipeline`) and written
to disk only when asked (``disk=False`` here). Their configs are checked on this machine only by
counting parameters on the ``meta`` device against :attr:`OfflineModel.published_params`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from infra.pools import OFFLINE_FAMILIES
from pipeline.models import configs as c

#: Bump when a build's on-disk layout changes; part of every build's fingerprint.
BUILD_FORMAT = 2
WEIGHT_SEED = 0


@dataclass(frozen=True)
class OfflineModel:
    """One offline model: its diffusers pipeline class and its components as data.

    ``components`` maps a pipeline argument to ``(kind, class name, config)``: kind ``diffusers``
    (a model class, built with ``cls(**config)``), ``transformers`` (built from its config class),
    ``scheduler``, ``tokenizer`` (config as :func:`pipeline.models.tokenizers.write_tokenizer`
    takes it) or ``processor`` (a transformers image processor, ``cls(**config)``).
    ``pipeline_kwargs`` are passed as they are (``safety_checker=None``, …).
    ``published_params`` gives, per component, the parameter count of the public checkpoint, for
    the meta-device check; ``disk`` says whether :func:`load_pipeline` builds it into the cache.
    """

    name: str
    description: str
    pipeline: str
    components: dict[str, tuple[str, str, dict]]
    pipeline_kwargs: dict = field(default_factory=dict)
    published_params: dict[str, float] = field(default_factory=dict, compare=False)
    disk: bool = True
    notes: str = field(default="", compare=False)

    @property
    def family(self) -> str:
        """The model family (``infra.pools.OFFLINE_FAMILIES``: the one table infra routes by)."""
        return OFFLINE_FAMILIES[self.name]

    def fingerprint(self) -> str:
        """A short hash of everything that determines the built weights."""
        blob = json.dumps([BUILD_FORMAT, WEIGHT_SEED, torch.__version__, self.pipeline, self.components,
                           self.pipeline_kwargs], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _sd(name, description, unet, text, scheduler_cls, scheduler, pad="<|endoftext|>", vae=c.SD_VAE, **kw):
    return OfflineModel(name, description, "StableDiffusionPipeline", {
        "unet": ("diffusers", "UNet2DConditionModel", unet), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "CLIPTextModel", text), "tokenizer": ("tokenizer", "clip", {"pad_token": pad}),
        "scheduler": ("scheduler", scheduler_cls, scheduler)},
        {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}, **kw)


def _taiyi(name, description, unet, text, max_length, vae=c.SD_VAE, **kw):
    """SD 1.x with a Chinese BERT text encoder: the Taiyi-Stable-Diffusion-1B-Chinese layout (a
    StableDiffusionPipeline whose text_encoder is a BertModel and tokenizer a BertTokenizer)."""
    return OfflineModel(name, description, "StableDiffusionPipeline", {
        "unet": ("diffusers", "UNet2DConditionModel", unet), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "BertModel", text),
        "tokenizer": ("tokenizer", "bert", {"vocab_size": text["vocab_size"], "model_max_length": max_length}),
        "scheduler": ("scheduler", "PNDMScheduler", c.PNDM_SD15)},
        {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}, **kw)


def _kolors(name, description, unet, text, vae, **kw):
    """Kolors (Kwai-Kolors/Kolors-diffusers): an SDXL-style UNet whose ``text_proj`` takes ChatGLM3's
    hidden states, diffusers' ``KolorsPipeline`` with its ``ChatGLMModel`` and ``ChatGLMTokenizer``."""
    return OfflineModel(name, description, "KolorsPipeline", {
        "unet": ("diffusers", "UNet2DConditionModel", unet), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("kolors", "ChatGLMModel", text),
        "tokenizer": ("tokenizer", "chatglm", {"vocab_size": CHATGLM_TINY_VOCAB}),
        "scheduler": ("scheduler", "EulerDiscreteScheduler", c.EULER_SDXL)},
        {"force_zeros_for_empty_prompt": False}, **kw)


def _sdxl(name, description, unet, text, text_2, vae, **kw):
    return OfflineModel(name, description, "StableDiffusionXLPipeline", {
        "unet": ("diffusers", "UNet2DConditionModel", unet), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "CLIPTextModel", text),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", text_2),
        "tokenizer": ("tokenizer", "clip", {}), "tokenizer_2": ("tokenizer", "clip", {"pad_token": "!"}),
        "scheduler": ("scheduler", "EulerDiscreteScheduler", c.EULER_SDXL)},
        {"force_zeros_for_empty_prompt": True}, **kw)


def _sd3(name, description, transformer, clip_l, clip_g, t5, vae, **kw):
    return OfflineModel(name, description, "StableDiffusion3Pipeline", {
        "transformer": ("diffusers", "SD3Transformer2DModel", transformer), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "CLIPTextModelWithProjection", clip_l),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", clip_g),
        "text_encoder_3": ("transformers", "T5EncoderModel", t5),
        "tokenizer": ("tokenizer", "clip", {}), "tokenizer_2": ("tokenizer", "clip", {"pad_token": "!"}),
        "tokenizer_3": ("tokenizer", "t5", {"vocab_size": t5["vocab_size"]}),
        "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler", c.FLOW_SD3)}, **kw)


def _flux(name, description, transformer, clip_l, t5, vae, **kw):
    return OfflineModel(name, description, "FluxPipeline", {
        "transformer": ("diffusers", "FluxTransformer2DModel", transformer), "vae": ("diffusers", "AutoencoderKL", vae),
        "text_encoder": ("transformers", "CLIPTextModel", clip_l),
        "text_encoder_2": ("transformers", "T5EncoderModel", t5),
        "tokenizer": ("tokenizer", "clip", {}), "tokenizer_2": ("tokenizer", "t5", {"vocab_size": t5["vocab_size"]}),
        "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler", c.FLOW_FLUX_SCHNELL)}, **kw)


def _ernie(name, description, transformer, text, vae, **kw):
    return OfflineModel(name, description, "ErnieImagePipeline", {
        "transformer": ("diffusers", "ErnieImageTransformer2DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLFlux2", vae),
        "text_encoder": ("transformers", "Mistral3Model", text),
        "tokenizer": ("tokenizer", "mistral", {"vocab_size": text["text_config"]["vocab_size"]}),
        "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler", c.FLOW_ERNIE)},
        {"pe": None, "pe_tokenizer": None}, **kw)


def _wan(name, description, transformer, text, vae, **kw):
    """Wan 2.1 text-to-video: WanPipeline with a UMT5 text encoder and its T5-style tokenizer."""
    return OfflineModel(name, description, "WanPipeline", {
        "transformer": ("diffusers", "WanTransformer3DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLWan", vae),
        "text_encoder": ("transformers", "UMT5EncoderModel", text),
        "tokenizer": ("tokenizer", "t5", {"vocab_size": text["vocab_size"]}),
        "scheduler": ("scheduler", "UniPCMultistepScheduler", c.UNIPC_WAN)}, **kw)


def _wan_i2v(name, description, transformer, text, image, processor, vae, **kw):
    """Wan 2.1 image-to-video: WanImageToVideoPipeline, tiny-wan's UMT5 / VAE / scheduler classes plus
    a CLIPVisionModel image encoder and its CLIPImageProcessor (one transformer, no ``boundary_ratio``)."""
    return OfflineModel(name, description, "WanImageToVideoPipeline", {
        "transformer": ("diffusers", "WanTransformer3DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLWan", vae),
        "text_encoder": ("transformers", "UMT5EncoderModel", text),
        "tokenizer": ("tokenizer", "t5", {"vocab_size": text["vocab_size"]}),
        "image_encoder": ("transformers", "CLIPVisionModel", image),
        "image_processor": ("processor", "CLIPImageProcessor", processor),
        "scheduler": ("scheduler", "UniPCMultistepScheduler", c.UNIPC_WAN)}, **kw)


def _ltx(name, description, transformer, text, vae, **kw):
    """LTX-Video: LTXPipeline with a T5 v1.1 encoder (image-to-video: LTXImageToVideoPipeline.from_pipe)."""
    return OfflineModel(name, description, "LTXPipeline", {
        "transformer": ("diffusers", "LTXVideoTransformer3DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLLTXVideo", vae), "text_encoder": ("transformers", "T5EncoderModel", text),
        "tokenizer": ("tokenizer", "t5", {"vocab_size": text["vocab_size"]}),
        "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler", c.FLOW_LTX)}, **kw)


_TINY_VAE = {**c.SD_VAE, **c.TINY_VAE_BLOCKS}
CHATGLM_TINY_VOCAB = 21000  # SentencePiece pieces of the offline ChatGLM tokenizer (pipeline.models.tokenizers)
OFFLINE_MODELS: dict[str, OfflineModel] = {m.name: m for m in (
    _sd("tiny", "A very small SD-style model for tests: renders 512x512 in well under a second on CPU.",
        {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 1, "block_out_channels": [32, 64],
         "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
         "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32, "attention_head_dim": 8,
         "norm_num_groups": 32},
        {**c.tiny_clip(32), "hidden_act": "gelu"}, "DDIMScheduler", c.DDIM_TINY, vae=_TINY_VAE),
    _sd("sd15-arch", "Stable Diffusion 1.5 architecture (UNet 860M, VAE, CLIP ViT-L/14 text), random weights.",
        c.SD1_UNET, c.CLIP_L, "PNDMScheduler", c.PNDM_SD15, published_params={"unet": 859.52e6}),
    _sd("sd-turbo-arch", "stabilityai/sd-turbo architecture (SD 2.1 UNet, OpenCLIP ViT-H text), random weights.",
        c.SD2_UNET, c.OPENCLIP_H, "EulerDiscreteScheduler", c.EULER_TURBO, pad="!",
        notes="OpenCLIP ViT-H has 24 text layers; SD 2.x ships 23 (it uses the penultimate layer)."),
    _sd("bk-sdm-tiny-arch", "nota-ai/bk-sdm-tiny architecture (SD 1.x UNet without mid block and innermost stage, "
        "one block per stage; 0.33B UNet), SD 1.x VAE and text encoder, random weights.",
        {**c.SD1_UNET, "layers_per_block": 1, "block_out_channels": [320, 640, 1280],
         "down_block_types": ["CrossAttnDownBlock2D"] * 3, "up_block_types": ["CrossAttnUpBlock2D"] * 3,
         "mid_block_type": None}, c.CLIP_L, "PNDMScheduler", c.PNDM_SD15,
        notes="UNet config follows the BK-SDM authors' published unet_config/bk_tiny/config.json."),
    _taiyi("tiny-taiyi", "Taiyi-Stable-Diffusion-1B-Chinese's layout at test widths: the tiny SD UNet (32-wide "
           "cross-attention) with a 2-layer Chinese BertModel and BertTokenizer.",
           {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
            "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32,
            "attention_head_dim": 8, "norm_num_groups": 32}, c.tiny_bert(32), 77, vae=_TINY_VAE),
    _taiyi("taiyi-sd-arch", "IDEA-CCNL/Taiyi-Stable-Diffusion-1B-Chinese-v0.1 architecture (SD v1-4 UNet 860M and "
           "VAE, Taiyi-CLIP-RoBERTa-102M Chinese BertModel text encoder), random weights.", c.SD1_UNET, c.TAIYI_BERT,
           512, published_params={"unet": 859.52e6},
           notes="The tokenizer's model_max_length (512, BERT's positions) is assumed; a real checkpoint's "
                 "tokenizer_config decides when it is loaded."),
    _kolors("tiny-kolors", "Kolors' classes at test widths: an SDXL-style UNet with text_proj from ChatGLM hidden "
            "states, a 2-layer ChatGLMModel (multi-query attention, rotary embeddings) and ChatGLMTokenizer, the "
            "SDXL VAE scaling.", c.TINY_KOLORS_UNET, c.tiny_chatglm(32, CHATGLM_TINY_VOCAB),
            {**c.SDXL_VAE, **c.TINY_VAE_BLOCKS}),
    _kolors("kolors-arch", "Kwai-Kolors/Kolors-diffusers architecture (SDXL-style UNet 2.58B with text_proj, "
            "ChatGLM3-6B text encoder 6.24B, SDXL VAE), random weights; the offline tokenizer has 21,000 pieces.",
            c.KOLORS_UNET,
            c.CHATGLM3_6B, c.SDXL_VAE, disk=False,
            published_params={"unet": 2.58e9, "text_encoder": 6.244e9},
            notes="Too large to build on a small CPU host (about 35 GB in float32): constructed on the GPU only."),
    _sdxl("tiny-sdxl", "SDXL's classes at test widths: text_time UNet, CLIP-L + bigG-style text towers, SDXL VAE "
          "scaling factor.", c.TINY_SDXL_UNET, c.tiny_clip(32), c.tiny_clip(32, 32),
          {**c.SDXL_VAE, **c.TINY_VAE_BLOCKS}),
    _sdxl("sdxl-arch", "stabilityai/stable-diffusion-xl-base-1.0 architecture (UNet 2.6B, CLIP-L + OpenCLIP bigG, "
          "VAE), random weights; SDXL-Turbo has the same architecture.", c.SDXL_UNET, c.CLIP_L, c.OPENCLIP_BIGG,
          c.SDXL_VAE, published_params={"unet": 2.567e9, "text_encoder": 123.06e6, "text_encoder_2": 694.66e6}),
    _sd3("tiny-sd3", "SD3's classes at test widths: MMDiT transformer, two CLIP towers with projection, a T5 "
         "encoder, the 16-channel SD3 VAE scaling.", c.TINY_SD3_TRANSFORMER, c.tiny_clip(32), c.tiny_clip(32),
         c.tiny_t5(64), {**c.SD3_VAE, **c.TINY_VAE_BLOCKS}),
    _sd3("sd3-arch", "stabilityai/stable-diffusion-3-medium architecture (MMDiT 2B, CLIP-L + bigG + T5-XXL, 16-channel "
         "VAE), random weights.", c.SD3_TRANSFORMER, c.CLIP_L, c.OPENCLIP_BIGG, c.T5_XXL, c.SD3_VAE, disk=False,
         published_params={"transformer": 2.028e9, "text_encoder_3": 4.762e9}),
    _flux("tiny-flux", "FLUX.1-schnell's classes at test widths: double and single-stream blocks, CLIP-L + T5 "
          "towers, the 16-channel FLUX VAE scaling.", c.TINY_FLUX_TRANSFORMER, c.tiny_clip(32), c.tiny_t5(32),
          {**c.FLUX_VAE, **c.TINY_VAE_BLOCKS}),
    _flux("flux-schnell-arch", "black-forest-labs/FLUX.1-schnell architecture (transformer 11.9B: 19 double + 38 "
          "single blocks, CLIP-L + T5-XXL, 16-channel VAE), random weights.", c.FLUX_TRANSFORMER, c.CLIP_L,
          c.T5_XXL, c.FLUX_VAE, disk=False, published_params={"transformer": 11.90e9, "text_encoder_2": 4.762e9}),
    _ernie("tiny-ernie-image", "ERNIE-Image's classes at test widths: shared-AdaLN DiT, Mistral3 text model, the "
           "Flux2 VAE (32 latent channels, batch-norm statistics).", c.TINY_ERNIE_TRANSFORMER, c.TINY_ERNIE_TEXT,
           c.TINY_VAE_BLOCKS),
    _ernie("ernie-image-turbo-arch", "baidu/ERNIE-Image-Turbo architecture as diffusers' defaults give it (DiT "
           "3072 wide, 24 layers; Flux2 VAE; text encoder width 2560, depth assumed), no prompt enhancer, random "
           "weights.", c.ERNIE_TRANSFORMER, c.ERNIE_TEXT, c.FLUX2_VAE, disk=False,
           notes="No published parameter count was available offline: the meta check compares the transformer with "
                 "its count from diffusers' defaults."),
    _wan("tiny-wan", "Wan 2.1's classes at test widths: a 2-layer WanTransformer3DModel (24 wide), the Wan VAE "
         "(causal 3D, 4x8x8 compression) at base width 3, a 2-layer UMT5 encoder; renders 9 frames of 64x64 in "
         "2 steps in about a second on the CPU.", c.TINY_WAN_TRANSFORMER, c.tiny_t5(32), c.TINY_WAN_VAE),
    _wan("wan2.1-t2v-1.3b-arch", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers architecture (transformer 1.3B: 30 layers of "
         "1536, FFN 8960; UMT5-XXL encoder; Wan VAE), random weights.", c.WAN_1_3B_TRANSFORMER, c.UMT5_XXL, c.WAN_VAE,
         disk=False, published_params={"text_encoder": 5.68e9},
         notes="The VAE is diffusers' AutoencoderKLWan defaults (assumed equal to the checkpoint's vae/config.json); "
               "the transformer's count (1.42B on meta) follows from the published dims, the card's 1.3B is a "
               "rounded name; the tokenizer is the offline word-level T5 stand-in with UMT5's vocabulary size."),
    _wan_i2v("tiny-wan-i2v", "Wan 2.1 I2V's classes at test widths: tiny-wan's transformer with 36 input channels "
             "and a 32-wide image cross-attention, tiny-wan's VAE and UMT5, a 2-layer CLIPVisionModel (32 px, "
             "patch 8) and its CLIPImageProcessor; renders 9 frames of 64x64 from an image in about a second.",
             c.TINY_WAN_I2V_TRANSFORMER, c.tiny_t5(32), c.TINY_CLIP_VISION, c.TINY_CLIP_IMAGE_PROCESSOR,
             c.TINY_WAN_VAE),
    _wan_i2v("wan2.1-i2v-14b-arch", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers architecture (transformer 40 layers of "
             "5120, FFN 13824, 36 input channels, CLIP image cross-attention; UMT5-XXL encoder; CLIP ViT-H/14 "
             "image encoder; Wan VAE), random weights.", c.WAN_I2V_14B_TRANSFORMER, c.UMT5_XXL,
             c.CLIP_VIT_H_VISION, c.CLIP_IMAGE_PROCESSOR, c.WAN_VAE, disk=False,
             published_params={"text_encoder": 5.68e9},
             notes="The transformer's count (16.4B on meta) follows from the published dims (the card's 14B is "
                   "the model's name); the image encoder is OpenCLIP ViT-H/14's vision tower without its "
                   "projection (0.63B); the VAE is diffusers' AutoencoderKLWan defaults."),
    _ltx("tiny-ltx", "LTX-Video's classes at test widths: a 2-layer LTXVideoTransformer3DModel (32 wide), the LTX "
         "VAE at width 8 with the real 32x spatial / 8x temporal compression, a 2-layer T5 encoder.",
         c.TINY_LTX_TRANSFORMER, c.tiny_t5(32), c.TINY_LTX_VAE),
    _ltx("ltx-video-arch", "Lightricks/LTX-Video (2B, 0.9.x) architecture (transformer 28 layers of 32 x 64 heads, "
         "T5-XXL captions; T5-XXL encoder; LTX VAE 128 latent channels), random weights.", c.LTX_TRANSFORMER,
         c.T5_XXL, c.LTX_VAE, disk=False, published_params={"text_encoder": 4.762e9},
         notes="Transformer and VAE are diffusers' LTXVideoTransformer3DModel / AutoencoderKLLTXVideo defaults "
               "(assumed equal to the 0.9.0 checkpoint's configs; later 0.9.x VAEs add timestep conditioning "
               "and noise injection in the decoder)."),
)}
