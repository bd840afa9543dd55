"""pipeline.scheduling: the precomputed twins give the stock schedulers' samples bit for bit,
use their tables (not the stock step), fall back when used off-schedule, and (on CUDA) run
the loop without a host-device synchronization."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, PNDMScheduler

from pipeline.models import SD_BETAS
from pipeline.scheduling import precompute_scheduler, unsupported_reason

CONFIGS = [
    (DDIMScheduler, {**SD_BETAS, "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1,
                     "timestep_spacing": "trailing"}),  # the tiny model's
    (DDIMScheduler, {**SD_BETAS}),  # clip_sample on
    (DDIMScheduler, {**SD_BETAS, "prediction_type": "v_prediction"}),
    (PNDMScheduler, {**SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1}),  # SD 1.5
    (PNDMScheduler, {**SD_BETAS, "skip_prk_steps": True, "prediction_type": "v_prediction"}),
    (EulerDiscreteScheduler, {**SD_BETAS, "steps_offset": 1, "timestep_spacing": "trailing"}),  # sd-turbo
    (EulerDiscreteScheduler, {**SD_BETAS, "prediction_type": "v_prediction", "use_karras_sigmas": True}),
]


def denoise(scheduler, steps: int, device: str = "cpu") -> torch.Tensor:
    """A fixed fake denoiser through ``scheduler``'s loop, as the SD pipelines drive it."""
    generator = torch.Generator("cpu").manual_seed(0)
    scheduler.set_timesteps(steps, device=device)
    x = (torch.randn(2, 4, 8, 8, generator=generator) * scheduler.init_noise_sigma).to(device)
    for t in scheduler.timesteps:
        inp = scheduler.scale_model_input(x, t)
        eps = torch.tanh(inp * 0.7 + t.float() / 1000)
        x = scheduler.step(eps, t, x, return_dict=False)[0]
    return x


@pytest.mark.parametrize("cls, config", CONFIGS, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_twin_is_bit_identical_to_the_stock_scheduler(cls, config, steps):
    twin = precompute_scheduler(cls(**config))
    assert torch.equal(denoise(cls(**config), steps), denoise(twin, steps))
    assert twin._pc_index == len(twin.timesteps)  # every step took the precomputed path
    assert type(twin).__mro__[2] is cls and twin.config["_class_name"] == cls.__name__


def test_off_schedule_calls_fall_back_to_the_stock_step():
    config = CONFIGS[0][1]
    stock, twin = DDIMScheduler(**config), precompute_scheduler(DDIMScheduler(**config))
    for s in (stock, twin):
        s.set_timesteps(4)
    x, eps = torch.ones(1, 4, 2, 2), torch.full((1, 4, 2, 2), 0.5)
    t = int(stock.timesteps[2])  # not the first timestep: the twin must not use its row 0
    assert torch.equal(stock.step(eps, t, x).prev_sample, twin.step(eps, t, x).prev_sample)
    assert twin._pc_index == 0


def test_unsupported_schedulers_say_why():
    assert "no precomputed twin" in unsupported_reason(EulerAncestralDiscreteScheduler(**SD_BETAS))
    assert "PRK" in unsupported_reason(PNDMScheduler(**SD_BETAS))
    with pytest.raises(ValueError):
        precompute_scheduler(PNDMScheduler(**SD_BETAS))
    twin = precompute_scheduler(DDIMScheduler(**SD_BETAS))
    assert precompute_scheduler(twin) is twin and unsupported_reason(twin) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls, config", CONFIGS, ids=lambda v: getattr(v, "__name__", ""))
def test_no_host_device_sync_in_the_loop_on_cuda(cls, config):
    twin = precompute_scheduler(cls(**config))
    twin.set_timesteps(4, device="cuda")
    x = torch.randn(1, 4, 8, 8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in twin.timesteps:
            x = twin.step(twin.scale_model_input(x, t), t, x, return_dict=False)[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
