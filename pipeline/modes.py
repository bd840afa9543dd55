"""Render modes from one pinned pipeline: text to image, image to image, inpainting.

Place in the data flow: worker → pipeline: :class:`pipeline.render.Renderer` asks
:class:`ModePipelines` for the pipeline of a group's mode, and :func:`mode_arguments` for its
image arguments. The img2img and inpainting pipelines are made once, on first use, with diffusers'
``AutoPipelineForImage2Image.from_pipe`` / ``AutoPipelineForInpainting.from_pipe`` ("Load
pipelines: from_pipe", diffusers docs): they reuse the pinned pipeline's component objects, so
there is no second copy of the weights, and whatever the recipe did to those modules (compiled
denoiser, attention processors, fused projections, tiny VAE, quantized weights) is in force in
every mode. SD 1/2, SDXL, SD3 and FLUX.1 map to their Img2Img and Inpaint pipelines; Kolors to
its Img2Img pipeline.

Inputs arrive as PIL images through a loader the worker supplies (it reads the bucket; this
package knows nothing of S3). Each image is resized to the request's width × height (Lanczos)
and each mask likewise (white = repaint, diffusers' convention), so that a group's images share
the group's size whatever sizes were uploaded. ``strength`` is diffusers' meaning: about
``num_inference_steps × strength`` denoising steps are run (``pipeline.num_timesteps`` counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import PIL.Image

from pipeline.capabilities import call_parameters

#: An input loader: an object key → the decoded image (the worker reads the bucket).
InputLoader = Callable[[str], PIL.Image.Image]


class ModePipelines:
    """The pinned pipeline and, made on first use from its components, its img2img and
    inpainting siblings.

    Args:
        pipe: the warm, optimized pipeline the worker pinned (the txt2img one).
    Raises (from :meth:`for_mode`):
        ValueError: diffusers has no pipeline of that mode for this pipeline's class.
    """

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self._made: dict[str, Any] = {}

    def for_mode(self, mode: str):
        """The pipeline that renders ``mode`` (``txt2img``, ``img2img``, ``inpaint``); the same
        object on every call."""
        if mode == "txt2img":
            return self.pipe
        if mode not in self._made:
            from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

            auto = {"img2img": AutoPipelineForImage2Image, "inpaint": AutoPipelineForInpainting}.get(mode)
            if auto is None:
                raise ValueError(f"unknown render mode {mode!r}")
            try:
                made = auto.from_pipe(self.pipe)
            except ValueError as exc:
                raise ValueError(f"{type(self.pipe).__name__} has no {mode} pipeline in diffusers: {exc}") from None
            made.set_progress_bar_config(disable=True)
            self._made[mode] = made
        return self._made[mode]

    def shares_weights(self, mode: str) -> bool:
        """Whether ``mode``'s pipeline holds the very module objects of the pinned one (no copy)."""
        other = self.for_mode(mode)
        return all(getattr(other, name, None) is module for name, module in self.pipe.components.items()
                   if hasattr(module, "parameters"))


def mode_arguments(pipe, requests: Sequence, load: InputLoader | None, *,
                   base: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one call of ``pipe`` (the mode's pipeline) for a group: ``base``
    (the txt2img arguments of :func:`pipeline.capabilities.call_arguments`) narrowed to what
    ``pipe.__call__`` takes, plus ``image``, ``mask_image`` and ``strength`` for img2img and
    inpainting.

    Raises:
        ValueError: inputs are needed and no loader was given, or the group mixes modes or strengths.
    """
    first = requests[0]
    mode = first.mode
    if mode == "txt2img":
        return base
    if load is None:
        raise ValueError(f"mode {mode!r} needs input images, and this renderer has no input loader")
    if len({(r.mode, r.effective_strength) for r in requests}) > 1:
        raise ValueError("a group must share its mode and strength")
    params = call_parameters(pipe)
    kwargs = {k: v for k, v in base.items() if k in params}
    size = (first.width, first.height)
    kwargs["image"] = [load(r.init_image).convert("RGB").resize(size, PIL.Image.Resampling.LANCZOS) for r in requests]
    if mode == "inpaint":
        kwargs["mask_image"] = [load(r.mask_image).convert("L").resize(size, PIL.Image.Resampling.LANCZOS)
                                for r in requests]
    kwargs["strength"] = first.effective_strength
    return kwargs
