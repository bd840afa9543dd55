"""Recipe selection from fake probes (H100 80 GB, L4 24 GB, T4 16 GB, 8 GB cards, MPS, CPUs) per
model family, exactness relative to the model, overrides, allocator rule, batch sizing."""

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
from pipeline.models.families import FAMILY_SPECS
from pipeline.recipes import (
    BASELINE,
    FAMILY_FITS,
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


#: An AVX-512 + AVX512_BF16 CPU without AMX (the AMD EPYCs): the class that keeps the invariant kernels.
CPU_BF16 = dataclasses.replace(cpu(False), avx512_bf16=True)


MPS = DeviceProfile(kind="mps", name="Apple", total_memory_bytes=24 * GB, free_memory_bytes=20 * GB)


# --- selection: fake CUDA profiles × families ------------------------------------------------

H100 = cuda(80, (9, 0), flash=True)
L4 = cuda(24, (8, 9))
T4 = cuda(16, (7, 5))
RTX_8GB = cuda(8, (8, 6))
FAMILIES = ("sd1", "sd2", "sdxl", "sd3", "flux-schnell", "flux-dev", "ernie-image")
CARD_DTYPE = {"sd1": "float16", "sd2": "float16", "sdxl": "float16", "sd3": "float16",
              "flux-schnell": "bfloat16", "flux-dev": "bfloat16", "ernie-image": "bfloat16"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("profile", [H100, L4, T4, RTX_8GB], ids=["H100-80GB", "L4-24GB", "T4-16GB", "8GB"])
def test_cuda_recipes_per_family(profile, family):
    exact, fast = (select_recipe(profile, allow, family=family) for allow in (False, True))
    spec = FAMILY_SPECS[family]
    # the model card's dtype is exact; an accelerator never defaults to float32
    assert exact.dtype == exact.reference_dtype == CARD_DTYPE[family] and exact.approximations() == []
    assert fast.dtype != "float32" and exact.family == family
    if CARD_DTYPE[family] == "bfloat16" and profile.compute_capability < (8, 0):
        assert fast.dtype == "float16" and "dtype" in fast.approximations()  # no fast bf16 before Ampere
    # no CPU patches on CUDA, and the tiny VAE is chosen from the model's VAE only in fast
    assert not exact.batch_invariant and not fast.batch_invariant
    assert exact.tiny_vae is None and fast.tiny_vae == "auto"
    # denoiser knobs follow the family: UNets compile whole and take channels_last, transformers
    # compile their repeated blocks; ERNIE's attention has no fused projections
    if fast.compile_denoiser:
        # static batch buckets, with CUDA graphs (pipeline.warm.warm_up compiles each shape)
        assert fast.compile_regional == spec.regional_compile and not fast.compile_dynamic
        assert fast.compile_mode == "reduce-overhead"
    assert not (fast.channels_last and spec.denoiser == "transformer")
    assert not (fast.fuse_qkv and not spec.fuse_qkv)
    # weights that do not fit are offloaded; what fits stays resident
    fits = FAMILY_FITS[family].weights_gb <= fast.memory_fraction * profile.total_memory_gb
    assert exact.cpu_offload == (not fits) and fast.cpu_offload == (not fits)
    if fast.quantization and fast.quantization.startswith("torchao"):
        assert fast.compile_denoiser and profile.compute_capability >= (8, 9)  # fp8, always compiled
    assert exact.quantization is None


def test_known_cells_of_the_table():
    flux_h100 = select_recipe(H100, True, family="flux-schnell")
    assert flux_h100.name == "cuda-large/fast" and flux_h100.quantization == "torchao_fp8_dynamic"
    assert flux_h100.attention == "flash_attn" and flux_h100.compile_regional and not flux_h100.cpu_offload
    assert select_recipe(L4, family="flux-schnell").cpu_offload  # 33.8 GB of weights on 24 GB
    assert select_recipe(H100, True, family="ernie-image").quantization == "sdnq_uint4"  # its model card
    sdxl_h100 = select_recipe(H100, family="sdxl")
    assert sdxl_h100.dtype == "float16" and sdxl_h100.channels_last and sdxl_h100.fuse_qkv
    assert sdxl_h100.max_batch_size == 8 and select_recipe(H100, family="sd1").max_batch_size == 16
    assert select_recipe(RTX_8GB, family="sdxl").cpu_offload and not select_recipe(RTX_8GB, family="sd1").cpu_offload
    assert select_recipe(MPS, family="flux-schnell").dtype == "bfloat16"
    assert select_recipe(H100, family=None).dtype == "float16"  # a pipeline of unknown family


def test_large_pre_ampere_card_gets_fp16_not_bf16():
    assert device_class(cuda(48, (7, 5))) == "cuda-mid"  # bf16 needs sm80+


def test_mps_and_cpu_recipes():
    assert select_recipe(MPS, allow_approximate=True, family="sd1").dtype == "float16"
    amx, plain = select_recipe(cpu(True), True), select_recipe(cpu(False), True)
    assert amx.name == "cpu-amx/fast" and amx.dtype == "bfloat16"
    assert plain.name == "cpu/fast" and plain.dtype == "float32"
    avx512_bf16 = select_recipe(CPU_BF16, True)
    assert avx512_bf16.name == "cpu-avx512-bf16/fast"
    assert avx512_bf16.dtype == RECIPES["cpu-avx512-bf16"].dtype  # the measured winner (docs/performance)
    assert amx.num_threads == plain.num_threads == 8  # resolved from the probe's core count
    assert not (amx.compile_denoiser or plain.compile_denoiser)  # opt-in on the CPU (cold starts)
    for family in FAMILIES:  # float32 is the CPU reference of every family
        # on the AVX512_BF16 EPYCs and the AMX Xeon the invariant kernels made exact slower than
        # diffusers at batch 4: a pool's opt-in there
        exact = select_recipe(CPU_BF16, family=family)
        assert exact.dtype == "float32" and not exact.batch_invariant and exact.approximations() == []
        assert select_recipe(CPU_BF16, family=family, overrides={"batch_invariant": True}).batch_invariant
        amx_exact = select_recipe(cpu(True), family=family)
        assert amx_exact.dtype == "float32" and not amx_exact.batch_invariant and amx_exact.approximations() == []
        # without bf16 the invariant kernels made exact slower than diffusers: a pool's opt-in there
        plain_exact = select_recipe(cpu(False), family=family)
        assert plain_exact.dtype == "float32" and not plain_exact.batch_invariant
        assert select_recipe(cpu(False), family=family, overrides={"batch_invariant": True}).batch_invariant


def test_table_is_data_and_every_rule_names_a_recipe():
    assert all(rule.recipe in RECIPES for rule in RECIPE_TABLE)
    assert [device_class(p) for p in (cuda(40, (8, 0)), cuda(12, (8, 6)), cuda(11.9, (8, 6)))] == \
        ["cuda-large", "cuda-mid", "cuda-small"]
    assert device_class(DeviceProfile(kind="xpu", total_memory_bytes=16 * GB)) == "accelerator"
    from pipeline.video.recipes import VIDEO_FITS  # video families fit through the video recipes

    assert set(FAMILY_FITS) | set(VIDEO_FITS) == set(FAMILY_SPECS) and not set(FAMILY_FITS) & set(VIDEO_FITS)


# --- exactness -------------------------------------------------------------------------------

def test_every_knob_is_classified_with_a_source():
    not_knobs = {"name", "overridden", "reference_dtype", "family", "adjusted"}
    knobs = {f.name for f in dataclasses.fields(Recipe)} - not_knobs
    assert knobs == {k for k, o in OPTIMIZATIONS.items() if o.knob}
    assert all(o.exactness in ("exact", "approximate") and o.source for o in OPTIMIZATIONS.values())
    for technique in ("feature_cache", "fewer_steps"):
        assert OPTIMIZATIONS[technique].exactness == "approximate"


@pytest.mark.parametrize("profile", [H100, L4, RTX_8GB, MPS, cpu(True), cpu(False)])
@pytest.mark.parametrize("family", [None, "sdxl", "flux-schnell"])
def test_approximations_off_unless_allowed(profile, family):
    exact = select_recipe(profile, family=family)
    assert exact.approximations() == [] and exact.name.endswith("/exact") and exact.quantization is None
    assert exact.tiny_vae is None and exact.dtype == exact.reference_dtype
    fast = select_recipe(profile, allow_approximate=True, family=family)
    assert set(fast.approximations()) <= {k for k, o in OPTIMIZATIONS.items() if o.exactness == "approximate"}
    # the exact recipe keeps every exact knob of the fast one
    assert dataclasses.replace(fast.without_approximations(), name=exact.name) == exact


def test_named_recipes_for_the_bench():
    p = cpu(True)
    assert recipe_for(p, "baseline") == BASELINE
    assert BASELINE.dtype == "float32" and BASELINE.attention == "default" and BASELINE.approximations() == []
    assert recipe_for(H100, "baseline", "flux-schnell").dtype == "bfloat16"  # the reference: the card's dtype
    assert recipe_for(p, "fast").approximations() == ["dtype", "tiny_vae"]
    assert recipe_for(p, "cuda-mid").name == "cuda-mid"
    with pytest.raises(ValueError, match="unknown recipe 'turbo'"):
        recipe_for(p, "turbo")


# --- overrides -------------------------------------------------------------------------------

def test_overrides_apply_validate_and_are_reported():
    r = select_recipe(cpu(True), overrides={"compile_unet": True, "max_batch_size": 2})  # the old name still works
    assert r.compile_denoiser and r.max_batch_size == 2
    assert r.to_dict()["overridden"] == ["compile_denoiser", "max_batch_size"]
    with pytest.raises(ValueError, match="bogus_knob"):
        select_recipe(cpu(True), overrides={"bogus_knob": 1})
    with pytest.raises(ValueError, match="attention"):
        select_recipe(cpu(True), overrides={"attention": "xformers"})
    with pytest.raises(ValueError, match="max_batch_size"):
        select_recipe(cpu(True), overrides={"max_batch_size": 0})
    with pytest.raises(ValueError, match="overridden"):
        select_recipe(cpu(True), overrides={"overridden": ["x"]})
    with pytest.raises(ValueError, match="reference_dtype"):
        select_recipe(cpu(True), overrides={"reference_dtype": "float16"})


def test_approximate_override_needs_permission():
    with pytest.raises(ValueError, match="dtype are approximate"):
        select_recipe(cpu(True), allow_approximate=False, overrides={"dtype": "bfloat16"})
    r = select_recipe(cpu(False), allow_approximate=True, overrides={"quantization": "sdnq_uint4"})
    assert "quantization" in r.approximations()
    with pytest.raises(ValueError, match="needs compile_denoiser"):  # torchao always goes with compile
        select_recipe(cpu(False), allow_approximate=True, overrides={"quantization": "torchao_int8_dynamic"})
    # NNCF's int8 weights compress the OpenVINO UNet: refused at resolution without that backend
    with pytest.raises(ValueError, match="needs backend=openvino"):
        select_recipe(cpu(False), allow_approximate=True,
                      overrides={"backend": "torch", "quantization": "openvino_int8"})
    ov = select_recipe(cpu(False), allow_approximate=True,
                       overrides={"backend": "openvino", "quantization": "openvino_int8"})
    assert "quantization" in ov.approximations() and ov.without_approximations().quantization is None
    with pytest.raises(ValueError, match="quantization are approximate"):
        select_recipe(cpu(False), overrides={"backend": "openvino", "quantization": "openvino_int8"})
    # the card's dtype is exact for that model: float16 on CUDA is no approximation for SDXL
    assert select_recipe(H100, overrides={"dtype": "float16"}, family="sdxl").approximations() == []


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
    d = json.loads(json.dumps(select_recipe(H100, True, family="sdxl").to_dict()))
    assert d["approximations"] == ["tiny_vae"] and d["dtype"] == "float16" and d["family"] == "sdxl"


# --- allocator (the ERNIE-Image-Turbo SDNQ uint4 model card) ---------------------------------

@pytest.mark.parametrize("profile", [cuda(80, (9, 0)), cuda(8, (7, 5)), MPS, cpu(True)])
def test_allocator_env_never_produces_the_forbidden_combination(profile):
    env = allocator_env(profile)
    check_allocator_env(env)  # does not raise
    assert "max_split_size_mb" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def test_check_allocator_env_refuses_expandable_segments_with_max_split():
    bad = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:32"}
    with pytest.raises(ValueError, match="SDNQ uint4 model card"):
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


def test_compile_and_batch_invariance_are_settled_when_the_recipe_is_resolved():
    """The invariant CPU kernels cannot be traced by TorchDynamo: asking for compile turns batch
    invariance off with the reason in the recipe; asking for both is refused before any render."""
    from pipeline.recipes import resolve_conflicts

    exact = dataclasses.replace(select_recipe(CPU_BF16), batch_invariant=True)  # invariant by default, not configured
    assert exact.batch_invariant and not exact.adjusted
    compiled = apply_overrides(exact, {"compile_denoiser": True, "compile_vae": True})
    assert compiled.compile_denoiser and compiled.compile_vae and not compiled.batch_invariant
    assert "mkldnn_convolution" in compiled.adjusted[-1] and compiled.to_dict()["adjusted"] == list(compiled.adjusted)
    assert compiled.vae_backend == "torch"  # the configured compile_vae replaces the class's OpenVINO decoder
    with pytest.raises(ValueError, match="cannot combine"):
        apply_overrides(exact, {"compile_vae": True, "batch_invariant": True})
    # a pool that declares batch invariance (configured) keeps it over a compile it did not ask for
    pool_set = dataclasses.replace(exact, compile_denoiser=True, overridden=("batch_invariant",))
    kept = resolve_conflicts(pool_set)
    assert kept.batch_invariant and not kept.compile_denoiser and kept.adjusted[0].startswith("compile off")
    assert resolve_conflicts(exact) is exact  # nothing to settle


def test_a_pool_with_lora_adapters_keeps_the_denoiser_in_pytorch():
    """LoRA adapters load into the PyTorch UNet's layers (diffusers' load_lora_weights): the OpenVINO
    backend of the AVX512_BF16 class is turned off, with the reason, when the pool declares adapters;
    an override that asks for OpenVINO there is refused at start."""
    from pipeline.recipes import fit_adapters

    bf16 = DeviceProfile(kind="cpu", name="fake", total_memory_bytes=64 * GB, free_memory_bytes=60 * GB,
                         cpu_cores=8, avx512=True, avx512_bf16=True)
    for allow in (False, True):
        recipe = select_recipe(bf16, allow_approximate=allow, family="sd1")
        assert recipe.backend == "openvino"
        fitted = fit_adapters(recipe)
        assert fitted.backend == "torch" and fitted.quantization != "openvino_int8"
        assert "LoRA" in fitted.adjusted[-1] and fitted.dtype == recipe.dtype
    no_bf16 = select_recipe(cpu(False), family="sd1")  # float32 OpenVINO: settled the same way
    assert no_bf16.backend == "openvino" and fit_adapters(no_bf16).backend == "torch"
    amx = select_recipe(cpu(True), family="sd1")  # the AMX class's OpenVINO UNet: settled the same way
    assert amx.backend == "openvino" and fit_adapters(amx).backend == "torch"
    plain = select_recipe(cpu(True), family="sd1", overrides={"backend": "torch"})  # no OpenVINO: nothing to settle
    assert fit_adapters(plain) is plain
    with pytest.raises(ValueError, match="LoRA"):
        fit_adapters(apply_overrides(select_recipe(bf16, family="sd1"), {"backend": "openvino"}))


def test_a_pool_with_controlnets_keeps_the_denoiser_in_pytorch():
    """ControlNet residuals go into the PyTorch UNet's forward: the OpenVINO UNet is turned off with
    that reason, and an override asking for it is refused naming ControlNets."""
    from pipeline.recipes import CONTROLNETS_VS_OPENVINO, fit_adapters

    amx = select_recipe(cpu(True), family="sd1")
    fitted = fit_adapters(amx, CONTROLNETS_VS_OPENVINO)
    assert amx.backend == "openvino" and fitted.backend == "torch" and "ControlNets" in fitted.adjusted[-1]
    with pytest.raises(ValueError, match="ControlNets"):
        fit_adapters(apply_overrides(amx, {"backend": "openvino"}), CONTROLNETS_VS_OPENVINO)


def test_an_openvino_vae_decoder_and_a_compiled_one_are_settled_when_the_recipe_is_resolved():
    """compile_vae and vae_backend=openvino each replace the VAE decoder: the one configured wins,
    with the reason in the recipe; neither configured keeps OpenVINO; both configured is refused."""
    from pipeline.recipes import resolve_conflicts

    openvino = dataclasses.replace(select_recipe(CPU_BF16), vae_backend="openvino", compile_vae=False)
    compiled = apply_overrides(openvino, {"compile_vae": True})
    assert compiled.compile_vae and compiled.vae_backend == "torch"
    assert compiled.adjusted[-1].startswith("vae_backend torch: compile_vae was configured")
    both_default = resolve_conflicts(dataclasses.replace(openvino, compile_vae=True))
    assert both_default.vae_backend == "openvino" and not both_default.compile_vae
    assert both_default.adjusted[-1].startswith("compile_vae off")
    with pytest.raises(ValueError, match="cannot combine with vae_backend"):
        apply_overrides(openvino, {"compile_vae": True, "vae_backend": "openvino"})
    with pytest.raises(ValueError, match="vae_backend"):
        apply_overrides(openvino, {"vae_backend": "tensorrt"})
    assert resolve_conflicts(openvino) is openvino  # nothing to settle
