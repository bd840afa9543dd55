"""Renderers a worker can pin: the warm diffusers pipeline, or the null renderer.

Place in the data flow: worker → **renderer** → images (the warm diffusers pipeline, or this one).
The null renderer (a constant 64×64 image, no model) measures the queue, storage and state path
alone (``renderfarm bench farm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PIL import Image

from infra.schemas import RenderRequest

NULL_MODEL = "null"


class NullRenderer:
    """Returns a constant 64×64 grey RGB image per request, reporting every step at once."""

    model = NULL_MODEL

    def __init__(self) -> None:
        self._image = Image.new("RGB", (64, 64), (128, 128, 128))
        self.recipe: dict = {"name": "null"}

    def warmup(self) -> float:
        return 0.0

    def scheduler_name(self, requested: str) -> str:
        """No scheduler runs here: the request's own name."""
        return requested

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]:
        if on_step is not None:
            on_step(1, 1)
        return [self._image.copy() for _ in requests]
