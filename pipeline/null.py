"""Renderers a worker can pin: the warm diffusers pipeline, or the null renderer.

Place in the data flow: worker → **renderer** → images (the warm diffusers pipeline, or this one).
The null renderer (no model) measures the queue, storage and state path alone (``renderfarm
bench farm``). With ``ms_per_image`` > 0 it is a simulated GPU: each call sleeps
``ms_per_image × len(batch)`` milliseconds (``time.sleep`` releases the GIL, as a
CUDA-synchronizing render does), so the bench can tell whether the host side keeps a device of
that speed busy.

Its images are the request's width × height (a request's ``upscale`` is ignored: the null
renderer has no upscaling stage), with content that costs what a render's does to encode and upload, not a
flat colour that compresses to nothing: smooth colour waves plus Gaussian noise (σ = 4 levels),
the same base per size, rolled by a per-seed offset (deterministic per seed and size, different
bytes per seed). Encoded as the worker did when this was measured (Pillow PNG, zlib level 1; fpng,
the worker's PNG encoder now, writes the same bytes within 0.1 %), at 512×512 (measured with
Pillow 13 on this machine):

=================================================  ==========
image                                              PNG bytes
=================================================  ==========
flat grey (this renderer before)                   4,406
this pattern                                       ~511,000
a JPEG photograph cropped and resized to 512²      526,397
uniform random noise (incompressible)              787,271
=================================================  ==========

The base array is built once per size (numpy, ~10 ms at 512², at most :data:`CACHED_SIZES`
sizes kept), so each image costs one roll and one copy into a PIL image.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from infra.schemas import RenderRequest
from infra.video import attach_frames

NULL_MODEL = "null"
#: Sizes whose base pattern is kept (an LRU cache).
CACHED_SIZES = 8
#: Standard deviation of the noise on the colour waves, in 8-bit levels (see the module docstring).
NOISE_SIGMA = 4.0


@functools.lru_cache(maxsize=CACHED_SIZES)
def base_pattern(width: int, height: int) -> np.ndarray:
    """The read-only ``(height, width, 3)`` uint8 base image of one size: three low-frequency
    colour waves (one per channel) plus Gaussian noise of σ :data:`NOISE_SIGMA`, from a fixed
    seed, so the same size always gives the same pixels."""
    rng = np.random.default_rng(20240512)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    waves = [128 + 60 * np.sin(x / width * 2 * np.pi * fx + phase) * np.cos(y / height * 2 * np.pi * fy)
             for fx, fy, phase in ((1.3, 0.7, 0.0), (0.9, 1.6, 1.0), (2.1, 1.1, 2.0))]
    pixels = np.stack(waves, axis=-1) + rng.normal(0.0, NOISE_SIGMA, (height, width, 3)).astype(np.float32)
    out = np.clip(pixels, 0, 255).astype(np.uint8)
    out.flags.writeable = False
    return out


def null_image(width: int, height: int, seed: int) -> Image.Image:
    """A ``width`` × ``height`` RGB image for ``seed``: :func:`base_pattern` of that size, rolled
    by an offset derived from the seed (deterministic; neighbouring seeds differ)."""
    base = base_pattern(width, height)
    shift = ((seed * 7919) % height, (seed * 104729) % width)
    return Image.fromarray(np.roll(base, shift, axis=(0, 1)))  # (h, w, 3) uint8: RGB


class NullRenderer:
    """Returns one image of the request's width × height per request (see the module docstring
    for its content; a video request's: :func:`null_video`), reporting every step at once.

    Args:
        ms_per_image: simulated render time, milliseconds per image of a call (>= 0; 0 = none).

    Raises:
        ValueError: ``ms_per_image`` < 0.
    """

    model = NULL_MODEL

    def __init__(self, ms_per_image: float = 0.0) -> None:
        if ms_per_image < 0:
            raise ValueError(f"ms_per_image must be >= 0, got {ms_per_image}")
        self.ms_per_image = ms_per_image
        self.recipe: dict = {"name": "null", "ms_per_image": ms_per_image}

    def warmup(self) -> float:
        """Nothing to warm: 0.0 seconds."""
        return 0.0

    def scheduler_name(self, requested: str) -> str:
        """No scheduler runs here: the request's own name."""
        return requested

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]:
        """One ``width`` × ``height`` RGB image per request, in order (after the simulated render
        time, ``ms_per_image × len(requests)`` ms); ``on_step(1, 1)`` once."""
        if self.ms_per_image:
            time.sleep(self.ms_per_image * len(requests) / 1000.0)  # releases the GIL
        if on_step is not None:
            on_step(1, 1)
        return [null_video(r) if r.is_video else null_image(r.width, r.height, r.seed or 0) for r in requests]


#: What a null video request without num_frames / fps gets (a null pool has no family defaults).
NULL_VIDEO_FRAMES, NULL_VIDEO_FPS = 9, 8


def null_video(request: RenderRequest) -> Image.Image:
    """A video request's null render: ``num_frames`` (default 9) frames of :func:`null_image`, the
    seed's pattern shifted a few pixels per frame (motion an encoder has to code), attached to the
    first frame (:func:`infra.video.attach_frames`) at the request's ``fps`` (default 8)."""
    count = request.num_frames or NULL_VIDEO_FRAMES
    seed = request.seed or 0
    frames = np.stack([np.asarray(null_image(request.width, request.height, seed + 3 * n)) for n in range(count)])
    return attach_frames(Image.fromarray(frames[0]), frames, request.fps or NULL_VIDEO_FPS)
