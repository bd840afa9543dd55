"""How many frames a video pool can render at its largest size: two short renders' peak memory,
extrapolated linearly in frames.

Place in the data flow: :func:`pipeline.video.prepare.prepare_video_renderer` (a pool that declares
``max_pixels``) → :func:`measure_max_frames` → ``renderer.recipe["max_frames"]``, the worker's report.

Why linear: a clip's latents, the transformer's activations (its token count is latent frames ×
latent height × latent width) and the VAE decoder's feature maps all grow with the frame count at a
fixed size; the weights are the intercept. Attention is quadratic in tokens, but diffusers' SDPA
kernels do not materialise the score matrix, so its memory stays linear too. The estimate is an
upper bound to check against, not a guarantee: it is rounded down to the family's ``k·step + 1``
frame rule and capped by the family's ``max_frames``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from infra.schemas import RenderRequest


def max_frames_from_peaks(samples: Sequence[tuple[int, int]], budget_bytes: int, frame_step: int, cap: int) -> int:
    """The most frames whose extrapolated peak fits ``budget_bytes``.

    Args:
        samples: two or more ``(num_frames, peak_bytes)`` measurements at one size (frames distinct).
        budget_bytes: the memory a render may peak at (bytes).
        frame_step: the family's rule (``num_frames = frame_step × k + 1``).
        cap: the family's (or pool's) ``max_frames``.
    Returns:
        A frame count of the rule, between 1 and ``cap`` (``cap`` rounded down to the rule when the
        peak does not grow with frames; 1 when even the smallest sample is over budget).
    Raises:
        ValueError: fewer than two samples, equal frame counts, or ``frame_step``/``cap`` < 1.
    """
    if len(samples) < 2 or frame_step < 1 or cap < 1:
        raise ValueError("need two (num_frames, peak_bytes) samples, frame_step >= 1 and cap >= 1")
    (f1, p1), (f2, p2) = sorted(samples)[0], sorted(samples)[-1]
    if f1 == f2:
        raise ValueError(f"the samples must have different frame counts, got {f1} twice")
    slope = (p2 - p1) / (f2 - f1)  # bytes per frame
    frames = cap if slope <= 0 else f1 + math.floor((budget_bytes - p1) / slope)
    frames = min(frames, cap)
    if frames < 1:
        return 1
    return (frames - 1) // frame_step * frame_step + 1


def largest_size(pool, multiple: int) -> tuple[int, int] | None:
    """The largest (width, height) in pixels a pool serves: its declared ``sizes`` by pixels, else the
    square of its ``max_pixels`` rounded down to ``multiple``; None when it declares neither."""
    if pool.sizes:
        return max(((int(w), int(h)) for w, h in pool.sizes), key=lambda s: s[0] * s[1])
    if not pool.max_pixels:
        return None
    side = max(multiple, int(math.isqrt(int(pool.max_pixels))) // multiple * multiple)
    return side, side


def measure_max_frames(renderer, budget_bytes: int, width: int, height: int) -> dict:
    """Render ``frame_step + 1`` and ``2·frame_step + 1`` frames (2 steps, no guidance) at
    ``width`` × ``height`` on ``renderer`` (a :class:`pipeline.video.VideoRenderer`), measure each
    peak (:func:`pipeline.memory.peak_bytes`: CUDA's peak allocated, the CPU's RSS high-water mark)
    and extrapolate (:func:`max_frames_from_peaks`).

    Returns:
        ``{"max_frames", "width", "height", "budget_bytes", "samples": [[frames, peak_bytes], …], "seconds"}``.
    Raises:
        whatever a render raises.
    """
    from pipeline.memory import peak_bytes, reset_peak

    started = time.perf_counter()
    rules = renderer.rules
    samples = []
    for frames in (rules.frame_step + 1, 2 * rules.frame_step + 1):
        reset_peak(renderer.device)
        renderer.render([RenderRequest(prompt="sizing", model=renderer.model, seed=0, width=width, height=height,
                                       num_inference_steps=2, guidance_scale=1.0, kind="video", num_frames=frames)])
        samples.append((frames, peak_bytes(renderer.device)))
    return {"max_frames": max_frames_from_peaks(samples, budget_bytes, rules.frame_step, rules.max_frames),
            "width": width, "height": height, "budget_bytes": int(budget_bytes),
            "samples": [list(s) for s in samples], "seconds": round(time.perf_counter() - started, 3)}
