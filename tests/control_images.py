"""A photo-like control image for the ControlNet tests (in process and through the farm): outlines
that canny finds, different for each seed."""

from __future__ import annotations

import numpy as np
import PIL.Image


def shapes(seed: int, size: int = 64) -> PIL.Image.Image:
    """A bright rectangle (placed by ``seed``) and disc on a dark noisy background: RGB, ``size``²
    pixels (at least 64), uint8."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
    x0, y0 = 8 + seed % 16, 10 + (3 * seed) % 20
    pixels[y0:y0 + 24, x0:x0 + 20] = 220
    yy, xx = np.mgrid[:size, :size]
    pixels[(yy - 44) ** 2 + (xx - 44) ** 2 < 64] = 180
    return PIL.Image.fromarray(pixels)
