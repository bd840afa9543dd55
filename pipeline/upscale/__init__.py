"""The upscaling stage (render small, upscale fast): ESRGAN's RRDBNet, diffusers' SD ×4 and ×2 latent
upscalers, tiling, weights, the stage.

Place in the data flow: worker → pipeline renders a group → **upscale** → storage.
"""

from pipeline.upscale.diffusion import (
    OFFLINE_DIFFUSION_UPSCALERS,
    DiffusionSettings,
    DiffusionUpscaler,
    load_diffusion_upscaler,
)
from pipeline.upscale.rrdbnet import RRDBConfig, RRDBNet, config_from_state_dict
from pipeline.upscale.stage import UpscaleStage
from pipeline.upscale.tiles import upscale_tiled
from pipeline.upscale.weights import OFFLINE_UPSCALERS, load_upscaler

__all__ = ["OFFLINE_DIFFUSION_UPSCALERS", "OFFLINE_UPSCALERS", "DiffusionSettings", "DiffusionUpscaler", "RRDBConfig",
           "RRDBNet", "UpscaleStage", "config_from_state_dict", "load_diffusion_upscaler", "load_upscaler",
           "upscale_tiled"]
