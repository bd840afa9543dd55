"""Recipe selection from fake probes, exactness, overrides, allocator rule, batch sizing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.device import GB, DeviceProfile
from pipeline.memory import (
    PeakMeasurement,
    allocator_env,
    batch_size_for,
    check_allocator_env,
    is_oom_error,
    measure_per_image,
    split_on_oom,
)
from pipeline.recipes import (
    BASELINE,
    OPTIMIZATIONS,
    RECIPE_TABLE,
    RECIPES,
    Recipe,
    apply_overrides,
    device_class,
    overrides_from_env,
    recipe_for,
    select_recipe,
)


def cuda(gb: float, cc: tuple[int, int], flash: bool = False) -> DeviceProfile:
    return DeviceProfile(kind="cuda", name="fake", compute_capability=cc, total_memory_bytes=int(gb * GB),
                         free_memory_bytes=int(gb * GB), cpu_cores=16, flash_attn_available=flash)


def cpu(amx: bool) -> DeviceProfile:
    return DeviceProfile(kind="cpu", name="fake", total_memory_bytes=64 * GB, free_memory_bytes=60 * GB,
                         cpu_cores=8, avx512=True, amx=amx)


MPS = DeviceProfile(kind="mps", name="Apple", total_memory_bytes=24 * GB, free_memory_bytes=20 * GB)


# --- selection ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flash, attention", [(True, "flash_attn"), (False, "sdpa")])
def test_cuda_80gb_sm90_bf16_flash_compile_large_batch(flash, attention):
    r = select_recipe(cuda(80, (9, 0), flash), allow_approximate=True)
    assert r.name == "cuda-large/fast"
    assert (r.dtype, r.attention) == ("bfloat16", attention)
    assert r.compile_unet and r.compile_vae and r.compile_mode == "max-autotune"
    assert r.max_batch_size >= 8 and not r.cpu_offload and r.quantization is None


def test_cuda_24gb_sm86_fp16_sdpa_compile():
    r = select_recipe(cuda(24, (8, 6), flash=True), allow_approximate=True)
    assert r.name == "cuda-mid/fast"
    assert (r.dtype, r.attention) == ("float16", "sdpa") and r.compile_unet and r.compile_vae


def test_cuda_8gb_sm75_fp16_tiling_offload_quantized_small_batch():
    r = select_recipe(cuda(8, (7, 5)), allow_approximate=True)
    assert r.name == "cuda-small/fast"
    assert r.dtype == "float16" and r.vae_tiling and r.cpu_offload
    assert r.quantization in ("torchao_int8", "sdnq_uint4") and 1 <= r.max_batch_size <= 2


def test_large_pre_ampere_card_gets_fp16_not_bf16():
    assert device_class(cuda(48, (7, 5))) == "cuda-mid"  # bf16 needs sm80+


def test_mps_and_cpu_recipes():
    assert select_recipe(MPS, allow_approximate=True).dtype == "float16"
    amx, plain = select_recipe(cpu(True), True), select_recipe(cpu(False), True)
    assert amx.name == "cpu-amx/fast" and amx.dtype == "bfloat16"
    assert plain.name == "cpu/fast" and plain.dtype == "float32"
    assert amx.num_threads == plain.num_threads == 8  # resolved from the probe's core count
    assert not (amx.compile_unet or plain.compile_unet)  # opt-in on the CPU (cold starts)


def test_table_is_data_and_every_rule_names_a_recipe():
    assert all(rule.recipe in RECIPES for rule in RECIPE_TABLE)
    assert [device_class(p) for p in (cuda(40, (8, 0)), cuda(12, (8, 6)), cuda(11.9, (8, 6)))] == \
        ["cuda-large", "cuda-mid", "cuda-small"]
    assert device_class(DeviceProfile(kind="xpu", total_memory_bytes=16 * GB)) == "accelerator"


# --- exactness -------------------------------------------------------------------------------

def test_every_knob_is_classified_with_a_source():
    knobs = {f.name for f in dataclasses.fields(Recipe)} - {"name", "overridden"}
    assert knobs == {k for k, o in OPTIMIZATIONS.items() if o.knob}
    assert all(o.exactness in ("exact", "approximate") and o.source for o in OPTIMIZATIONS.values())
    for technique in ("feature_cache", "fewer_steps"):
        assert OPTIMIZATIONS[technique].exactness == "approximate"


@pytest.mark.parametrize("profile", [cuda(80, (9, 0), True), cuda(24, (8, 6)), cuda(8, (7, 5)), MPS,
                                     cpu(True), cpu(False)])
def test_approximations_off_unless_allowed(profile):
    exact = select_recipe(profile)
    assert exact.approximations() == [] and exact.name.endswith("/exact")
    assert exact.dtype == "float32" and exact.quantization is None and exact.tiny_vae is None
    fast = select_recipe(profile, allow_approximate=True)
    assert set(fast.approximations()) <= {k for k, o in OPTIMIZATIONS.items() if o.exactness == "approximate"}
    # the exact recipe keeps every exact knob of the fast one
    assert dataclasses.replace(fast.without_approximations(), name=exact.name) == exact


def test_named_recipes_for_the_bench():
    p = cpu(True)
    assert recipe_for(p, "baseline") == BASELINE
    assert BASELINE.dtype == "float32" and BASELINE.attention == "default" and BASELINE.approximations() == []
    assert recipe_for(p, "fast").approximations() == ["dtype", "tiny_vae"]
    assert recipe_for(p, "cuda-mid").name == "cuda-mid"
    with pytest.raises(ValueError, match="unknown recipe 'turbo'"):
        recipe_for(p, "turbo")


# --- overrides -------------------------------------------------------------------------------

def test_overrides_apply_validate_and_are_reported():
    r = select_recipe(cpu(True), overrides={"compile_unet": True, "max_batch_size": 2})
    assert r.compile_unet and r.max_batch_size == 2
    assert r.to_dict()["overridden"] == ["compile_unet", "max_batch_size"]
    with pytest.raises(ValueError, match="bogus_knob"):
        select_recipe(cpu(True), overrides={"bogus_knob": 1})
    with pytest.raises(ValueError, match="attention"):
        select_recipe(cpu(True), overrides={"attention": "xformers"})
    with pytest.raises(ValueError, match="max_batch_size"):
        select_recipe(cpu(True), overrides={"max_batch_size": 0})
    with pytest.raises(ValueError, match="overridden"):
        select_recipe(cpu(True), overrides={"overridden": ["x"]})


def test_approximate_override_needs_permission():
    with pytest.raises(ValueError, match="dtype are approximate"):
        select_recipe(cpu(True), allow_approximate=False, overrides={"dtype": "bfloat16"})
    r = select_recipe(cpu(False), allow_approximate=True, overrides={"quantization": "torchao_int8"})
    assert "quantization" in r.approximations()


def test_overrides_from_env_json():
    env = {"RENDERFARM_RECIPE_OVERRIDES": json.dumps({"num_threads": 3, "vae_slicing": True})}
    r = select_recipe(cpu(False), overrides=overrides_from_env(env))
    assert r.num_threads == 3 and r.vae_slicing
    assert overrides_from_env({}) == {}
    with pytest.raises(ValueError, match="not valid JSON"):
        overrides_from_env({"RENDERFARM_RECIPE_OVERRIDES": "{oops"})
    with pytest.raises(ValueError, match="JSON object"):
        overrides_from_env({"RENDERFARM_RECIPE_OVERRIDES": "[1]"})
    assert apply_overrides(BASELINE, '{"channels_last": true}').channels_last


def test_recipe_to_dict_is_json():
    d = json.loads(json.dumps(select_recipe(cuda(80, (9, 0)), True).to_dict()))
    assert d["approximations"] == ["dtype", "tiny_vae"] and d["dtype"] == "bfloat16"


# --- allocator (seed 002) --------------------------------------------------------------------

@pytest.mark.parametrize("profile", [cuda(80, (9, 0)), cuda(8, (7, 5)), MPS, cpu(True)])
def test_allocator_env_never_produces_the_forbidden_combination(profile):
    env = allocator_env(profile)
    check_allocator_env(env)  # does not raise
    assert "max_split_size_mb" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def test_check_allocator_env_refuses_expandable_segments_with_max_split():
    bad = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:32"}
    with pytest.raises(ValueError, match="seed 002"):
        check_allocator_env(bad)
    with pytest.warns(RuntimeWarning):
        check_allocator_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:true"}, strict=False)
    check_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    check_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})


# --- batch size from memory ------------------------------------------------------------------

def test_batch_size_for_arithmetic():
    # 0.9 * 24 GB = 21.6 GB budget; 6 GB base leaves 15.6 GB; 2 GB per image → 7 images.
    assert batch_size_for(2 * GB, 6 * GB, 24 * GB, 0.9) == 7
    assert batch_size_for(2 * GB, 6 * GB, 24 * GB, 0.9, cap=4) == 4
    assert batch_size_for(10 * GB, 6 * GB, 8 * GB, 0.9) == 1  # never below one
    assert batch_size_for(1, 0, 100, 1.0) == 100
    with pytest.raises(ValueError):
        batch_size_for(0, 0, 100, 0.5)
    with pytest.raises(ValueError):
        batch_size_for(1, 0, 100, 1.5)


def test_measure_per_image_on_cpu_sees_allocations():
    import numpy as np

    def render(n):  # touch n * 64 MB
        np.ones(n * 8 * 2**20, dtype=np.float64).sum()

    m = measure_per_image(render, "cpu")
    assert isinstance(m, PeakMeasurement)
    assert 40 * 2**20 < m.per_image_bytes < 120 * 2**20
    assert m.base_bytes > 0


def test_split_on_oom_halves_and_reports_the_size_that_worked():
    import torch

    calls = []

    def render(items):
        calls.append(len(items))
        if len(items) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [i * 10 for i in items]

    results, ok = split_on_oom(render, list(range(7)))
    assert results == [i * 10 for i in range(7)] and ok == 2
    assert calls[0] == 7
    assert is_oom_error(RuntimeError("MPS backend out of memory")) and not is_oom_error(ValueError("x"))
    with pytest.raises(ValueError):
        split_on_oom(lambda items: (_ for _ in ()).throw(ValueError("not oom")), [1, 2])
