"""Every exact recipe on ``tiny``: batching stays bit-identical, and the pixels stay within
40 dB PSNR of the diffusers baseline (``DiffusionPipeline.from_pretrained``, defaults)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bench.pipeline import psnr
from infra.schemas import RenderRequest
from pipeline.device import DeviceProfile
from pipeline.recipes import RECIPES, recipe_for

PROMPTS = ["a red fox", "a cat on a mat", "blue sky over a city at night", "portrait of an old sailor"]
SIZE, STEPS = 64, 2


def _cpu(amx: bool) -> DeviceProfile:
    return DeviceProfile(kind="cpu", cpu_cores=2, total_memory_bytes=16 * 10**9, avx512=True, amx=amx)


def exact_recipes() -> list:
    """The exact flavour of every device recipe, fitted to this CPU. torch.compile is off: it is
    opt-in on the CPU (minutes of Inductor work per shape), and checked in tests/unit/pipeline."""
    out = {}
    candidates = [dataclasses.replace(recipe_for(_cpu(True), name).without_approximations(), name=f"{name}/exact")
                  for name in RECIPES] + [recipe_for(_cpu(amx), "exact") for amx in (True, False)]
    for r in candidates:
        r = dataclasses.replace(r, compile_denoiser=False, compile_vae=False, cpu_offload=False, num_threads=0)
        # recipes that differ only in batch cap or memory fraction render the same pixels
        out.setdefault(dataclasses.replace(r, name="", max_batch_size=1, memory_fraction=1.0), r)
    return list(out.values())


RECIPES_UNDER_TEST = exact_recipes()


def _requests() -> list[RenderRequest]:
    return [RenderRequest(prompt=p, seed=100 + i, model="tiny", width=SIZE, height=SIZE, num_inference_steps=STEPS)
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def baseline_images(bench_cache):
    """The diffusers defaults, one image per call."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(bench_cache / "models" / "tiny")
    pipe.set_progress_bar_config(disable=True)
    out = []
    for r in _requests():
        image = pipe(prompt=[r.prompt], width=SIZE, height=SIZE, num_inference_steps=STEPS,
                     generator=[torch.Generator("cpu").manual_seed(r.seed)]).images[0]
        out.append(np.asarray(image))
    return out


def _renderer(recipe, cache):
    from pipeline.models import load_pipeline
    from pipeline.optimize import apply_recipe
    from pipeline.render import Renderer

    pipe = load_pipeline("tiny", cache_dir=cache)
    report = apply_recipe(pipe, recipe, device="cpu")
    assert recipe.approximations() == [] and report["approximations"] == []
    return Renderer(pipe, model="tiny"), report


def test_the_recipes_under_test_cover_every_exact_knob():
    seen = {k for r in RECIPES_UNDER_TEST for k in ("channels_last", "fuse_qkv", "vae_slicing",
                                                     "scheduler_precompute") if getattr(r, k)}
    assert seen == {"channels_last", "fuse_qkv", "vae_slicing", "scheduler_precompute"}
    assert {r.attention for r in RECIPES_UNDER_TEST} >= {"sdpa"}


@pytest.mark.parametrize("recipe", RECIPES_UNDER_TEST, ids=lambda r: r.name)
def test_batching_is_bit_identical_and_close_to_the_baseline(recipe, bench_cache, baseline_images):
    renderer, report = _renderer(recipe, bench_cache)
    if recipe.scheduler_precompute:
        assert report["applied"]["scheduler_precompute"].startswith("Precomputed")
    requests = _requests()
    batched = [np.asarray(im) for im in renderer.render(requests)]
    for i in (0, 3):
        alone = np.asarray(renderer.render([requests[i]])[0])
        assert np.array_equal(alone, batched[i]), f"{recipe.name}: request {i} alone differs from it in a batch of 4"
    pair = [np.asarray(im) for im in renderer.render(requests[1:3])]
    assert all(np.array_equal(a, b) for a, b in zip(pair, batched[1:3]))
    for image, reference in zip(batched, baseline_images):
        assert image.std() > 5  # a picture, not a flat field
        assert psnr(image, reference) >= 40.0, f"{recipe.name}: PSNR {psnr(image, reference):.1f} dB"
