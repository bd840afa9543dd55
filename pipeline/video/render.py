"""The video renderer: one pinned video pipeline (Wan 2.1, Wan 2.1 I2V, LTX-Video), one call per request.

Place in the data flow: worker → render stage (``worker.render_stage.Renderer`` protocol) →
:class:`VideoRenderer` (here) → diffusers ``WanPipeline`` / ``LTXPipeline`` (or, for a request with
``init_image``, ``LTXImageToVideoPipeline.from_pipe``: the same component objects, no second copy
of the weights) or ``WanImageToVideoPipeline`` (the pinned pipeline is the image-to-video one: every
request's ``init_image`` is its ``image``) → the first frame as a PIL image carrying every frame
(:func:`infra.video.attach_frames`) → the post stage, which encodes the video.

Each request renders alone (batch 1: a clip's latents are ``num_frames`` images' worth), with its
own CPU ``torch.Generator`` seeded by ``request.seed``, so a seed draws the same starting noise on
every device. Every denoising step is reported through ``on_step(step, total)`` from diffusers'
``callback_on_step_end``; an exception raised there (the worker's cancel and timeout) leaves the
pipeline call between two steps and propagates.

A request that is not a video (the worker's warm-up renders, :func:`pipeline.warm.warm_up`) renders
the family's shortest clip, ``frame_step + 1`` frames (:data:`infra.video.VIDEO_RULES`); for a
family that needs an image (``needs_image``: Wan 2.1 I2V) from a uniform grey (128) image of the
request's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import PIL.Image
import torch

from infra.schemas import RenderRequest
from infra.video import VIDEO_RULES, attach_frames, video_errors
from pipeline.capabilities import call_parameters, derive_capabilities
from pipeline.memory import BatchLimits
from pipeline.models.families import detect_family
from pipeline.modes import InputLoader
from pipeline.pool_options import PoolOptions
from pipeline.schedulers import scheduler_name

#: Family → the diffusers image-to-video pipeline made from the pinned one with ``from_pipe``.
I2V_PIPELINES = {"ltx": "LTXImageToVideoPipeline"}
#: The first frame a warm-up render of an image-to-video-only family starts from (RGB).
WARM_UP_GREY = (128, 128, 128)


def frames_to_uint8(frames: np.ndarray) -> np.ndarray:
    """A diffusers ``output_type="np"`` video (float in [0, 1], shape (F, H, W, 3)) as uint8 RGB, rounded
    as diffusers' ``numpy_to_pil`` does (``round(x × 255)``), C-contiguous."""
    return np.ascontiguousarray((np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8))


class VideoRenderer:
    """Renders video requests with one warm diffusers video pipeline.

    Args:
        pipe: a loaded ``WanPipeline``, ``WanImageToVideoPipeline`` or ``LTXPipeline`` (recipe applied).
        model: the model name the worker pinned. device: where it runs (torch device string).
    Attributes set by :func:`pipeline.video.prepare.prepare_video_renderer`: ``recipe`` (the
    recipe with its report), ``max_batch_size`` (1), ``limits``, ``pool``, ``compiler_warm_up``
    (None). Set by the worker: ``input_loader`` (reads an ``init_image`` by its key).
    """

    input_loader: InputLoader | None = None
    adapters = None
    controlnets = None
    ip_adapters = None
    compiler_warm_up = None
    recipe: dict[str, Any]
    limits: BatchLimits
    pool: PoolOptions

    def __init__(self, pipe, *, model: str, device: str = "cpu", generator_device: str = "cpu") -> None:
        self.pipe = pipe
        self.model = model
        self.device = device
        self.generator_device = generator_device
        self.family = detect_family(pipe)
        if self.family not in VIDEO_RULES:
            raise ValueError(f"{type(pipe).__name__} (family {self.family}) is not a video pipeline; "
                             f"video families: {', '.join(VIDEO_RULES)}")
        self.rules = VIDEO_RULES[self.family]
        self.capabilities = derive_capabilities(pipe)
        self.max_batch_size = 1
        self._i2v: Any = None
        self.compiled_renders = self.eager_renders = 0

    def describe(self) -> dict:
        """Family, capabilities and the video rules, for the worker's report."""
        return {"family": self.family, "denoiser": "transformer", "capabilities": self.capabilities._asdict(),
                "video": self.rules._asdict(), "batch_invariant": "per-sample",
                "batch_invariant_note": "video requests render one per pipeline call"}

    def scheduler_name(self, requested: str) -> str:
        """The scheduler a request renders with: the pipeline's own (video families take no other)."""
        return requested if requested != "default" else scheduler_name(self.pipe.scheduler)

    def warmup(self, *, width: int = 64, height: int = 64, num_inference_steps: int = 1) -> float:
        """Render one short clip (``frame_step + 1`` frames; the family's fewest steps when
        ``num_inference_steps`` is under them) to load kernels; wall seconds."""
        import time

        multiple = self.capabilities.size_multiple
        width, height = (max(multiple, v // multiple * multiple) for v in (width, height))
        started = time.perf_counter()
        self.render([RenderRequest(prompt="warmup", model=self.model, seed=0, width=width, height=height,
                                   num_inference_steps=num_inference_steps)])
        return time.perf_counter() - started

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[PIL.Image.Image]:
        """Render each request in its own pipeline call; returns one RGB PIL image per request, the
        clip's first frame (width × height) carrying the frames, uint8 (num_frames, height, width, 3),
        and the fps (:func:`infra.video.attach_frames`).

        Raises:
            ValueError: a request this family cannot render (the reason named: no seed, a frame count
                off the family's rule, image-to-video on a family without it, a video without the
                ``init_image`` its family needs, no input loader, a scheduler other than the pipeline's own).
            whatever ``on_step`` raises (the render stops between two denoising steps).
        """
        return [self._render_one(r, on_step) for r in requests]

    def _render_one(self, request: RenderRequest, on_step: Callable[[int, int], None] | None) -> PIL.Image.Image:
        frames, fps = self._shape(request)
        steps = request.num_inference_steps
        least = self.rules.min_steps  # infra.video.VIDEO_RULES (checked at submission too)
        if steps < least:
            if request.is_video:
                raise ValueError(f"num_inference_steps: the {self.family} family renders at least {least} steps "
                                 f"(its scheduler's shift_terminal needs them), got {steps}")
            steps = least  # a warm-up render: the fewest it can do
        pipe = self._pipeline_for(request)
        generator = torch.Generator(self.generator_device).manual_seed(int(request.seed))  # type: ignore[arg-type]

        def step_end(pipeline, step_index, timestep, callback_kwargs):
            if on_step is not None:
                on_step(step_index + 1, getattr(pipeline, "num_timesteps", None) or steps)
            return callback_kwargs

        kwargs: dict[str, Any] = {
            "prompt": request.prompt, "negative_prompt": request.negative_prompt or None,
            "num_frames": frames, "height": request.height, "width": request.width,
            "num_inference_steps": steps, "guidance_scale": request.guidance_scale,
            "generator": generator, "output_type": "np", "callback_on_step_end": step_end,
            "frame_rate": fps}
        if request.init_image is not None:
            kwargs["image"] = self._init_image(request)
        elif self.rules.needs_image:  # a warm-up (video requests without an image were refused in _shape)
            kwargs["image"] = PIL.Image.new("RGB", (request.width, request.height), WARM_UP_GREY)
        params = call_parameters(pipe)
        kwargs = {k: v for k, v in kwargs.items() if k in params}
        with torch.inference_mode():
            video = pipe(**kwargs).frames[0]
        clip = frames_to_uint8(np.asarray(video, dtype=np.float32))
        if clip.shape != (frames, request.height, request.width, 3):
            raise RuntimeError(f"{type(pipe).__name__} returned frames of shape {clip.shape}, expected "
                               f"{(frames, request.height, request.width, 3)}")
        return attach_frames(PIL.Image.fromarray(clip[0]), clip, fps)

    def _shape(self, request: RenderRequest) -> tuple[int, int]:
        """(num_frames, fps) of ``request``: its own for a video, the family's shortest clip otherwise."""
        if request.seed is None:
            raise ValueError("every request needs a seed (the producer assigns one)")
        if request.scheduler != "default":
            raise ValueError(f"scheduler {request.scheduler!r}: the {self.family} family renders with its "
                             "own scheduler only (send scheduler 'default')")
        if not request.is_video:
            return self.rules.frame_step + 1, self.rules.default_fps
        errors = [e for e in video_errors(request, self.family) if e["type"] != "over_max_frames"]
        if errors:
            raise ValueError("; ".join(f"{e['field']}: {e['msg']}" for e in errors))
        frames = request.num_frames if request.num_frames is not None else self.rules.default_frames
        limit = self.frames_limit(request.width, request.height)
        if limit is not None and frames > limit:
            raise ValueError(f"num_frames: {frames} frames at {request.width}x{request.height} would not fit this "
                             f"worker's memory (it holds about {limit}; measured at start-up)")
        return frames, request.fps or self.rules.default_fps

    def frames_limit(self, width: int, height: int) -> int | None:
        """The most frames this worker's memory holds at ``width × height`` pixels, from the
        start-up measurement (``recipe["max_frames"]``, at the pool's largest size; memory grows
        with frames × pixels, so a smaller size holds proportionally more), or None when not measured."""
        measured = (getattr(self, "recipe", None) or {}).get("max_frames")
        if not measured:
            return None
        return int(measured["max_frames"] * measured["width"] * measured["height"] / (width * height))

    def _pipeline_for(self, request: RenderRequest):
        if request.init_image is None or self.rules.needs_image:  # wan-i2v: the pinned pipeline is the I2V one
            return self.pipe
        name = I2V_PIPELINES.get(self.family or "")
        if name is None or not self.rules.i2v:
            raise ValueError(f"init_image: the {self.family} family has no image-to-video pipeline")
        if self._i2v is None:
            import diffusers

            i2v = getattr(diffusers, name).from_pipe(self.pipe)
            i2v.set_progress_bar_config(disable=True)
            self._i2v = i2v
        return self._i2v

    def _init_image(self, request: RenderRequest) -> PIL.Image.Image:
        if self.input_loader is None:
            raise ValueError("init_image: image-to-video needs input images, and this renderer has no input loader")
        image = self.input_loader(request.init_image)  # type: ignore[arg-type]
        return image.convert("RGB").resize((request.width, request.height), PIL.Image.Resampling.LANCZOS)
