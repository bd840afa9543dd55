"""Adapters hot-swapped into a compiled denoiser: the tiny pipeline's UNet compiled by TorchDynamo,
adapters switched between renders, and no recompile after the first adapter load, while the
images follow the adapter and its weight (so the slot really swaps)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from infra.schemas import LoraRef, RenderRequest

#: TorchDynamo's backend for the test. Recompiles are decided by TorchDynamo's guards, before any
#: backend runs; "aot_eager" traces forward like Inductor does without its C++ code generation
#: (minutes per shape of the tiny UNet on this CPU). RENDERFARM_TEST_COMPILE_BACKEND=inductor runs Inductor.
BACKEND = os.environ.get("RENDERFARM_TEST_COMPILE_BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def renderer(offline_cache):
    import torch

    from pipeline import compile_count
    from pipeline.lora import AdapterCache, AdapterSource
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    torch._dynamo.reset()
    compile_count.release_compiled()
    compile_count.install()
    # compile and the CPU batch-invariant kernels do not combine (recipes settle it the same way)
    made = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny", batch_invariant=False)
    sources = {n: AdapterSource(f"tiny-lora-{n}") for n in ("brand", "style")}
    made.adapters = AdapterCache(made.pipe, sources, cache_dir=offline_cache, hotswap_rank=8)
    made.pipe.unet.compile(backend=BACKEND, dynamic=False)
    made.adapters.prime()  # as the worker, before its warm-up: the slot holds one adapter at weight 0
    yield made
    torch._dynamo.reset()


def _render(renderer, *loras: tuple[str, float]) -> np.ndarray:
    request = RenderRequest(prompt="a mug", model="tiny", width=64, height=64, num_inference_steps=2, seed=5,
                            loras=[LoraRef(name=n, weight=w) for n, w in loras])
    return np.asarray(renderer.render([request])[0], dtype=np.float32)


def test_switching_adapters_in_a_compiled_denoiser_never_recompiles(renderer):
    from pipeline import compile_count
    from pipeline.lora import SLOT

    plain = _render(renderer)  # the one compile: the slot's layers are there already (prime)
    after_first_load = compile_count.compiles()
    brand = _render(renderer, ("brand", 1.0))
    style = _render(renderer, ("style", 1.0))
    half = _render(renderer, ("brand", 0.5))
    off = _render(renderer)
    again = _render(renderer, ("brand", 1.0))
    assert compile_count.compiles() == after_first_load
    assert renderer.pipe.get_list_adapters() == {"unet": [SLOT]}
    assert after_first_load >= 1  # the counter counts
    assert renderer.adapters.loads == 3  # brand (primed), style, brand: a new adapter reloads the slot
    assert np.abs(brand - plain).mean() > 1.0
    assert np.abs(style - brand).mean() > 1.0  # the slot holds style's weights, not brand's
    assert np.abs(half - brand).mean() > 0.5  # the weight is the slot's scaling
    assert np.abs(off - plain).max() <= 1.0  # scaling 0: the plain image (same bytes up to rounding)
    assert np.abs(again - brand).max() <= 1.0
    hashes = renderer.lora_hashes(RenderRequest(prompt="x", loras=[{"name": "brand", "weight": 1}]))
    assert list(hashes) == ["brand"] and len(hashes["brand"]) == 12


def test_several_adapters_at_once_are_refused(renderer):
    with pytest.raises(ValueError, match="one adapter per render"):
        _render(renderer, ("brand", 1.0), ("style", 0.5))


def test_a_compiled_denoiser_is_recognised(renderer, offline_cache):
    from pipeline.lora import denoiser_compiled
    from pipeline.models import load_pipeline

    assert denoiser_compiled(renderer.pipe)
    assert not denoiser_compiled(load_pipeline("tiny", cache_dir=offline_cache))
