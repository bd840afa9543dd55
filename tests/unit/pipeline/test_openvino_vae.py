"""The VAE decoder in OpenVINO (recipe knob ``vae_backend``, pipeline.optimize.openvino_vae), on
``tiny``: the same pixels as PyTorch's decoder up to kernel rounding, batch invariance kept, every
size served by one conversion, the converted decoder shared through the IR cache, and the VAEs it
does not convert left as they are, with the reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.optimize import apply_recipe
from pipeline.recipes import BASELINE

pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino)")
OPENVINO_VAE = dataclasses.replace(BASELINE, vae_backend="openvino")


def _requests(width: int = 64):
    from infra.schemas import RenderRequest

    return [RenderRequest(prompt=p, seed=i, model="tiny", width=width, height=64, num_inference_steps=2)
            for i, p in enumerate(["a red fox", "a cat on a mat", "x"])]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) / 255 - b.astype(np.float64) / 255) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _images(renderer, requests) -> list[np.ndarray]:
    return [np.asarray(im) for im in renderer.render(requests)]


def test_the_openvino_decoder_renders_what_pytorch_does_and_keeps_batch_invariance(offline_cache):
    from pipeline.models import load_pipeline
    from pipeline.optimize.openvino_vae import OpenVinoDecoder
    from pipeline.render import Renderer

    reference = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny")
    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    report = apply_recipe(pipe, OPENVINO_VAE)
    assert report["applied"]["vae_backend"]["precision"] == "f32", report
    assert isinstance(pipe.vae.decoder, OpenVinoDecoder) and not report["approximations"]
    renderer = Renderer(pipe, model="tiny")  # CPU: invariant kernels for the PyTorch parts
    assert renderer.invariance == "cpu-kernels"
    compiled, calls = pipe.vae.decoder.compiled, []
    pipe.vae.decoder.compiled = lambda inputs: calls.append(inputs[0].shape) or compiled(inputs)
    images = _images(renderer, _requests())
    assert calls == [(1, 4, 8, 8)] * 3  # OpenVINO decoded, one image per call
    expected = _images(reference, _requests())
    assert all(_psnr(a, b) >= 60 for a, b in zip(images, expected))  # float32: kernel rounding only
    assert np.array_equal(_images(renderer, _requests()[1:2])[0], images[1])  # alone = in a batch of 3
    wide = _images(renderer, _requests(96)[:1])[0]  # one conversion serves every size
    assert wide.shape == (64, 96, 3) and _psnr(wide, _images(reference, _requests(96)[:1])[0]) >= 60
    # the decoder alone, without any invariance patch: a batch decodes to what each latent does alone
    plain = load_pipeline("tiny", cache_dir=offline_cache)
    apply_recipe(plain, OPENVINO_VAE)
    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        batched = plain.vae.decode(latents).sample
        alone = torch.cat([plain.vae.decode(latents[i:i + 1]).sample for i in range(3)])
    assert torch.equal(batched, alone)


def test_a_second_load_reads_the_stored_decoder(offline_cache, tmp_path):
    from pipeline.models import load_pipeline
    from pipeline.optimize.openvino_ir import DirectoryIRStore
    from pipeline.render import Renderer

    store = DirectoryIRStore(tmp_path)
    outcomes, images = [], []
    for _ in range(2):
        pipe = load_pipeline("tiny", cache_dir=offline_cache)
        outcomes.append(apply_recipe(pipe, OPENVINO_VAE, ir_store=store)["applied"]["vae_backend"]["ir"])
        images.append(_images(Renderer(pipe, model="tiny", batch_invariant=False), _requests()[:2]))
    miss, hit = outcomes
    assert miss["outcome"] == "miss" and miss["saved"]["bytes"] > 0, miss
    assert hit["outcome"] == "hit" and hit["key"] == miss["key"], hit
    assert all(np.array_equal(a, b) for a, b in zip(*images))  # the same graph: the same pixels
    unet = load_pipeline("tiny", cache_dir=offline_cache)
    unet_ir = apply_recipe(unet, dataclasses.replace(BASELINE, backend="openvino"), ir_store=store)
    assert unet_ir["applied"]["backend"]["ir"]["key"] != miss["key"]  # the UNet and the decoder: two entries


def test_vaes_it_does_not_convert_are_left_with_the_reason(offline_cache):
    from pipeline.models import load_pipeline
    from pipeline.optimize.openvino_vae import vae_to_openvino

    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    tiny_vae = apply_recipe(pipe, dataclasses.replace(OPENVINO_VAE, tiny_vae="auto"), offline=True)
    assert "tiny_vae" in tiny_vae["applied"]
    assert "only AutoencoderKL decoders" in tiny_vae["skipped"]["vae_backend"], tiny_vae
    decoder = load_pipeline("tiny", cache_dir=offline_cache)
    assert "CPU only" in vae_to_openvino(decoder, "cuda:0").reason
    assert type(decoder.vae.decoder).__name__ == "Decoder"  # untouched
