"""Out of memory, injected on the CPU: in the denoiser (the batch is split outside the except
block, the cap is lowered for that shape only and recovers), and in the VAE decode alone (the
batch is decoded one image at a time and its denoising steps are kept)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infra.schemas import RenderRequest
from pipeline.memory import BatchLimits, PeakMeasurement, batch_size_for_stages, split_on_oom
from pipeline.render import Renderer, compat_key


@pytest.fixture(scope="module")
def renderers(offline_cache):
    from pipeline.models import load_pipeline

    return {m: Renderer(load_pipeline(m, cache_dir=offline_cache), model=m) for m in ("tiny", "tiny-flux")}


def _requests(model: str, n: int, **kw) -> list[RenderRequest]:
    fields = {"width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": 0.0, **kw}
    return [RenderRequest(prompt=f"prompt {i}", seed=100 + i, model=model, **fields) for i in range(n)]


class _OomAbove:
    """A forward pre-hook raising torch.OutOfMemoryError when the batch is larger than ``limit``."""

    def __init__(self, module, limit: int):
        self.limit, self.calls = limit, []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        x = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        self.calls.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at batch {x.shape[0]})")


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_denoiser_oom_splits_lowers_that_shape_and_recovers(renderers, model):
    renderer = renderers[model]
    requests = _requests(model, 4)
    key, other = compat_key(requests[0]), compat_key(_requests(model, 1, num_inference_steps=3)[0])
    reference = [np.asarray(im) for im in renderer.render(requests)]
    denoiser = getattr(renderer.pipe, renderer.denoiser_name)
    limits = BatchLimits(recover_after=4)
    oom = _OomAbove(denoiser, 2)
    try:
        images, largest = split_on_oom(renderer.render, requests, limits, key)
    finally:
        oom.handle.remove()
    assert largest == 2 and oom.calls[0] == 4 and max(oom.calls[1:]) == 2  # 4 failed, then halves of 2
    assert [np.array_equal(np.asarray(a), b) for a, b in zip(images, reference)] == [True] * 4  # invariant on CPU
    assert limits.cap(key, 4) == 2 and limits.cap(other, 4) == 4  # only the shape that failed
    _, largest = split_on_oom(renderer.render, requests, limits, key)  # renders in chunks of the cap
    assert largest == 2  # 4 successes at the cap (2 halves, 2 chunks): it doubles back to 4, and is lifted
    assert limits.cap(key, 4) == 4 and limits.snapshot() == {}


def test_a_single_image_that_still_runs_out_of_memory_raises(renderers):
    renderer = renderers["tiny"]
    oom = _OomAbove(renderer.pipe.unet, 0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            split_on_oom(renderer.render, _requests("tiny", 2), BatchLimits(), "k")
    finally:
        oom.handle.remove()


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_vae_decode_oom_decodes_one_image_at_a_time_and_keeps_the_steps(renderers, model):
    renderer = renderers[model]
    requests = _requests(model, 3)
    reference = [np.asarray(im) for im in renderer.render(requests)]
    denoiser = getattr(renderer.pipe, renderer.denoiser_name)
    steps = _OomAbove(denoiser, 99)  # counts the denoiser's calls, never raises
    oom = _OomAbove(renderer.pipe.vae.decoder, 1)
    before = getattr(renderer.pipe.vae, "_renderfarm_sliced_decodes", 0)
    try:
        images = renderer.render(requests)
    finally:
        oom.handle.remove()
        steps.handle.remove()
    assert steps.calls == [3, 3]  # two denoising steps, each run once: the OOM in the decode kept them
    assert oom.calls == [3, 1, 1, 1] and renderer.pipe.vae._renderfarm_sliced_decodes == before + 1
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(images, reference))


def test_batch_limits_arithmetic():
    limits = BatchLimits(recover_after=3)
    assert limits.lowered("a", 8) == 4 and limits.lowered("a", 4) == 2 and limits.cap("a", 8) == 2
    limits.succeeded("a", 1)  # below the cap: does not count
    for _ in range(3):
        limits.succeeded("a", 2)
    assert limits.cap("a", 8) == 4
    for _ in range(3):
        limits.succeeded("a", 4)
    assert limits.cap("a", 8) == 8 and limits.snapshot() == {}  # back to the size that first failed
    with pytest.raises(ValueError):
        BatchLimits(recover_after=0)


def test_the_upscale_stage_can_bound_the_batch():
    gib = 2**30
    diffusion = PeakMeasurement(base_bytes=2 * gib, per_image_bytes=1 * gib)
    upscaled = PeakMeasurement(base_bytes=2 * gib, per_image_bytes=3 * gib)  # e.g. ×4 of a large image
    assert batch_size_for_stages([diffusion], 16 * gib, 0.9) == 12  # (14.4 - 2) // 1
    assert batch_size_for_stages([diffusion, upscaled], 16 * gib, 0.9) == 4  # (14.4 - 2) // 3
    assert batch_size_for_stages([diffusion, upscaled], 16 * gib, 0.9, cap=2) == 2
    with pytest.raises(ValueError, match="at least one"):
        batch_size_for_stages([], 16 * gib, 0.9)


def test_sizing_renders_each_declared_upscaler_after_the_diffusion():
    from pipeline.sizing import batch_size_from_memory
    from pipeline.warm import PoolOptions, prepare_renderer

    pool = PoolOptions(max_pixels=64 * 64, steps=1, upscalers=("tiny-esrgan-x4", "tiny-sd-x4-upscaler"))
    renderer, profile = prepare_renderer("tiny", "cpu", "exact", pool=pool)
    seen: list[tuple] = []
    render = renderer.render

    def recording(requests, on_step=None):
        seen.append((len(requests), requests[0].width, requests[0].upscale, requests[0].upscaler))
        return render(requests, on_step)

    renderer.render = recording  # type: ignore[method-assign]
    tight = {**profile, "total_memory_bytes": 1 << 30}  # too little for the one-image bound: 1 and 2 images
    assert batch_size_from_memory(renderer, tight) == 1
    assert sorted(seen, key=str) == sorted([(n, 64, up, name) for n in (1, 2) for up, name in
                                            ((None, None), (4, "tiny-esrgan-x4"), (4, "tiny-sd-x4-upscaler"))], key=str)
    assert set(renderer.upscale._nets) == {"tiny-esrgan-x4", "tiny-sd-x4-upscaler"}  # loaded and run at warm-up


def test_lru_victims_evict_the_least_recent_until_one_more_fits_and_never_what_is_kept():
    from pipeline.memory import lru_victims

    sizes = {"a": 10, "b": 20, "c": 30}  # least recently used first
    assert lru_victims(sizes, 5, max_count=4, max_bytes=100) == []
    assert lru_victims(sizes, 5, max_count=3, max_bytes=100) == ["a"]  # the count bound
    assert lru_victims(sizes, 45, max_count=4, max_bytes=100) == ["a"]  # 60 + 45 > 100, 50 + 45 fits
    assert lru_victims(sizes, 75, max_count=4, max_bytes=100) == ["a", "b", "c"]  # 30 + 75 > 100 still
    assert lru_victims(sizes, 45, max_count=4, max_bytes=100, keep=["a"]) == ["b"]  # 40 + 45 fits
    assert lru_victims(sizes, 95, max_count=4, max_bytes=100, keep=["a", "b", "c"]) == []  # over, but kept
