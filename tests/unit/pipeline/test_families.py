"""Every family's tiny build loads through the worker's path (``prepare_renderer``), renders a mixed
batch, reports its recipe, and keeps batch invariance where its family can; the full-size
``*-arch`` configs match the published parameter counts (counted on the ``meta`` device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infra.pools import FAMILIES, OFFLINE_FAMILIES
from infra.schemas import RenderRequest
from pipeline.device import probe
from pipeline.models import OFFLINE_MODELS, parameter_counts
from pipeline.models.families import FAMILY_SPECS, tiny_vae_for
from pipeline.models.tokenizers import word_level_tokenizer
from pipeline.recipes import recipe_for

TINY = {"tiny": "sd1", "tiny-sdxl": "sdxl", "tiny-sd3": "sd3", "tiny-flux": "flux-schnell",
        "tiny-ernie-image": "ernie-image", "tiny-kolors": "kolors"}
TINY_VAE = {"tiny": "taesd-arch", "tiny-sdxl": "taesdxl-arch", "tiny-sd3": "taesd3-arch", "tiny-flux": "taef1-arch",
            "tiny-ernie-image": None, "tiny-kolors": "taesdxl-arch"}


@pytest.fixture(scope="module")
def cache(offline_cache, monkeypatch_module):
    monkeypatch_module.setenv("RENDERFARM_CACHE_DIR", str(offline_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    yield offline_cache
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _mixed(model: str, caps) -> list[RenderRequest]:
    guidance = 5.0 if caps.guidance_scale else 0.0
    negatives = ["", "blurry", "", "low quality"] if caps.negative_prompt else [""] * 4
    prompts = ["a red fox in the snow", "a cat", "an isometric city map, pastel colors", "x"]
    return [RenderRequest(prompt=p, negative_prompt=n, seed=10 + i, model=model, width=64, height=64,
                          num_inference_steps=2, guidance_scale=guidance)
            for i, (p, n) in enumerate(zip(prompts, negatives))]


def test_offline_names_and_families_are_one_table():
    assert {name: spec.family for name, spec in OFFLINE_MODELS.items()} == OFFLINE_FAMILIES
    assert set(FAMILY_SPECS) == set(FAMILIES)
    assert {"tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-ernie-image", "sdxl-arch", "sd3-arch", "flux-schnell-arch",
            "ernie-image-turbo-arch"} <= set(OFFLINE_MODELS)


@pytest.mark.parametrize("model", list(TINY))
@pytest.mark.parametrize("recipe", ["exact", "fast"])
def test_every_family_renders_a_mixed_batch_and_reports_its_recipe(cache, model, recipe):
    from pipeline.warm import prepare_renderer

    renderer, profile = prepare_renderer(model, "cpu", recipe)
    family = TINY[model]
    report = renderer.recipe
    assert report["family"] == family and report["report"]["family"] == family
    assert report["denoiser"] == FAMILY_SPECS[family].denoiser
    assert report["name"] == recipe_for(probe("cpu"), recipe, family).name
    assert report["report"]["applied"]["dtype"] == report["dtype"]
    if recipe == "fast":  # the tiny VAE of the family, chosen from the VAE's config
        assert report["report"]["applied"].get("tiny_vae") == TINY_VAE[model]
    requests = _mixed(model, renderer.capabilities)
    images = renderer.render(requests)
    assert [im.size for im in images] == [(64, 64)] * 4
    pixels = [np.asarray(im) for im in images]
    assert all(p.std() > 1 for p in pixels)
    if renderer.invariance == "cpu-kernels" and recipe == "exact":  # float32: alone = in a batch, bit for bit
        alone = np.asarray(renderer.render([requests[1]])[0])
        assert np.array_equal(alone, pixels[1])
    if family == "ernie-image":  # never invariant; the note says why where the class recipe asks for it
        assert renderer.invariance == "none"
        if recipe_for(probe("cpu"), recipe, family).batch_invariant:
            assert "pads text" in report["batch_invariant_note"]


#: Published parameter counts (model cards / config-derived figures; see pipeline.models.configs).
PUBLISHED = {("sd15-arch", "unet"): 859.52e6, ("sdxl-arch", "unet"): 2.567e9,
             ("sdxl-arch", "text_encoder_2"): 694.66e6, ("sd3-arch", "transformer"): 2.028e9,
             ("sd3-arch", "text_encoder_3"): 4.762e9, ("flux-schnell-arch", "transformer"): 11.9e9,
             ("flux-schnell-arch", "text_encoder_2"): 4.762e9, ("kolors-arch", "unet"): 2.58e9,
             ("kolors-arch", "text_encoder"): 6.244e9}


@pytest.mark.parametrize("name", ["sd15-arch", "sdxl-arch", "sd3-arch", "flux-schnell-arch", "ernie-image-turbo-arch",
                                  "kolors-arch"])
def test_full_size_configs_count_the_published_parameters_on_meta(name):
    counts = parameter_counts(name)  # no memory: every tensor on the meta device
    for (model, component), published in PUBLISHED.items():
        if model == name:
            assert counts[component] == pytest.approx(published, rel=0.005), component
    if name == "ernie-image-turbo-arch":  # diffusers' defaults: 24 layers of 3072 (no published figure offline)
        per_layer = 4 * 3072 * 3072 + 3 * 3072 * 8192 + 4 * 3072 + 2 * 128
        assert counts["transformer"] == pytest.approx(24 * per_layer, rel=0.05)
    assert OFFLINE_MODELS[name].disk == (name in ("sd15-arch", "sdxl-arch"))  # the rest: built on the GPU only


def test_full_size_builds_are_made_in_the_target_dtype_without_a_float32_copy():
    from pipeline.models.build import construct_components

    components = construct_components(OFFLINE_MODELS["flux-schnell-arch"], "meta", torch.bfloat16)
    assert {p.dtype for p in components["transformer"].parameters()} == {torch.bfloat16}
    assert {p.device.type for p in components["text_encoder_2"].parameters()} == {"meta"}


def test_tiny_vae_follows_the_vae_config_not_the_channel_count():
    from diffusers import AutoencoderKL

    sd, sdxl = AutoencoderKL(latent_channels=4), AutoencoderKL(latent_channels=4, scaling_factor=0.13025)
    sd3 = AutoencoderKL(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609)
    flux = AutoencoderKL(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)
    assert [tiny_vae_for(v).hub for v in (sd, sdxl, sd3, flux)] == \
        ["madebyollin/taesd", "madebyollin/taesdxl", "madebyollin/taesd3", "madebyollin/taef1"]
    assert tiny_vae_for(AutoencoderKL(latent_channels=16, scaling_factor=0.5)) is None


def test_a_tiny_vae_of_another_family_is_refused(cache):
    from pipeline.models import load_pipeline
    from pipeline.optimize.tiny_vae import swap_tiny_vae

    pipe = load_pipeline("tiny-sdxl")
    skipped = swap_tiny_vae(pipe, "taesd-arch", offline=True)  # the SD 1 tiny VAE into SDXL
    assert "taesdxl-arch" in skipped.reason and type(pipe.vae).__name__ == "AutoencoderKL"


@pytest.mark.parametrize("kind, eos_last, bos_first", [("t5", True, False), ("mistral", False, True)])
def test_offline_word_level_tokenizers(kind, eos_last, bos_first):
    tok = word_level_tokenizer(kind, 1024)
    ids = tok("A red fox, in the snow!")["input_ids"]
    assert len(ids) == 8 + eos_last + bos_first and max(ids) < 1024
    assert (ids[-1] == tok.eos_token_id) == eos_last and (ids[0] == tok.bos_token_id) == bos_first
    padded = tok(["a fox"], padding="max_length", max_length=16)["input_ids"][0]
    assert len(padded) == 16 and padded[-1] == tok.pad_token_id


def test_ernie_image_with_sdnq_uint4_and_quantized_matmul_on_the_cpu(cache):
    pytest.importorskip("sdnq", reason="sdnq is not installed (pip install --no-deps sdnq==0.2.8)")
    from pipeline.warm import prepare_renderer

    renderer, _ = prepare_renderer("tiny-ernie-image", "cpu", "fast", '{"quantization": "sdnq_uint4"}')
    applied = renderer.recipe["report"]["applied"]["quantization"]
    # the model card's explicit apply_sdnq_options_to_model(..., use_quantized_matmul=True), on every component
    assert applied["method"] == "sdnq_uint4" and applied["quantized_matmul"] == {"transformer": True,
                                                                                "text_encoder": True}
    layer = renderer.pipe.transformer.layers[0].mlp.gate_proj
    assert layer.weight.dtype == torch.uint8 and layer.sdnq_dequantizer.weights_dtype == "uint4"
    assert layer.sdnq_dequantizer.use_quantized_matmul  # int8 matmul kernels (sdnq's eager ones on the CPU)
    images = renderer.render(_mixed("tiny-ernie-image", renderer.capabilities)[:2])
    assert all(np.asarray(im).std() > 1 for im in images)


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-ernie-image"])
def test_batch_size_is_measured_at_the_pools_largest_size(cache, model):
    from pipeline.sizing import batch_size_from_memory, sizing_shape
    from pipeline.warm import PoolOptions, prepare_renderer, served_sizes

    renderer, profile = prepare_renderer(model, "cpu", "exact", pool=PoolOptions(max_pixels=200 * 200, steps=3))
    assert sizing_shape(renderer) == (192, 192, 1)  # the square of max_pixels, down to the size multiple (16), 1 step
    assert 1 <= batch_size_from_memory(renderer, profile) <= renderer.max_batch_size
    renderer.pool = PoolOptions(sizes=((192, 192), (256, 160)))
    assert sizing_shape(renderer) == (256, 160, 1)  # the largest declared size by pixels (40960 > 36864)
    renderer.pool = PoolOptions()
    # no pool size: the size a request gets by default (512²), not the family's native 1024²
    assert sizing_shape(renderer) == (512, 512, 1) and served_sizes(renderer) == ((512, 512),)
