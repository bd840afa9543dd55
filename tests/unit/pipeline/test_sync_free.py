"""No host-device synchronization inside the denoising loop, for every scheduler a request may name
and the flow-matching schedulers of SD3 / FLUX / ERNIE-Image.

On this machine the loop runs on the ``meta`` device under :class:`pipeline.sync_free.SyncSpy`
(every scalar read, ``nonzero`` and blocking host↔device copy is recorded). With CUDA present,
``torch.cuda.set_sync_debug_mode("error")`` is armed for the denoising loop of real renders."""

from __future__ import annotations

import pytest
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from pipeline.models import configs
from pipeline.schedulers import SCHEDULERS
from pipeline.scheduling import precompute_scheduler, unsupported_reason
from pipeline.sync_free import SyncSpy, install_pinned_noise, spy_scheduler_loop

BASE = EulerDiscreteScheduler(**configs.EULER_TURBO).config


def _scheduler(name: str):
    cls, overrides = SCHEDULERS[name]
    scheduler = cls.from_config(BASE, **overrides)
    return precompute_scheduler(scheduler) if unsupported_reason(scheduler) is None else scheduler


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("steps", [1, 4])
def test_every_request_scheduler_loops_without_a_sync(name, steps):
    assert spy_scheduler_loop(_scheduler(name), steps) == []


@pytest.mark.parametrize("config, host", [(configs.FLOW_SD3, False), (configs.FLOW_FLUX_SCHNELL, False),
                                          (configs.FLOW_ERNIE, True)], ids=["sd3", "flux", "ernie-image"])
def test_flow_matching_loops_without_a_sync(config, host):
    assert spy_scheduler_loop(FlowMatchEulerDiscreteScheduler(**config), 4, host_timesteps=host, channels=16) == []


def test_the_spy_sees_what_the_stock_code_does():
    from diffusers import DPMSolverMultistepScheduler

    stock = DPMSolverMultistepScheduler.from_config(BASE)  # no begin index: the first step looks itself up
    stock.set_timesteps(2, device="meta")
    with SyncSpy() as spy:
        stock.step(torch.zeros(1, 4, 8, 8, device="meta"), stock.timesteps[0], torch.zeros(1, 4, 8, 8, device="meta"))
    # diffusers' index_for_timestep: (timesteps == t).nonzero(), then .item() of the index
    assert [e.split(" ")[0] for e in spy.events] == ["aten.nonzero.default", "aten._local_scalar_dense.default"]
    with SyncSpy() as spy:
        torch.tensor([0.5, 1.0], device="meta")
        torch.ones(3).to("meta")
    assert len(spy.events) == 2


def test_pinned_noise_draws_the_same_numbers():
    from diffusers.utils import torch_utils

    install_pinned_noise()
    original = torch_utils._renderfarm_original_randn
    from diffusers.schedulers import scheduling_euler_ancestral_discrete as ancestral

    gens = lambda: [torch.Generator().manual_seed(s) for s in (3, 4)]  # noqa: E731
    assert ancestral.randn_tensor is not original  # patched where the schedulers call it
    assert torch.equal(ancestral.randn_tensor((2, 4, 8, 8), generator=gens(), device="cpu"),
                       original((2, 4, 8, 8), generator=gens(), device="cpu"))
    meta = ancestral.randn_tensor((2, 4, 8, 8), generator=gens(), device=torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (2, 4, 8, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("model", ["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-ernie-image"])
def test_no_sync_in_the_denoising_loop_on_cuda(offline_cache, model):
    from bench.pipeline.gpu_checks import syncs_in_loop

    for scheduler in (["default", *SCHEDULERS] if model in ("tiny", "tiny-sdxl") else ["default"]):
        assert syncs_in_loop(model, scheduler, offline_cache) == 0, scheduler
