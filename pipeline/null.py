"""Renderers a worker can pin: the warm diffusers pipeline, or the null renderer.

Place in the data flow: worker → **renderer** → images (the warm diffusers pipeline, or this one).
The null renderer (a constant 64×64 image, no model) measures the queue, storage and state path
alone (``renderfarm bench farm``). With ``ms_per_image`` > 0 it is a simulated GPU: each call
sleeps ``ms_per_image × len(batch)`` milliseconds (``time.sleep`` releases the GIL, as a
CUDA-synchronizing render does), so the bench can tell whether the host side keeps a device of
that speed busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from PIL import Image

from infra.schemas import RenderRequest

NULL_MODEL = "null"


class NullRenderer:
    """Returns a constant 64×64 grey RGB image per request, reporting every step at once.

    Args:
        ms_per_image: simulated render time, milliseconds per image of a call (>= 0; 0 = none).
    """

    model = NULL_MODEL

    def __init__(self, ms_per_image: float = 0.0) -> None:
        if ms_per_image < 0:
            raise ValueError(f"ms_per_image must be >= 0, got {ms_per_image}")
        self._image = Image.new("RGB", (64, 64), (128, 128, 128))
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
        """One image per request (after the simulated render time); ``on_step(1, 1)`` once."""
        if self.ms_per_image:
            time.sleep(self.ms_per_image * len(requests) / 1000.0)  # releases the GIL
        if on_step is not None:
            on_step(1, 1)
        return [self._image.copy() for _ in requests]
