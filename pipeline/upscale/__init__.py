"""The upscaling stage (render small, upscale fast): ESRGAN's RRDBNet, tiling, weights, the stage.

Place in the data flow: worker → pipeline renders a group → **upscale** → storage.
"""

from pipeline.upscale.load import OFFLINE_UPSCALERS, load_upscaler
from pipeline.upscale.rrdbnet import RRDBConfig, RRDBNet, config_from_state_dict
from pipeline.upscale.stage import UpscaleStage
from pipeline.upscale.tiles import upscale_tiled

__all__ = ["OFFLINE_UPSCALERS", "RRDBConfig", "RRDBNet", "UpscaleStage", "config_from_state_dict", "load_upscaler",
           "upscale_tiled"]
