"""Video recipes (per device, as data), step caching (diffusers' First Block Cache) on the tiny
builds, the worker's start-up steps with a video renderer, and the full-size Wan / LTX-Video
configs counted on the ``meta`` device."""

from __future__ import annotations

import numpy as np
import pytest

from infra.schemas import RenderRequest
from infra.video import frames_of
from pipeline.device import GB, DeviceProfile
from pipeline.models import OFFLINE_MODELS, parameter_counts
from pipeline.video.recipes import video_recipe

CPU = DeviceProfile(kind="cpu", name="cpu", total_memory_bytes=24 * GB, cpu_cores=2)


def cuda(gb: float) -> DeviceProfile:
    return DeviceProfile(kind="cuda", name="gpu", total_memory_bytes=int(gb * GB), compute_capability=(9, 0))


@pytest.fixture(scope="module")
def cache(offline_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("RENDERFARM_CACHE_DIR", str(offline_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    yield offline_cache
    mp.undo()
    get_settings.cache_clear()


def test_video_recipes_per_device():
    cpu = video_recipe(CPU, "exact", "wan")
    assert (cpu.dtype, cpu.vae_dtype, cpu.vae_tiling, cpu.cpu_offload, cpu.step_cache) == \
        ("float32", "float32", False, False, False)
    h100 = video_recipe(cuda(80), "exact", "wan")  # the Wan card: bf16 transformer, float32 VAE
    assert (h100.dtype, h100.vae_dtype, h100.compile_regional, h100.cpu_offload) == \
        ("bfloat16", "float32", True, False)
    assert video_recipe(cuda(80), "exact", "ltx").vae_dtype == "bfloat16"
    small = video_recipe(cuda(12), "fast", "ltx")  # 14.2 GB of weights over 0.9 x 12 GB: offload, no compile
    assert small.cpu_offload and not small.compile_regional and small.vae_tiling and small.approximations() == \
        ["vae_tiling"]
    assert not video_recipe(cuda(12), "exact", "ltx").vae_tiling  # tiling is approximate: never in exact
    assert not video_recipe(cuda(80), "fast", "ltx").step_cache  # off unless asked for


def test_approximate_video_knobs_need_a_recipe_that_allows_them():
    with pytest.raises(ValueError, match="step_cache are approximate"):
        video_recipe(CPU, "exact", "wan", '{"step_cache": true}')
    on = video_recipe(CPU, "fast", "wan", '{"step_cache": true, "step_cache_threshold": 0.1}')
    assert on.step_cache and on.step_cache_threshold == 0.1 and on.overridden == ("step_cache", "step_cache_threshold")
    with pytest.raises(ValueError, match="unknown video recipe field.*fuse_qkv"):
        video_recipe(CPU, "fast", "wan", {"fuse_qkv": True})
    with pytest.raises(ValueError, match="step_cache_threshold must be > 0"):
        video_recipe(CPU, "fast", "wan", {"step_cache_threshold": 0})
    with pytest.raises(ValueError, match="vae_dtype='float64'; expected one of"):
        video_recipe(CPU, "fast", "wan", {"vae_dtype": "float64"})
    with pytest.raises(ValueError, match="vae_tiling must be bool"):
        video_recipe(CPU, "fast", "wan", {"vae_tiling": "yes"})


@pytest.mark.parametrize("model, threshold, expected_mean", [("tiny-wan", 0.05, 0.10), ("tiny-ltx", 0.2, 0.74)])
def test_step_cache_registers_first_block_cache_and_changes_pixels_slightly(cache, model, threshold, expected_mean):
    from pipeline.video.apply import cache_hooked_blocks
    from pipeline.warm import prepare_renderer

    plain, _ = prepare_renderer(model, "cpu", "fast")
    cached, _ = prepare_renderer(model, "cpu", "fast", f'{{"step_cache": true, "step_cache_threshold": {threshold}}}')
    assert cache_hooked_blocks(plain.pipe.transformer) == []
    assert len(cache_hooked_blocks(cached.pipe.transformer)) == 2  # both blocks: the leader and the other
    assert cached.recipe["report"]["applied"]["step_cache"] == {"method": "first_block_cache",
                                                                "threshold": threshold, "blocks": 2}
    assert cached.recipe["approximations"] == ["step_cache"]
    request = RenderRequest(prompt="a red fox running in the snow", model=model, seed=3, width=64, height=64,
                            num_inference_steps=6, guidance_scale=5.0, kind="video", num_frames=9)
    a, b = (frames_of(r.render([request])[0])[0].astype(int) for r in (plain, cached))
    diff = np.abs(a - b)
    # measured on the tiny builds (6 steps): mean 0.10 / max 12 (Wan), mean 0.74 / max 5 (LTX) out of 255
    assert 0 < diff.mean() == pytest.approx(expected_mean, abs=0.05) and diff.max() <= 16


def test_a_worker_sizes_and_warms_a_video_renderer(cache):
    from pipeline.sizing import size_batch
    from pipeline.warm import PoolOptions, prepare_renderer, warm_plan, warm_up

    renderer, profile = prepare_renderer("tiny-wan", "cpu", "exact", pool=PoolOptions(max_pixels=64 * 64))
    assert type(renderer).__name__ == "VideoRenderer" and renderer.compiler_warm_up is None
    sizing = size_batch(renderer, profile)
    assert sizing["batch_size"] == 1 and sizing["record"] == "skipped"
    plan = warm_plan(renderer, renderer.pool, 1)
    report = warm_up(renderer, plan)
    assert plan.sizes == ((64, 64),) and report["renders"] == 1 and not report["compiled"]


#: Parameter counts implied by the published configs, computed per transformer layer from the
#: dimensions (attention 4·d²+4·d twice, norms, FFN, modulation); embeddings and the output head
#: add the rest, hence the 5 % tolerance. Text encoders: T5-XXL's published 4.762B; UMT5-XXL's
#: encoder is T5-XXL's with a 256,384-token vocabulary (4.762B − 32,128·4,096 + 256,384·4,096
#: + per-layer relative attention bias).
@pytest.mark.parametrize("name, per_layer, layers", [
    ("wan2.1-t2v-1.3b-arch", 2 * (4 * 1536**2 + 4 * 1536) + 4 * 1536 + 2 * 1536 * 8960 + 8960 + 9 * 1536, 30),
    ("ltx-video-arch", 2 * (4 * 2048**2 + 4 * 2048) + 4 * 2048 + 8 * 2048**2 + 5 * 2048 + 6 * 2048, 28)])
def test_video_arch_configs_count_the_published_parameters_on_meta(name, per_layer, layers):
    counts = parameter_counts(name)
    assert counts["transformer"] == pytest.approx(layers * per_layer, rel=0.05)
    for component, published in OFFLINE_MODELS[name].published_params.items():
        assert counts[component] == pytest.approx(published, rel=0.005), component
    assert not OFFLINE_MODELS[name].disk
    if name.startswith("wan"):
        assert counts["transformer"] == 1_418_996_800 and counts["text_encoder"] == 5_680_910_336
    else:
        assert counts["transformer"] == 1_923_385_472 and counts["text_encoder"] == 4_762_310_656


def test_max_frames_extrapolates_two_peaks_linearly_to_the_family_rule():
    from pipeline.video.frames import max_frames_from_peaks

    mib = 2**20
    # 1000 MiB at 5 frames, 1100 MiB at 9: 25 MiB a frame; 2000 MiB fits 5 + 40 = 45 frames (4k+1)
    assert max_frames_from_peaks([(5, 1000 * mib), (9, 1100 * mib)], 2000 * mib, 4, 81) == 45
    assert max_frames_from_peaks([(9, 1100 * mib), (17, 1300 * mib)], 2000 * mib, 8, 257) == 41  # 8k+1 below 45
    assert max_frames_from_peaks([(5, 1000 * mib), (9, 1100 * mib)], 100_000 * mib, 4, 81) == 81  # the cap
    assert max_frames_from_peaks([(5, 1000 * mib), (9, 1000 * mib)], 2000 * mib, 4, 80) == 77  # flat: cap, to rule
    assert max_frames_from_peaks([(5, 3000 * mib), (9, 3100 * mib)], 2000 * mib, 4, 81) == 1  # over budget already
    with pytest.raises(ValueError, match="different frame counts"):
        max_frames_from_peaks([(5, 1), (5, 2)], 10, 4, 81)


def test_a_declared_pool_reports_its_max_frames(cache):
    from pipeline.warm import PoolOptions, prepare_renderer

    renderer, profile = prepare_renderer("tiny-ltx", "cpu", "exact", pool=PoolOptions(max_pixels=96 * 96))
    report = renderer.recipe["max_frames"]
    assert (report["width"], report["height"]) == (96, 96)  # the square of max_pixels, a multiple of 32
    assert [s[0] for s in report["samples"]] == [9, 17] and all(s[1] > 0 for s in report["samples"])
    assert 1 <= report["max_frames"] <= 257 and (report["max_frames"] - 1) % 8 == 0
    assert report["budget_bytes"] == int(renderer.recipe["memory_fraction"] * profile["total_memory_bytes"])


def test_regional_compile_of_the_repeated_blocks_with_the_step_cache(cache):
    pytest.importorskip("torch._inductor")
    from pipeline.optimize.compile import has_cpp_compiler
    from pipeline.warm import prepare_renderer

    if not has_cpp_compiler():
        pytest.skip("no C++ compiler for Inductor's CPU kernels")
    renderer, _ = prepare_renderer("tiny-wan", "cpu", "fast", '{"compile_regional": true, "step_cache": true}')
    applied = renderer.recipe["report"]["applied"]
    assert applied["compile"] == {"regional": ["WanTransformerBlock"], "mode": "default"}
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in renderer.pipe.transformer.blocks)
    request = RenderRequest(prompt="a fox", model="tiny-wan", seed=1, width=64, height=64, num_inference_steps=2,
                            kind="video", num_frames=9)
    frames, _ = frames_of(renderer.render([request])[0])
    assert frames.shape == (9, 64, 64, 3) and frames.std() > 1
