"""Scheduler names of :data:`infra.schemas.SchedulerName` → diffusers scheduler instances.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. A request
names a scheduler; :class:`pipeline.render.Renderer` swaps it into the warm pipeline before the
group's one pipeline call. Instances are built once per pipeline from the pipeline's own
scheduler config (so betas, offsets and prediction type stay the model's) and then reused.
"""

from __future__ import annotations

import weakref
from typing import get_args

from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from infra.schemas import SchedulerName
from pipeline.scheduling import is_precomputed, precompute_scheduler, unsupported_reason

#: name → (scheduler class, config overrides). ``default`` is absent: it keeps the pipeline's own.
SCHEDULERS: dict[str, tuple[type, dict]] = {
    "ddim": (DDIMScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_ancestral": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "lms": (LMSDiscreteScheduler, {}),  # needs scipy
    "heun": (HeunDiscreteScheduler, {}),
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
