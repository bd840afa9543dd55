"""Video rendering (text-to-video, image-to-video): Wan 2.1 and LTX-Video pipelines a worker pins.

Modules: :mod:`.recipes` (the video recipe per device, as data), :mod:`.apply` (applying it to a
loaded pipeline: VAE tiling/slicing, offload, regional compile, First Block Cache), :mod:`.render`
(:class:`VideoRenderer`, one pipeline call per request), :mod:`.prepare`
(:func:`prepare_video_renderer`, which :func:`pipeline.warm.prepare_renderer` delegates to).
"""

from pipeline.video.prepare import prepare_video_renderer
from pipeline.video.recipes import VideoRecipe, video_recipe
from pipeline.video.render import VideoRenderer

__all__ = ["VideoRecipe", "VideoRenderer", "prepare_video_renderer", "video_recipe"]
