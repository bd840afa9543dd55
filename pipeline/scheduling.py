"""Scheduler precomputation: per-step constants computed once, on the device, before the loop.

Place in the data flow: worker → recipe → :func:`pipeline.optimize.apply_recipe` replaces the
pipeline's scheduler with its precomputed twin (recipe knob ``scheduler_precompute``, exact) →
:class:`pipeline.render.Renderer` runs the denoising loop with it.

Why (the PaddlePaddle ERNIE-ViLG 2.0 inference article, PPDiffusers: "pre-computed parameters
remove CPU work and GPU-CPU synchronization during sampling loops"): the stock diffusers schedulers
derive their per-step scalars inside ``step`` from the timestep *value*, which the pipeline passes as a device tensor.
That costs host-device synchronizations on every step of the loop on CUDA:

* ``DDIMScheduler`` / ``PNDMScheduler``: ``alphas_cumprod[timestep]`` indexes a CPU table with a
  device tensor, and ``prev_timestep >= 0`` turns a device tensor into a Python bool;
* ``EulerDiscreteScheduler``: the first ``step`` finds its index with
  ``(timesteps == t).nonzero()`` and ``.item()``; ``sigmas`` are kept on the CPU.

The twins here compute every per-step scalar once in ``set_timesteps`` with the *same formulas
in the same float32 arithmetic* as the stock code, move the tables to the device, and select
row ``i`` with a host-side step counter. The update itself keeps the stock code's operation
order, so on the CPU the pixels are bit-identical to the stock scheduler's (the tests compare
PSNR = inf), and on CUDA the loop has no host-device synchronization left in the scheduler.

Supported (anything else keeps the stock scheduler, and the report says why):

* ``DDIMScheduler`` with ``eta == 0`` (the pipelines' default), any prediction type, clipping
  or thresholding;
* ``PNDMScheduler`` with ``skip_prk_steps`` (PLMS, as Stable Diffusion 1.x ships it);
* ``EulerDiscreteScheduler`` without churn (``s_churn == 0``, the default).

Contract: a twin expects the pipeline to step through ``scheduler.timesteps`` in order from the
first (text-to-image). When the timestep passed is a host value (a Python number or a CPU
tensor) it is checked against the table, and any other use falls back to the stock ``step``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler
from diffusers.configuration_utils import FrozenDict

_ATTR = "_renderfarm_precomputed"


class _Precomputed:
    """Mixin: per-step constants as device tensors, selected by a host-side step counter.

    Subclasses implement ``_tables(device) -> dict[str, Tensor]`` (one row per step of
    ``self.timesteps``) and use ``self._row(name)`` inside ``step``.
    """

    _pc_tables: dict[str, torch.Tensor] | None = None
    _pc_timesteps: np.ndarray | None = None
    _pc_index: int = 0
    timesteps: torch.Tensor  # set by the diffusers scheduler this mixin is combined with

    if TYPE_CHECKING:

        def _tables(self) -> dict[str, torch.Tensor]: ...

    def set_timesteps(self, num_inference_steps=None, device=None, *args, **kwargs):
        super().set_timesteps(num_inference_steps, device, *args, **kwargs)  # type: ignore[misc]  # diffusers' method
        target = device if device is not None else self.timesteps.device
        self._pc_timesteps = self.timesteps.detach().cpu().numpy()  # host copy, read once here
        self._pc_tables = {k: v.to(target) for k, v in self._tables().items()}
        self._pc_index = 0

    def _on_schedule(self, timestep) -> bool:
        """Whether ``timestep`` is the one the counter expects. Device tensors are trusted (reading
        them would synchronize); host values are checked."""
        if self._pc_tables is None or self._pc_timesteps is None or self._pc_index >= len(self._pc_timesteps):
            return False
        if isinstance(timestep, torch.Tensor):
            if timestep.device.type != "cpu":
                return True
            timestep = timestep.item()
        return float(timestep) == float(self._pc_timesteps[self._pc_index])

    def _row(self, name: str) -> torch.Tensor:
        return cast("dict[str, torch.Tensor]", self._pc_tables)[name][self._pc_index]  # set by set_timesteps


def _f32(values) -> torch.Tensor:
    return torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in values])


class PrecomputedDDIMScheduler(_Precomputed, DDIMScheduler):
    """``DDIMScheduler`` (eta = 0) with its per-step alphas precomputed on the device."""

    def _tables(self) -> dict[str, torch.Tensor]:
        ratio = self.config.num_train_timesteps // self.num_inference_steps
        a_t_list: list[Any] = []
        a_prev_list: list[Any] = []
        for t in self.timesteps.cpu().tolist():
            prev = t - ratio
            a_t_list.append(self.alphas_cumprod[t])
            a_prev_list.append(self.alphas_cumprod[prev] if prev >= 0 else self.final_alpha_cumprod)
        a_t, a_prev = _f32(a_t_list), _f32(a_prev_list)
        b_t = 1 - a_t  # the stock code's expressions, element-wise, in float32
        return {"sqrt_a": a_t ** 0.5, "sqrt_b": b_t ** 0.5, "sqrt_a_prev": a_prev ** 0.5,
                "dir": (1 - a_prev - 0.0 ** 2) ** 0.5}

    def step(self, model_output, timestep, sample, eta: float = 0.0, use_clipped_model_output: bool = False,
             generator=None, variance_noise=None, return_dict: bool = True):
        if eta != 0.0 or not self._on_schedule(timestep):
            return super().step(model_output, timestep, sample, eta, use_clipped_model_output, generator,
                                variance_noise, return_dict)
        sqrt_a, sqrt_b = self._row("sqrt_a"), self._row("sqrt_b")
        kind = self.config.prediction_type
        if kind == "epsilon":
            x0 = (sample - sqrt_b * model_output) / sqrt_a
            eps = model_output
        elif kind == "sample":
            x0 = model_output
            eps = (sample - sqrt_a * x0) / sqrt_b
        elif kind == "v_prediction":
            x0 = sqrt_a * sample - sqrt_b * model_output
            eps = sqrt_a * model_output + sqrt_b * sample
        else:
            return super().step(model_output, timestep, sample, eta, use_clipped_model_output, generator,
                                variance_noise, return_dict)
        if self.config.thresholding:
            x0 = self._threshold_sample(x0)
        elif self.config.clip_sample:
            x0 = x0.clamp(-self.config.clip_sample_range, self.config.clip_sample_range)
        if use_clipped_model_output:
            eps = (sample - sqrt_a * x0) / sqrt_b
        prev = self._row("sqrt_a_prev") * x0 + self._row("dir") * eps
        self._pc_index += 1
        if not return_dict:
            return (prev, x0)
        from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput

        return DDIMSchedulerOutput(prev_sample=prev, pred_original_sample=x0)


class PrecomputedPNDMScheduler(_Precomputed, PNDMScheduler):
    """``PNDMScheduler`` in PLMS mode (``skip_prk_steps``) with formula (9)'s coefficients
    precomputed on the device; the multistep history (``ets``) is kept as the stock code does."""

    ets: list[torch.Tensor]  # the stock PNDMScheduler's history, set in its __init__

    def _tables(self) -> dict[str, torch.Tensor]:
        ratio = self.config.num_train_timesteps // self.num_inference_steps
        a_t_list: list[Any] = []
        a_prev_list: list[Any] = []
        for counter, t in enumerate(self.timesteps.cpu().tolist()):
            prev = t - ratio
            if counter == 1:  # the stock step_plms re-evaluates the first step at (t + ratio → t)
                t, prev = t + ratio, t
            a_t_list.append(self.alphas_cumprod[t])
            a_prev_list.append(self.alphas_cumprod[prev] if prev >= 0 else self.final_alpha_cumprod)
        a_t, a_prev = _f32(a_t_list), _f32(a_prev_list)
        b_t, b_prev = 1 - a_t, 1 - a_prev
        return {"sqrt_a": a_t ** 0.5, "sqrt_b": b_t ** 0.5, "sample_coeff": (a_prev / a_t) ** 0.5,
                "diff": a_prev - a_t, "denom": a_t * b_prev ** 0.5 + (a_t * b_t * a_prev) ** 0.5}

    def step(self, model_output, timestep, sample, return_dict: bool = True):
        if not self.config.skip_prk_steps or self.counter != self._pc_index or not self._on_schedule(timestep):
            return super().step(model_output, timestep, sample, return_dict)
        if self.counter != 1:
            self.ets = self.ets[-3:]
            self.ets.append(model_output)
        if len(self.ets) == 1 and self.counter == 0:
            self.cur_sample = sample
        elif len(self.ets) == 1 and self.counter == 1:
            model_output = (model_output + self.ets[-1]) / 2
            sample = self.cur_sample
            self.cur_sample = None
        elif len(self.ets) == 2:
            model_output = (3 * self.ets[-1] - self.ets[-2]) / 2
        elif len(self.ets) == 3:
            model_output = (23 * self.ets[-1] - 16 * self.ets[-2] + 5 * self.ets[-3]) / 12
        else:
            model_output = (1 / 24) * (55 * self.ets[-1] - 59 * self.ets[-2] + 37 * self.ets[-3] - 9 * self.ets[-4])
        if self.config.prediction_type == "v_prediction":
            model_output = self._row("sqrt_a") * model_output + self._row("sqrt_b") * sample
        prev = self._row("sample_coeff") * sample - self._row("diff") * model_output / self._row("denom")
        self.counter += 1
        self._pc_index += 1
        if not return_dict:
            return (prev,)
        from diffusers.schedulers.scheduling_utils import SchedulerOutput

        return SchedulerOutput(prev_sample=prev)


class PrecomputedEulerDiscreteScheduler(_Precomputed, EulerDiscreteScheduler):
    """``EulerDiscreteScheduler`` (no churn) with sigmas, step sizes and input scales on the device."""

    def _tables(self) -> dict[str, torch.Tensor]:
        sigmas = self.sigmas.detach().cpu().to(torch.float32)
        sigma, nxt = sigmas[:-1], sigmas[1:]
        return {"sigma": sigma, "dt": nxt - sigma, "scale": (sigma ** 2 + 1) ** 0.5,
                "v_out": -sigma / (sigma ** 2 + 1) ** 0.5, "v_skip": sigma ** 2 + 1}

    def set_timesteps(self, *args, **kwargs):
        super().set_timesteps(*args, **kwargs)
        if self.begin_index is not None:  # image-to-image pipelines start mid-schedule
            self._pc_index = self.begin_index

    def scale_model_input(self, sample, timestep):
        if not self._on_schedule(timestep):
            return super().scale_model_input(sample, timestep)
        self.is_scale_input_called = True
        return sample / self._row("scale")

    def step(self, model_output, timestep, sample, s_churn: float = 0.0, s_tmin: float = 0.0,
             s_tmax: float = float("inf"), s_noise: float = 1.0, generator=None, return_dict: bool = True):
        kind = self.config.prediction_type
        if s_churn != 0.0 or kind not in ("epsilon", "v_prediction", "sample", "original_sample") \
                or not self._on_schedule(timestep):
            return super().step(model_output, timestep, sample, s_churn, s_tmin, s_tmax, s_noise, generator,
                                return_dict)
        sample = sample.to(torch.float32)
        sigma_hat = self._row("sigma") * (0.0 + 1)  # gamma = 0 without churn, as the stock code computes it
        if kind == "epsilon":
            x0 = sample - sigma_hat * model_output
        elif kind == "v_prediction":
            x0 = model_output * self._row("v_out") + (sample / self._row("v_skip"))
        else:
            x0 = model_output
        derivative = (sample - x0) / sigma_hat
        prev = (sample + derivative * self._row("dt")).to(model_output.dtype)
        self._pc_index += 1
        self._step_index = self._pc_index
        if not return_dict:
            return (prev, x0)
        from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteSchedulerOutput

        return EulerDiscreteSchedulerOutput(prev_sample=prev, pred_original_sample=x0)


#: stock class → precomputed twin
TWINS: dict[type, type[Any]] = {
    DDIMScheduler: PrecomputedDDIMScheduler,
    PNDMScheduler: PrecomputedPNDMScheduler,
    EulerDiscreteScheduler: PrecomputedEulerDiscreteScheduler,
}


def is_precomputed(scheduler) -> bool:
    """Whether ``scheduler`` is one of the precomputed twins."""
    return bool(getattr(scheduler, _ATTR, False))


def unsupported_reason(scheduler) -> str | None:
    """Why ``scheduler`` has no precomputed twin, or None when it has one."""
    cls = type(scheduler)
    if getattr(scheduler, _ATTR, False):
        return None
    if cls.__name__ == "FlowMatchEulerDiscreteScheduler":
        return "FlowMatchEulerDiscreteScheduler keeps its sigmas on the device: sync-free without a twin"
    if cls not in TWINS:
        return f"{cls.__name__} has no precomputed twin (supported: {', '.join(c.__name__ for c in TWINS)})"
    if cls is PNDMScheduler and not scheduler.config.skip_prk_steps:
        return "PNDMScheduler with PRK steps (skip_prk_steps=False) is not precomputed"
    if cls is EulerDiscreteScheduler and getattr(scheduler.config, "timestep_type", "discrete") != "discrete":
        return "EulerDiscreteScheduler with continuous timesteps is not precomputed"
    return None


def precompute_scheduler(scheduler):
    """The precomputed twin of ``scheduler`` (same config, so the same timesteps and math), or
    ``scheduler`` itself when it is already one.

    Raises:
        ValueError: ``scheduler`` is not supported (see :func:`unsupported_reason`).
    """
    if getattr(scheduler, _ATTR, False):
        return scheduler
    reason = unsupported_reason(scheduler)
    if reason:
        raise ValueError(reason)
    base = type(scheduler)
    twin = TWINS[base].from_config(scheduler.config)
    # keep the stock class name in the config, so save_pretrained writes a loadable scheduler
    twin._internal_dict = FrozenDict({**twin.config, "_class_name": base.__name__})
    setattr(twin, _ATTR, True)
    return twin
