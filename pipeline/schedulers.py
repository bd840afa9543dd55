"""Scheduler names of :data:`infra.schemas.SchedulerName` → diffusers scheduler instances.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. A request
names a scheduler; :class:`pipeline.render.Renderer` swaps it into the warm pipeline before the
group's one pipeline call. Instances are built once per pipeline from the pipeline's own
scheduler config (so betas, offsets and prediction type stay the model's) and then reused.
"""

from __future__ import annotations

import weakref
from typing import Any, get_args

from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from infra.schemas import SchedulerName
from pipeline.scheduling import is_precomputed, precompute_scheduler, unsupported_reason

_UNIFORM, _KARRAS = {"use_karras_sigmas": False}, {"use_karras_sigmas": True}
_DPMPP_2M = {"algorithm_type": "dpmsolver++", "solver_order": 2}
_DPMPP_2M_SDE = {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}

#: name → (scheduler class, config overrides). ``default`` is absent: it keeps the pipeline's own.
#: The overrides are also what tells the names apart (:func:`scheduler_name`): ``_karras`` is the
#: Karras noise schedule (Karras et al., "Elucidating the Design Space of Diffusion-Based
#: Generative Models", NeurIPS 2022), as A1111's "… Karras" samplers use it.
SCHEDULERS: dict[str, tuple[type[Any], dict]] = {
    "ddim": (DDIMScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
    "euler": (EulerDiscreteScheduler, _UNIFORM),
    "euler_ancestral": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {**_DPMPP_2M, **_UNIFORM}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler, {**_DPMPP_2M, **_KARRAS}),
    "dpmpp_2m_sde": (DPMSolverMultistepScheduler, {**_DPMPP_2M_SDE, **_UNIFORM}),
    "dpmpp_2m_sde_karras": (DPMSolverMultistepScheduler, {**_DPMPP_2M_SDE, **_KARRAS}),
    "lms": (LMSDiscreteScheduler, _UNIFORM),  # needs scipy
    "lms_karras": (LMSDiscreteScheduler, _KARRAS),
    "heun": (HeunDiscreteScheduler, _UNIFORM),
    "dpm2": (KDPM2DiscreteScheduler, _UNIFORM),
    "dpm2_karras": (KDPM2DiscreteScheduler, _KARRAS),
    "dpm2_ancestral": (KDPM2AncestralDiscreteScheduler, _UNIFORM),
    "dpm2_ancestral_karras": (KDPM2AncestralDiscreteScheduler, _KARRAS),
    "unipc": (UniPCMultistepScheduler, {}),
    "lcm": (LCMScheduler, {}),
}
assert set(SCHEDULERS) | {"default"} == set(get_args(SchedulerName)), "SCHEDULERS out of sync with SchedulerName"

# pipeline → {name: scheduler}; "default" is recorded on first sight, before any swap.
_CACHE: "weakref.WeakKeyDictionary[DiffusionPipeline, dict]" = weakref.WeakKeyDictionary()


def scheduler_for(pipe: DiffusionPipeline, name: str):
    """The scheduler instance for ``name`` on ``pipe`` (cached per pipeline; not yet installed).

    ``"default"`` is the scheduler the pipeline was loaded with, even after others were swapped in.
    When that one is a precomputed twin (the recipe's ``scheduler_precompute``), a named
    scheduler that has a twin (DDIM, PNDM, Euler) gets its twin too: on an H100 the stock DDIM
    and PNDM synchronized the host 16 and 11 times in a 16-step render (``alphas_cumprod[t]`` with
    a device ``t``), their twins do not (:mod:`pipeline.scheduling`).

    Raises:
        ValueError: unknown ``name``, or its scheduler cannot be built here (e.g. ``lms`` without scipy).
    """
    cache = _CACHE.setdefault(pipe, {"default": pipe.scheduler})
    if name not in cache:
        if name not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {name!r}; known: default, {', '.join(SCHEDULERS)}")
        cls, overrides = SCHEDULERS[name]
        try:
            scheduler = cls.from_config(cache["default"].config, **overrides)
        except ImportError as exc:
            raise ValueError(f"scheduler {name!r} is unavailable on this worker: {exc}") from exc
        if is_precomputed(cache["default"]) and unsupported_reason(scheduler) is None:
            scheduler = precompute_scheduler(scheduler)
        cache[name] = scheduler
    return cache[name]


def scheduler_name(scheduler) -> str:
    """The farm's name for a scheduler instance: the first :data:`SCHEDULERS` entry whose class
    it is (precomputed twins included) and whose overrides its config matches; else its class
    name (e.g. ``FlowMatchEulerDiscreteScheduler``), which the A1111 infotext shows as it is."""
    config = getattr(scheduler, "config", {})
    for name, (cls, overrides) in SCHEDULERS.items():
        if isinstance(scheduler, cls) and all(config.get(key) == value for key, value in overrides.items()):
            return name
    return type(scheduler).__name__
