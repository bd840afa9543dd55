"""Component configs of the public checkpoints, written out as data (no download).

Place in the data flow: :mod:`pipeline.models.offline` assembles these into offline models, which
:mod:`pipeline.models.build` instantiates with random weights. Every full-size config names its
source; the small ``TINY_*`` ones keep the real component classes at small widths (the shapes
diffusers' own fast tests use) and the real VAE scaling factors, so that family detection and the
tiny-VAE choice (:mod:`pipeline.models.families`) see what they would see on the real model.
"""

from __future__ import annotations

# ---- schedulers --------------------------------------------------------------------------------

#: The scaled-linear beta schedule of every SD 1.x / 2.x / XL scheduler config.
SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}
PNDM_SD15 = {**SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1}
DDIM_TINY = {**SD_BETAS, "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1,
             "timestep_spacing": "trailing"}
EULER_TURBO = {**SD_BETAS, "prediction_type": "epsilon", "interpolation_type": "linear",
               "use_karras_sigmas": False, "steps_offset": 1, "timestep_spacing": "trailing"}
#: stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json (EulerDiscreteScheduler).
EULER_SDXL = {**SD_BETAS, "prediction_type": "epsilon", "interpolation_type": "linear",
              "use_karras_sigmas": False, "steps_offset": 1, "timestep_spacing": "leading"}
#: SD3-medium: FlowMatchEulerDiscreteScheduler(shift=3.0); FLUX.1-schnell: shift 1.0, no dynamic shift.
FLOW_SD3 = {"num_train_timesteps": 1000, "shift": 3.0}
FLOW_FLUX_SCHNELL = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
                     "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
#: ERNIE-Image passes its own sigmas (linspace 1 → 0) to the scheduler; shift 1.0 is an assumption.
FLOW_ERNIE = {"num_train_timesteps": 1000, "shift": 1.0}

# ---- VAEs --------------------------------------------------------------------------------------

#: The SD 1.x / 2.x VAE (AutoencoderKL, 83.7M parameters), scaling factor 0.18215.
SD_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 512,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu",
}
#: SDXL's VAE: same architecture, scaling factor 0.13025, upcast to float32 for decoding in fp16.
SDXL_VAE = {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
#: SD3's 16-channel VAE (no quant convs), scaling 1.5305, shift 0.0609 (SD3-medium vae/config.json).
SD3_VAE = {**SD_VAE, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609,
           "use_quant_conv": False, "use_post_quant_conv": False}
#: FLUX.1's 16-channel VAE, scaling 0.3611, shift 0.1159 (FLUX.1-schnell vae/config.json).
FLUX_VAE = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
#: ERNIE-Image's AutoencoderKLFlux2 (32 latent channels, batch-norm statistics): diffusers' defaults.
FLUX2_VAE: dict = {}
TINY_VAE_BLOCKS = {"block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4}

# ---- text encoders ----------------------------------------------------------------------------

#: openai/clip-vit-large-patch14 text tower (123M), as SD 1.x, SDXL (text_encoder), SD3 and FLUX ship it.
CLIP_L = {
    "vocab_size": 49408, "max_position_embeddings": 77, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "projection_dim": 768, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}
#: OpenCLIP ViT-H text tower as SD 2.x ships it (23 of its 24 layers: SD 2 uses the penultimate).
OPENCLIP_H = {**CLIP_L, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 23,
              "num_attention_heads": 16, "projection_dim": 512, "hidden_act": "gelu"}
#: OpenCLIP ViT-bigG/14 text tower with projection (695M): SDXL's text_encoder_2, SD3's text_encoder_2.
OPENCLIP_BIGG = {**CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                 "num_attention_heads": 20, "projection_dim": 1280, "hidden_act": "gelu"}
#: google/t5-v1_1-xxl encoder (4.76B), SD3's text_encoder_3 and FLUX.1's text_encoder_2.
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
          "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
          "layer_norm_epsilon": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
#: ERNIE-Image's text encoder (Mistral3Model). Its published config was not available offline: the
#: text width is fixed by the transformer's ``text_in_dim`` default (2560); depth, heads, FFN and
#: vocabulary are assumptions of a 3B-class Ministral-style decoder, and the vision tower is left
#: at one small layer (the pipeline never calls it). Treat its parameter count as approximate.
ERNIE_TEXT = {
    "text_config": {"model_type": "ministral3", "vocab_size": 131072, "hidden_size": 2560, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "tie_word_embeddings": True},
    "vision_config": {"model_type": "pixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 64, "patch_size": 16},
}


def tiny_clip(hidden: int = 32, projection: int = 32) -> dict:
    """A 2-layer CLIP text tower of width ``hidden`` (the real vocabulary and 77 positions)."""
    return {**CLIP_L, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
            "num_attention_heads": 4, "projection_dim": projection, "hidden_act": "gelu"}


def tiny_t5(d_model: int) -> dict:
    """A 2-layer T5 v1.1 encoder of width ``d_model`` with a 1,024-token vocabulary."""
    return {**T5_XXL, "vocab_size": 1024, "d_model": d_model, "d_kv": 8, "d_ff": 2 * d_model, "num_layers": 2,
            "num_heads": 4}


# ---- denoisers ---------------------------------------------------------------------------------

SD1_UNET = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280],
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32, "act_fn": "silu",
    "flip_sin_to_cos": True, "freq_shift": 0, "downsample_padding": 1, "mid_block_scale_factor": 1,
}
SD2_UNET = {**SD1_UNET, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
            "use_linear_projection": True}
#: stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (2.567B): three stages, 1/2/10
#: transformer layers, text_time conditioning (pooled bigG 1280 + 6 × 256 time ids = 2816).
SDXL_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10], "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048,
    "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32, "act_fn": "silu",
    "flip_sin_to_cos": True, "freq_shift": 0,
}
#: stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json (2.03B): 24 MMDiT layers.
SD3_TRANSFORMER = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
                   "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                   "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
                   "pos_embed_max_size": 192}
#: black-forest-labs/FLUX.1-schnell transformer/config.json (11.9B): 19 double + 38 single blocks, 3072 wide.
FLUX_TRANSFORMER = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                    "pooled_projection_dim": 768, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}
#: diffusers' ErnieImageTransformer2DModel defaults (hidden 3072, 24 heads, 24 layers, FFN 8192,
#: 128 input channels = 32 latent channels patchified 2×2, text_in_dim 2560).
ERNIE_TRANSFORMER: dict = {}

# ---- tiny builds (diffusers' fast-test shapes, real classes, real VAE scaling factors) ---------

TINY_SDXL_UNET = {**SDXL_UNET, "sample_size": 32, "layers_per_block": 1, "block_out_channels": [32, 64],
                  "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                  "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "transformer_layers_per_block": [1, 2],
                  "attention_head_dim": [2, 4], "cross_attention_dim": 64, "addition_time_embed_dim": 8,
                  "projection_class_embeddings_input_dim": 32 + 6 * 8}
TINY_SD3_TRANSFORMER = {**SD3_TRANSFORMER, "sample_size": 32, "num_layers": 2, "attention_head_dim": 8,
                        "num_attention_heads": 4, "joint_attention_dim": 64, "caption_projection_dim": 32,
                        "pooled_projection_dim": 64, "pos_embed_max_size": 96}
TINY_FLUX_TRANSFORMER = {**FLUX_TRANSFORMER, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
                         "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
                         "axes_dims_rope": [4, 6, 6]}
#: Wide enough (128, FFN 256) that SDNQ quantizes its layers: sdnq skips weights under 16,384 elements.
TINY_ERNIE_TRANSFORMER = {"hidden_size": 128, "num_attention_heads": 4, "num_layers": 2, "ffn_hidden_size": 256,
                          "text_in_dim": 32, "rope_axes_dim": [8, 12, 12]}
TINY_ERNIE_TEXT = {
    "text_config": {**ERNIE_TEXT["text_config"], "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8},
    "vision_config": {**ERNIE_TEXT["vision_config"], "hidden_size": 16, "intermediate_size": 32},
}


# ---- Chinese text encoders ---------------------------------------------------------------------

#: IDEA-CCNL/Taiyi-CLIP-RoBERTa-102M-ViT-L-Chinese, the text encoder of
#: Taiyi-Stable-Diffusion-1B-Chinese-v0.1 (its model card: a Chinese RoBERTa-wwm base, BertModel
#: class, 768 wide like the SD 1.x UNet's cross-attention; bert-base-chinese's 21,128 vocabulary).
TAIYI_BERT = {"vocab_size": 21128, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2,
              "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def tiny_bert(hidden: int = 32) -> dict:
    """A 2-layer BertModel of width ``hidden`` with the Chinese 21,128-token vocabulary."""
    return {**TAIYI_BERT, "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 2 * hidden}


#: Kolors' UNet as an SDXL UNet conditioned by ChatGLM3 (Kwai-Kolors/Kolors-diffusers unet/config.json:
#: ``encoder_hid_dim_type`` text_proj from 4096-wide ChatGLM states); at test widths here.
TINY_KOLORS_UNET = {**TINY_SDXL_UNET, "cross_attention_dim": 64, "encoder_hid_dim": 32,
                    "encoder_hid_dim_type": "text_proj", "projection_class_embeddings_input_dim": 32 + 6 * 8}


#: Kwai-Kolors/Kolors-diffusers unet/config.json (2.58B): SDXL's UNet with ``text_proj`` from ChatGLM3's
#: 4096-wide states to the 2048-wide cross-attention, and text_time conditioning on the pooled
#: 4096-wide state plus 6 × 256 time ids (5632).
KOLORS_UNET = {**SDXL_UNET, "encoder_hid_dim": 4096, "encoder_hid_dim_type": "text_proj",
               "projection_class_embeddings_input_dim": 4096 + 6 * 256}
#: THUDM/chatglm3-6b config.json (6.24B), Kolors' text encoder: 28 layers of 4096, FFN 13,696,
#: multi-query attention with 2 groups of 128, a 65,024-token padded vocabulary.
CHATGLM3_6B = {"num_layers": 28, "padded_vocab_size": 65024, "hidden_size": 4096, "ffn_hidden_size": 13696,
               "kv_channels": 128, "num_attention_heads": 32, "seq_length": 8192, "multi_query_attention": True,
               "multi_query_group_num": 2, "original_rope": True, "add_qkv_bias": True}


def tiny_chatglm(hidden: int, pieces: int) -> dict:
    """A 2-layer ChatGLM (ChatGLM3's layout: RMSNorm, rotary embeddings, multi-query attention with 2
    groups) of width ``hidden``, for a tokenizer of ``pieces`` SentencePiece pieces plus its specials."""
    return {"num_layers": 2, "padded_vocab_size": pieces + 16, "hidden_size": hidden, "ffn_hidden_size": 2 * hidden,
            "kv_channels": 8, "num_attention_heads": 4, "seq_length": 256, "multi_query_attention": True,
            "multi_query_group_num": 2, "original_rope": True, "add_qkv_bias": True}


# ---- video (Wan 2.1, LTX-Video) ----------------------------------------------------------------

#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler: UniPCMultistepScheduler on flow-matching sigmas
#: (``prediction_type="flow_prediction"``, ``use_flow_sigmas``), ``flow_shift`` 3.0, the value the
#: Wan 2.1 card gives for 480p (5.0 for 720p).
UNIPC_WAN = {"num_train_timesteps": 1000, "solver_order": 2, "prediction_type": "flow_prediction",
             "use_flow_sigmas": True, "flow_shift": 3.0}
#: Lightricks/LTX-Video scheduler: FlowMatchEulerDiscreteScheduler with resolution-dependent
#: (dynamic) shifting from 0.95 at 1,024 tokens to 2.05 at 4,096 and a terminal sigma of 0.1.
FLOW_LTX = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
            "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1}
#: google/umt5-xxl encoder (Wan 2.1's text encoder): T5-XXL's layout with a 256,384-token vocabulary
#: and a relative attention bias in every layer (UMT5EncoderModel).
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer: 30 layers of 1536 (12 heads × 128), FFN 8960,
#: 4096-wide UMT5 text, 16 latent channels, patch (1, 2, 2) (the Wan 2.1 repository's t2v_1_3B config).
WAN_1_3B_TRANSFORMER = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
                        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
                        "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                        "eps": 1e-6, "rope_max_seq_len": 1024}
#: The Wan 2.1 VAE (AutoencoderKLWan): diffusers' defaults are its config (base 96, z 16, 4×8×8
#: compression, the published latents_mean / latents_std).
WAN_VAE: dict = {}
#: Lightricks/LTX-Video (2B, 0.9.x) transformer: diffusers' LTXVideoTransformer3DModel defaults — 28
#: layers, 32 heads × 64 (2048 wide), 4096-wide T5 captions, 128 latent channels, patch 1.
LTX_TRANSFORMER: dict = {}
#: The LTX-Video 0.9.0 VAE (AutoencoderKLLTXVideo): diffusers' defaults (128 latent channels, patch 4,
#: 32× spatial and 8× temporal compression, no timestep conditioning).
LTX_VAE: dict = {}
TINY_WAN_TRANSFORMER = {**WAN_1_3B_TRANSFORMER, "num_attention_heads": 2, "attention_head_dim": 12,
                        "text_dim": 32, "ffn_dim": 32, "num_layers": 2, "rope_max_seq_len": 32}
TINY_WAN_VAE = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                "temperal_downsample": [False, True, True]}
TINY_LTX_TRANSFORMER = {"in_channels": 8, "out_channels": 8, "num_attention_heads": 4, "attention_head_dim": 8,
                        "cross_attention_dim": 32, "num_layers": 2, "caption_channels": 32}
#: The real compression (patch 4, three spatio-temporal downsamplings: 32× in space, 8× in time) at width 8.
TINY_LTX_VAE = {"latent_channels": 8, "block_out_channels": [8, 8, 8, 8], "decoder_block_out_channels": [8, 8, 8, 8],
                "layers_per_block": [1, 1, 1, 1, 1], "decoder_layers_per_block": [1, 1, 1, 1, 1]}
#: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer: 40 layers of 5120 (40 heads × 128), FFN 13824,
#: 36 input channels (16 noise latents + 4 first-frame mask + 16 first-frame latents, the layout
#: WanImageToVideoPipeline.prepare_latents builds), 1280-wide CLIP image tokens projected to the keys
#: and values of an added cross-attention (``added_kv_proj_dim``), the Wan 2.1 repository's i2v_14B config.
WAN_I2V_14B_TRANSFORMER = {**WAN_1_3B_TRANSFORMER, "num_attention_heads": 40, "in_channels": 36, "ffn_dim": 13824,
                           "num_layers": 40, "image_dim": 1280, "added_kv_proj_dim": 5120}
#: Wan 2.1 I2V's image encoder: the OpenCLIP ViT-H/14 vision tower as transformers' CLIPVisionModel
#: (32 layers of 1280, 16 heads, FFN 5120, 224 px in patches of 14); the pipeline takes its
#: penultimate hidden states (257 tokens of 1280), so it has no projection.
CLIP_VIT_H_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                     "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "projection_dim": 1024,
                     "hidden_act": "gelu", "layer_norm_eps": 1e-5}
#: Its CLIPImageProcessor: transformers' defaults (resize to 224 on the short side, centre crop 224,
#: OpenAI CLIP mean and std).
CLIP_IMAGE_PROCESSOR: dict = {}
TINY_WAN_I2V_TRANSFORMER = {**TINY_WAN_TRANSFORMER, "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 24}
TINY_CLIP_VISION = {**CLIP_VIT_H_VISION, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32}
TINY_CLIP_IMAGE_PROCESSOR = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
