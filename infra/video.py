"""Video jobs as data: each video family's rules (frame counts, frame rate, image-to-video), the
checks a video request gets at submission, and its estimated cost.

Place in the data flow: a :class:`~infra.schemas.RenderRequest` with ``kind: video`` (or a model of
a video family) → routing (:mod:`infra.routing`: :func:`video_errors` with the pool's family and
``max_frames``) → the submitter fills the family's defaults (:func:`with_video_defaults`) and
charges the quota by :func:`frames_factor` → a video worker (``pipeline.video``) renders it → the
MP4, its poster frame and an animated WebP preview go to the bucket (``infra.storage.video``).

Sources of the rules (diffusers 0.42 pipelines and the model cards):

- **Wan 2.1 / 2.2** (``WanPipeline``, Wan-AI/Wan2.1-T2V-1.3B-Diffusers card): the VAE compresses
  time by 4, so ``num_frames`` is ``4k + 1`` (the pipeline rounds any other count down and warns;
  the farm refuses it instead, so that what is stored is what was asked); width and height are
  multiples of 16 (VAE 8 × patch 2); the card's example renders 81 frames at 16 fps and
  guidance 5.0. The T2V checkpoints take no input image (Wan's I2V checkpoints are other models).
- **LTX-Video** (``LTXPipeline`` / ``LTXImageToVideoPipeline``, Lightricks/LTX-Video card): time
  compressed by 8, so ``num_frames`` is ``8k + 1``; sizes multiples of 32; the pipeline's default
  frame rate is 25 and the card's examples render 161 frames at 704 × 480 (up to 257 frames).
  The image-to-video pipeline shares every component with the text-to-video one.
- **Wan 2.1 image-to-video** (``WanImageToVideoPipeline``, Wan-AI/Wan2.1-I2V-14B-480P-Diffusers
  card): the Wan VAE and patch, so ``4k + 1`` frames and sizes multiples of 16; the card's example
  renders 81 frames at 480P (about 832 × 480) and exports them at 16 fps. The model is conditioned
  on its first frame: ``image`` is a required argument of the pipeline, so a request without an
  ``init_image`` is refused (``needs_init_image``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: Frame rates a request may ask for (frames per second). Players and browsers handle 1…60.
MIN_FPS, MAX_FPS = 1, 60
#: Most frames any request may ask for (the schema's bound; a pool's ``max_frames`` is usually lower).
MAX_FRAMES = 1025


class VideoRules(NamedTuple):
    """One video family's rules. ``frame_step``: ``num_frames`` must be ``frame_step × k + 1``
    (the VAE's temporal compression). ``default_frames`` / ``default_fps``: what a request that
    names none gets. ``max_frames``: the most a pool of the family takes unless it declares its
    own. ``i2v``: whether an ``init_image`` (image-to-video) is accepted. ``min_steps``: the
    fewest ``num_inference_steps`` it renders. ``needs_image``: an ``init_image`` is required (an
    image-to-video-only model, Wan 2.1 I2V)."""

    frame_step: int
    default_frames: int
    default_fps: int
    max_frames: int
    i2v: bool
    min_steps: int = 1
    needs_image: bool = False

    def frames_ok(self, frames: int) -> bool:
        """Whether the family can render exactly ``frames`` frames."""
        return frames >= 1 and (frames - 1) % self.frame_step == 0

    def nearest_frames(self, frames: int) -> tuple[int, int]:
        """The counts it can render just below and above ``frames`` (for an error message)."""
        below = max(1, (frames - 1) // self.frame_step * self.frame_step + 1)
        return below, below + self.frame_step


#: Family → rules (the families of :data:`infra.pools.FAMILIES` that render video).
VIDEO_RULES: dict[str, VideoRules] = {
    "wan": VideoRules(frame_step=4, default_frames=81, default_fps=16, max_frames=81, i2v=False),
    # LTX-Video's scheduler stretches its sigmas to shift_terminal 0.1
    # (FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal): with one step the only sigma is 1
    # and diffusers 0.42.1 divides by zero, then fails in step(): two steps at least.
    "ltx": VideoRules(frame_step=8, default_frames=121, default_fps=25, max_frames=257, i2v=True, min_steps=2),
    # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers card: 81 frames at 480P, exported at 16 fps.
    "wan-i2v": VideoRules(frame_step=4, default_frames=81, default_fps=16, max_frames=81, i2v=True, needs_image=True),
}


def is_video_family(family: str | None) -> bool:
    """Whether ``family`` renders video."""
    return family in VIDEO_RULES


def video_errors(request: Any, family: str | None, max_frames: int | None = None) -> list[dict[str, Any]]:
    """What a request asks of ``family`` as a video (or an image) that it cannot do, as error
    dicts (``type``, ``field``, ``input``, ``msg``; :func:`infra.pools.capability_errors`' shape).

    Checks: a video request for an image family (``not_a_video_model``), an image request
    (``kind: image``) for a video family (``video_model``), a frame count off the family's
    ``4k + 1`` / ``8k + 1`` rule (``frames_rule``) or over ``max_frames`` (the pool's, else the
    family's; ``over_max_frames``), and an ``init_image`` for a family without image-to-video
    (``no_image_to_video``), no ``init_image`` for a family that needs one (``needs_init_image``),
    and fewer steps than the family renders (``too_few_steps``). Empty for an unknown family (the
    worker decides)."""
    if family is None:
        return []
    rules = VIDEO_RULES.get(family)
    name = f"model {request.model!r} (family {family})"
    if rules is None:
        if getattr(request, "is_video", False):
            return [{"type": "not_a_video_model", "field": "kind", "input": "video",
                     "msg": f"{name} renders images, not video; video families: {', '.join(VIDEO_RULES)}"}]
        return []
    if request.kind == "image":
        return [{"type": "video_model", "field": "kind", "input": "image",
                 "msg": f"{name} renders video; send kind 'video' (or leave kind out)"}]
    errors = []
    frames = request.num_frames if request.num_frames is not None else rules.default_frames
    limit = min(max_frames or rules.max_frames, MAX_FRAMES)
    if not rules.frames_ok(frames):
        below, above = rules.nearest_frames(frames)
        errors.append({"type": "frames_rule", "field": "num_frames", "input": frames,
                       "msg": f"{name} renders {rules.frame_step}k+1 frames (its VAE compresses time by "
                              f"{rules.frame_step}); {frames} is not one: ask for {below} or {above}"})
    if frames > limit:
        errors.append({"type": "over_max_frames", "field": "num_frames", "input": frames,
                       "msg": f"{frames} frames is over max_frames {limit} of the pool serving {name}"})
    if request.num_inference_steps < rules.min_steps:
        errors.append({"type": "too_few_steps", "field": "num_inference_steps", "input": request.num_inference_steps,
                       "msg": f"{name} renders at least {rules.min_steps} denoising steps"})
    if request.init_image is not None and not rules.i2v:
        errors.append({"type": "no_image_to_video", "field": "init_image", "input": request.init_image,
                       "msg": f"{name} has no image-to-video pipeline; send no init_image"})
    if request.init_image is None and rules.needs_image:
        errors.append({"type": "needs_init_image", "field": "init_image", "input": None,
                       "msg": f"{name} is image-to-video only: send an init_image (the clip's first frame)"})
    return errors


def with_video_defaults(request: Any, family: str | None) -> Any:
    """``request`` (a RenderRequest) as its video family renders it: ``kind`` video and the
    family's default ``num_frames`` and ``fps`` where absent; an image family's request as is."""
    rules = VIDEO_RULES.get(family or "")
    if rules is None:
        return request
    updates: dict[str, Any] = {}
    if request.kind is None:
        updates["kind"] = "video"
    if request.num_frames is None:
        updates["num_frames"] = rules.default_frames
    if request.fps is None:
        updates["fps"] = rules.default_fps
    return request.model_copy(update=updates) if updates else request


def frames_factor(request: Any) -> int:
    """How many image renders' worth of work ``request`` is for cost and time estimates: its
    ``num_frames`` for a video (the denoiser's work grows with frames × pixels × steps), else 1."""
    frames = getattr(request, "num_frames", None)
    return frames if getattr(request, "is_video", False) and frames else 1


# ---- a rendered video, as the worker's stages hand it on ------------------------------------------
#: Keys of a rendered video's frames and frame rate in its poster image's ``info`` (a renderer
#: returns one PIL image per request, as for images: a video's is its first frame, carrying the rest).
VIDEO_FRAMES_INFO = "renderfarm.video_frames"
VIDEO_FPS_INFO = "renderfarm.video_fps"


def attach_frames(poster: Any, frames: Any, fps: int) -> Any:
    """``poster`` (a PIL image, the first frame) carrying a rendered video: ``frames`` a uint8
    array of shape ``(num_frames, height, width, 3)`` (RGB) and ``fps`` frames per second."""
    poster.info[VIDEO_FRAMES_INFO] = frames
    poster.info[VIDEO_FPS_INFO] = int(fps)
    return poster


def frames_of(image: Any) -> tuple[Any, int] | None:
    """The ``(frames, fps)`` a renderer attached to ``image`` (:func:`attach_frames`), or None for an image."""
    frames = image.info.get(VIDEO_FRAMES_INFO)
    return None if frames is None else (frames, int(image.info.get(VIDEO_FPS_INFO) or 1))
