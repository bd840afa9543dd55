"""Batched rendering: one group of compatible requests → one pipeline call → one image each.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. The worker
groups the jobs it pulled by :func:`compat_key` and hands each group to :meth:`Renderer.render`;
the images go on to storage.

Every image depends only on its own request: each has its own seeded generator, and the batch
is computed so that rendering a request alone or inside any group gives identical pixels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import PIL.Image
import torch
from diffusers import DiffusionPipeline

from infra.schemas import RenderRequest
from pipeline.invariance import make_batch_invariant
from pipeline.schedulers import scheduler_for

CompatKey = tuple[str | None, int, int, int, float, str]


def compat_key(request: RenderRequest) -> CompatKey:
    """``(model, width, height, num_inference_steps, guidance_scale, scheduler)``.

    Requests with equal keys can share one pipeline call; prompts, negative prompts and seeds may differ.
    """
    r = request
    return (r.model, r.width, r.height, r.num_inference_steps, r.guidance_scale, r.scheduler)


class Renderer:
    """One warm pipeline that renders groups of compatible requests.

    ``device`` is where the pipeline lives (it is not moved here). Initial noise is drawn from
    CPU generators (``generator_device``) so that a seed gives the same starting latents on every
    device class. ``batch_invariant`` patches the pipeline's Linear and Conv2d modules in place
    (see :mod:`pipeline.invariance`) so that batch-mates never change an image's pixels.
    """

    def __init__(self, pipe: DiffusionPipeline, *, device: str = "cpu", model: str,
                 generator_device: str = "cpu", batch_invariant: bool = True) -> None:
        self.pipe = pipe
        self.device = device
        self.model = model
        self.generator_device = generator_device
        self.batch_invariant = batch_invariant
        self._make_invariant()

    def _make_invariant(self) -> None:
        # Cheap and idempotent: also catches modules swapped in after construction (e.g. fused QKV).
        if self.batch_invariant:
            for component in self.pipe.components.values():
                if isinstance(component, torch.nn.Module):
                    make_batch_invariant(component)

    def warmup(self, *, width: int = 64, height: int = 64, num_inference_steps: int = 1) -> float:
        """Render one small image to load kernels and allocators; returns the wall time in seconds."""
        started = time.perf_counter()
        self.render([RenderRequest(prompt="warmup", model=self.model, seed=0, width=width, height=height,
                                   num_inference_steps=num_inference_steps)])
        return time.perf_counter() - started

    def render(
        self, requests: Sequence[RenderRequest], on_step: Callable[[int, int], None] | None = None
    ) -> list[PIL.Image.Image]:
        """Render ``requests`` in one pipeline call; returns RGB PIL images (width × height) in order.

        ``on_step(done, total)`` is called after each denoising iteration, ``done`` = 1 … ``total``
        (``total`` = ``num_inference_steps`` for single-stage schedulers).

        Raises:
            ValueError: the requests have different :func:`compat_key`, a seed is missing, or a
                request names another model than this renderer's.
        """
        if not requests:
            return []
        keys = {compat_key(r) for r in requests}
        if len(keys) > 1:
            raise ValueError(f"requests in one render call must share a compat key, got {sorted(keys, key=str)}")
        if any(r.seed is None for r in requests):
            raise ValueError("every request needs a seed (the producer assigns one)")
        first = requests[0]
        if first.model not in (None, self.model):
            raise ValueError(f"request for model {first.model!r} sent to a renderer of {self.model!r}")

        self._make_invariant()
        pipe = self.pipe
        pipe.scheduler = scheduler_for(pipe, first.scheduler)
        generators = [torch.Generator(self.generator_device).manual_seed(r.seed) for r in requests]

        def step_end(pipeline, step_index, timestep, callback_kwargs):
            if on_step is not None:
                on_step(step_index + 1, pipeline.num_timesteps)
            return callback_kwargs

        with torch.inference_mode():
            result = pipe(
                prompt=[r.prompt for r in requests],
                negative_prompt=[r.negative_prompt for r in requests],
                width=first.width,
                height=first.height,
                num_inference_steps=first.num_inference_steps,
                guidance_scale=first.guidance_scale,
                generator=generators,
                output_type="pil",
                callback_on_step_end=step_end,
            )
        return list(result.images)
