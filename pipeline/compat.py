"""Which render requests can share one pipeline call: :func:`compat_key`.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. The worker
groups the jobs it pulled by this key before any renderer sees them; kept apart from
:mod:`pipeline.render` and free of torch and diffusers, so that a worker of the null model (and
anything else that only batches) does not import them.
"""

from __future__ import annotations

from typing import Any

from infra.schemas import RenderRequest

CompatKey = tuple[Any, ...]  # (model, width, height, steps, guidance, scheduler[, upscale, upscaler][, mode][, units])


def compat_key(request: RenderRequest) -> CompatKey:
    """``(model, width, height, num_inference_steps, guidance_scale, scheduler)``, followed by
    ``(upscale, upscaler)`` for a request that asks for upscaling, and by
    ``((mode, strength, adapters),)`` for an img2img or inpainting request or one with adapters
    (``adapters``: the sorted ``(name, weight)`` pairs; :mod:`pipeline.modes`), and by
    ``(("controls", units),)`` for a request with ControlNet units (``units``: each unit's
    ``(type, preprocess)``, in order: the ControlNets of one call), and by
    ``(("video", num_frames, fps, mode),)`` for a video (never grouped with images, nor with
    other frame counts: one pipeline call renders one clip shape).

    Requests with equal keys can share one pipeline call (and one upscale batch); prompts,
    negative prompts, seeds, input and control images may differ. Control weights and guidance
    ranges may differ too: the renderer makes one call per distinct setting
    (:mod:`pipeline.controlnet`; diffusers' ``controlnet_conditioning_scale`` is per ControlNet,
    not per image).
    """
    r = request
    key: CompatKey = (r.model, r.width, r.height, r.num_inference_steps, r.guidance_scale, r.scheduler)
    if r.upscale is not None:
        key = (*key, r.upscale, r.upscaler)
    if r.mode != "txt2img" or r.loras:
        key = (*key, (r.mode, r.effective_strength, tuple(sorted((a.name, a.weight) for a in r.loras))))
    if r.controls:
        key = (*key, ("controls", tuple(unit.kind for unit in r.controls)))
    if r.is_video:
        key = (*key, ("video", r.num_frames, r.fps, r.mode))
    return key
