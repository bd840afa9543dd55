"""apply_recipe on a tiny random-weight StableDiffusionPipeline (CPU, 2 steps, 64×64)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import torch

from pipeline.device import DeviceProfile
from pipeline.optimize import FlashAttnProcessor, apply_recipe
from pipeline.optimize.aot import AotForward
from pipeline.recipes import BASELINE, select_recipe

SKIPPED_TAESD = "madebyollin/taesd not available (OSError); pre-download it to enable"
CPU_AMX = DeviceProfile(kind="cpu", cpu_cores=2, total_memory_bytes=16 * 10**9, avx512=True, amx=True)


def _tokenizer(tmp_path):
    from transformers import CLIPTokenizer

    tokens = ["<|startoftext|>", "<|endoftext|>"] + [c for c in "abcdefghijklmnopqrstuvwxyz"] \
        + [c + "</w>" for c in "abcdefghijklmnopqrstuvwxyz"] + ["fo", "re", "fox</w>", "red</w>"]
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(dict.fromkeys(tokens))}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nf o\nfo x</w>\nr e\nre d</w>\n")
    return CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), model_max_length=77)


def tiny_pipeline(tmp_path):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=16)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=64, max_position_embeddings=77))
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=_tokenizer(tmp_path),
        scheduler=DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe, n: int = 1) -> np.ndarray:
    out = pipe(["a red fox"] * n, num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
               generator=[torch.Generator("cpu").manual_seed(7 + i) for i in range(n)], output_type="np")
    return out.images


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture
def exact_recipe():
    # the PyTorch knobs are under test here (the class's OpenVINO UNet and decoder have tests of their own)
    recipe = dataclasses.replace(select_recipe(CPU_AMX, allow_approximate=False), backend="torch", vae_backend="torch")
    assert not recipe.compile_denoiser  # CPU compile is opt-in: a minute of Inductor work per shape
    return recipe


def test_exact_recipe_matches_the_unoptimized_pipeline(tmp_path, exact_recipe):
    reference = render(tiny_pipeline(tmp_path))
    pipe = tiny_pipeline(tmp_path)
    # channels_last is off in the CPU recipes (slower there with the batch-invariant kernels), but
    # it is still an exact knob: keep it covered here
    exact_recipe = dataclasses.replace(exact_recipe, channels_last=True)
    report = apply_recipe(pipe, exact_recipe)
    json.dumps(report)
    assert report["approximations"] == [] and report["skipped"] == {}
    assert report["applied"]["attention"] == "sdpa" and report["applied"]["fuse_qkv"] == ["unet", "vae"]
    assert report["applied"]["channels_last"] == ["unet", "vae"] and report["applied"]["dtype"] == "float32"
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert type(next(iter(pipe.unet.attn_processors.values()))).__name__ == "FusedAttnProcessor2_0"
    optimized = render(pipe)
    assert optimized.std() > 0.01  # not a blank image
    assert psnr(reference, optimized) >= 40.0


def test_baseline_changes_nothing_but_reports(tmp_path):
    pipe = tiny_pipeline(tmp_path)
    before = {k: type(v).__name__ for k, v in pipe.unet.attn_processors.items()}
    report = apply_recipe(pipe, BASELINE)
    assert report["applied"] == {"dtype": "float32", "attention": "default"} and report["skipped"] == {}
    assert {k: type(v).__name__ for k, v in pipe.unet.attn_processors.items()} == before


def test_fast_recipe_runs_and_names_its_approximations(tmp_path, monkeypatch):
    from huggingface_hub import constants

    # no hub and an empty hub cache, whatever this machine has cached or can reach
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fast = dataclasses.replace(select_recipe(CPU_AMX, allow_approximate=True), backend="torch")  # PyTorch's UNet
    pipe = tiny_pipeline(tmp_path)
    report = apply_recipe(pipe, fast)
    assert report["approximations"] == ["dtype", "tiny_vae"]
    assert pipe.unet.dtype == torch.bfloat16
    # a hand-built pipeline is no offline model: "auto" resolves to madebyollin/taesd, skipped with the reason
    assert "tiny_vae" not in report["applied"] and report["skipped"]["tiny_vae"] == SKIPPED_TAESD
    assert render(pipe).shape == (1, 64, 64, 3)


def test_missing_packages_and_devices_are_skipped_with_reasons(tmp_path, exact_recipe):
    recipe = dataclasses.replace(exact_recipe, attention="flash_attn", dtype="bfloat16",
                                 quantization="sdnq_uint4", cpu_offload=True, fuse_qkv=False)
    pipe = tiny_pipeline(tmp_path)
    report = apply_recipe(pipe, recipe, device="cpu")
    skipped = report["skipped"]
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn package not installed" in skipped["flash_attn"]
        assert report["applied"]["attention"] == "sdpa"
    if importlib.util.find_spec("sdnq") is None:
        assert skipped["quantization"] == "sdnq not installed"
    assert "needs an accelerator" in skipped["placement"]
    if importlib.util.find_spec("torchao") is None:
        r = apply_recipe(tiny_pipeline(tmp_path), dataclasses.replace(exact_recipe, quantization="torchao_int8",
                                                                      compile_denoiser=True))
        assert r["skipped"]["quantization"] == "torchao not installed"
    with pytest.raises(ValueError, match="needs compile_denoiser"):  # torchao without compile: refused
        dataclasses.replace(exact_recipe, quantization="torchao_int8_dynamic")
    assert render(pipe).shape == (1, 64, 64, 3)  # still usable


def test_sliced_attention_and_vae_memory_knobs(tmp_path, exact_recipe):
    pipe = tiny_pipeline(tmp_path)
    recipe = dataclasses.replace(exact_recipe, attention="sliced", vae_slicing=True)
    report = apply_recipe(pipe, recipe)
    assert "sliced attention" in report["skipped"]["fuse_qkv"]
    assert report["applied"]["attention"] == "sliced" and report["applied"]["vae_slicing"] is True
    assert type(next(iter(pipe.unet.attn_processors.values()))).__name__ == "SlicedAttnProcessor"
    assert pipe.vae.use_slicing
    assert render(pipe, 2).shape == (2, 64, 64, 3)


def test_compile_is_guarded_and_lazy(tmp_path, exact_recipe, monkeypatch):
    recipe = dataclasses.replace(exact_recipe, compile_denoiser=True, compile_vae=True)
    monkeypatch.setattr("shutil.which", lambda name: None)
    report = apply_recipe(tiny_pipeline(tmp_path), recipe)
    assert "needs a C++ compiler" in report["skipped"]["compile"]
    monkeypatch.undo()
    pipe = tiny_pipeline(tmp_path)
    report = apply_recipe(pipe, recipe)  # compiles lazily: nothing is run here
    assert report["applied"]["compile"] == {"mode": "default", "dynamic": False, "modules": ["unet", "vae.decoder"],
                                            "cuda_graphs": False,  # CUDA graphs only on CUDA
                                            "frozen": ["vae.decoder"],  # Inductor freezing, CPU decoder
                                            "aot": ["vae.decoder"]}  # as AOTInductor packages
    assert pipe.unet._compiled_call_impl is not None
    assert isinstance(pipe.vae.decoder.forward, AotForward) and pipe.vae.decoder.forward.runners == {}
    jit = tiny_pipeline(tmp_path)
    assert "aot" not in apply_recipe(jit, dataclasses.replace(recipe, compile_aot=False))["applied"]["compile"]
    assert jit.vae.decoder._compiled_call_impl is not None  # frozen under torch.compile instead
    unfrozen = apply_recipe(tiny_pipeline(tmp_path), dataclasses.replace(recipe, compile_freeze=False))
    assert "frozen" not in unfrozen["applied"]["compile"]  # the knob turns freezing off
    assert "aot" not in unfrozen["applied"]["compile"]  # and with it the packages


def test_gemm_autotuning_off_compiles_with_atens_gemms_alone(tmp_path, exact_recipe):
    from bench.pipeline.ran_with import compiled_regions

    recipe = dataclasses.replace(exact_recipe, compile_denoiser=True, compile_vae=True, compile_freeze=False,
                                 compile_mode="reduce-overhead", compile_gemm_autotune=False)
    pipe = tiny_pipeline(tmp_path)
    report = apply_recipe(pipe, recipe)  # lazy: the options are on the compiled callables, nothing compiled yet
    assert report["applied"]["compile"]["inductor"] == {"max_autotune_gemm_backends": "ATEN"}
    regions = compiled_regions(pipe)
    assert {r["where"] for r in regions} == {"unet", "vae.decoder"}
    for region in regions:  # the mode is kept, spelled as its options
        assert region["backend"]["options"] == {"triton.cudagraphs": True, "max_autotune_gemm_backends": "ATEN"}
    default = tiny_pipeline(tmp_path)
    apply_recipe(default, dataclasses.replace(recipe, compile_gemm_autotune=True))
    assert all(r["backend"]["options"] == {"triton.cudagraphs": True} for r in compiled_regions(default))


def test_the_frozen_compiled_vae_decoder_renders_what_the_eager_one_does(tmp_path, exact_recipe):
    """Inductor freezing bakes the decoder's weights into its graph: the images must not change."""
    torch._dynamo.reset()
    reference = render(tiny_pipeline(tmp_path), 2)
    pipe = tiny_pipeline(tmp_path)
    report = apply_recipe(pipe, dataclasses.replace(exact_recipe, compile_vae=True, batch_invariant=False))
    assert report["applied"]["compile"]["frozen"] == ["vae.decoder"]
    assert psnr(render(pipe, 2), reference) > 60
    torch._dynamo.reset()


def _fake_flash(q, k, v, dropout_p=0.0, causal=False):
    """flash_attn_func's contract, (batch, seq, heads, dim), computed with SDPA."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


@pytest.mark.parametrize("fused", [False, True])
def test_flash_processor_matches_sdpa(tmp_path, fused):
    from diffusers.models.attention_processor import AttnProcessor2_0, FusedAttnProcessor2_0

    unet = tiny_pipeline(tmp_path).unet.to(torch.bfloat16)
    if fused:
        unet.fuse_qkv_projections()
    sample = torch.randn(2, 4, 32, 32, dtype=torch.bfloat16)
    context = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        unet.set_attn_processor(FusedAttnProcessor2_0() if fused else AttnProcessor2_0())
        expected = unet(sample, 10, context).sample
        calls = []

        def counting_flash(*a, **kw):
            calls.append(1)
            return _fake_flash(*a, **kw)

        unet.set_attn_processor(FlashAttnProcessor(counting_flash, devices=("cpu",)))
        got = unet(sample, 10, context).sample
    assert calls  # the kernel path ran, not only the fallback
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_openvino_backend_runs_the_unet_exactly_and_keeps_invariance(offline_cache):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino)")
    from infra.schemas import RenderRequest
    from pipeline.models import load_pipeline
    from pipeline.optimize.openvino import OpenVinoUNet
    from pipeline.render import Renderer

    reqs = [RenderRequest(prompt=p, seed=i, model="tiny", width=64, height=64, num_inference_steps=2)
            for i, p in enumerate(["a red fox", "a cat on a mat", "x"])]
    torch_images = [np.asarray(im) for im in Renderer(load_pipeline("tiny", cache_dir=offline_cache),
                                                      model="tiny").render(reqs)]
    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    report = apply_recipe(pipe, dataclasses.replace(BASELINE, backend="openvino", attention="sdpa"))
    assert report["applied"]["backend"]["precision"] == "f32" and isinstance(pipe.unet, OpenVinoUNet)
    renderer = Renderer(pipe, model="tiny")  # CPU: invariant kernels, and one OpenVINO call per sample
    images = [np.asarray(im) for im in renderer.render(reqs)]
    assert all(psnr(a / 255, b / 255) >= 60 for a, b in zip(images, torch_images))  # float32: kernel rounding only
    assert np.array_equal(np.asarray(renderer.render(reqs[1:2])[0]), images[1])
    assert renderer.render([reqs[0].model_copy(update={"width": 96})])[0].size == (96, 64)  # dynamic shapes
    # a latent side that is not a multiple of the UNet's upsampling factor (72 px: 9 latents on a
    # 2x UNet): each level upsamples to its skip connection's size, as the PyTorch UNet does
    odd = [reqs[0].model_copy(update={"width": 72})]
    odd_torch = np.asarray(Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny").render(odd)[0])
    assert psnr(np.asarray(renderer.render(odd)[0]) / 255, odd_torch / 255) >= 60
    sdxl = apply_recipe(load_pipeline("tiny-sdxl", cache_dir=offline_cache),
                        dataclasses.replace(BASELINE, backend="openvino"))
    assert "only SD 1.x/2.x UNets" in sdxl["skipped"]["backend"]


def test_openvino_int8_weights_compress_the_unet_and_stay_close(offline_cache):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino)")
    pytest.importorskip("nncf", reason="nncf is not installed (the [cpu] extra)")
    from infra.schemas import RenderRequest
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    reqs = [RenderRequest(prompt="a red fox", seed=3, model="tiny", width=64, height=64, num_inference_steps=2)]
    f32 = load_pipeline("tiny", cache_dir=offline_cache)
    apply_recipe(f32, dataclasses.replace(BASELINE, backend="openvino"))
    int8 = load_pipeline("tiny", cache_dir=offline_cache)
    report = apply_recipe(int8, dataclasses.replace(BASELINE, backend="openvino", quantization="openvino_int8"))
    assert report["applied"]["backend"]["weights"].startswith("int8_asym")
    assert report["applied"]["quantization"] == report["applied"]["backend"]["weights"]
    assert report["approximations"] == ["quantization"]
    ref, got = (np.asarray(Renderer(p, model="tiny").render(reqs)[0]) for p in (f32, int8))
    assert not np.array_equal(ref, got) and psnr(ref / 255, got / 255) >= 20  # approximate, not broken
