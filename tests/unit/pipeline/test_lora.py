"""Adapters per request on the warm tiny pipeline: offline LoRAs made with peft in diffusers' key
layout, loaded on first use, bounded by count and bytes (LRU), switched per group, and off again."""

from __future__ import annotations

import numpy as np
import pytest

from infra.schemas import LoraRef, RenderRequest


@pytest.fixture(scope="module")
def renderer(offline_cache):
    from pipeline.lora import AdapterCache, AdapterSource
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    made = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny")
    sources = {n: AdapterSource(f"tiny-lora-{n}") for n in ("brand", "style", "season")}
    made.adapters = AdapterCache(made.pipe, sources, max_count=2, cache_dir=offline_cache)
    return made


def _render(renderer, *loras: tuple[str, float]) -> np.ndarray:
    request = RenderRequest(prompt="a mug", model="tiny", width=64, height=64, num_inference_steps=2, seed=5,
                            loras=[LoraRef(name=n, weight=w) for n, w in loras])
    return np.asarray(renderer.render([request])[0], dtype=np.float32)


def test_adapters_change_the_image_and_switch_back_exactly(renderer):
    plain = _render(renderer)
    brand = _render(renderer, ("brand", 0.8))
    assert np.abs(brand - plain).mean() > 1.0
    assert not np.array_equal(_render(renderer, ("brand", 0.3)), brand)  # the weight matters
    assert np.array_equal(_render(renderer), plain)  # off again
    assert np.array_equal(_render(renderer, ("brand", 0.8)), brand)
    assert renderer.adapters.loads == 1
    hashes = renderer.lora_hashes(RenderRequest(prompt="x", loras=[{"name": "brand", "weight": 1}]))
    assert list(hashes) == ["brand"] and len(hashes["brand"]) == 12


def test_the_lru_is_bounded_by_count_and_bytes(renderer):
    cache = renderer.adapters
    _render(renderer, ("brand", 1.0), ("style", 0.5))
    assert cache.loaded == ["brand", "style"]
    _render(renderer, ("season", 1.0))  # count bound 2: the least recently used goes
    assert cache.loaded == ["style", "season"] and cache.evictions == 1
    assert set(renderer.pipe.get_list_adapters()["unet"]) == {"style", "season"}
    one = cache.loaded_bytes // 2
    cache.max_count, cache.max_bytes = 8, one  # byte bound: one adapter's file at a time
    _render(renderer, ("brand", 1.0))
    assert cache.loaded == ["brand"] and cache.loaded_bytes <= one


def test_an_undeclared_adapter_fails_its_group(renderer):
    with pytest.raises(ValueError, match="not declared"):
        _render(renderer, ("nobody", 1.0))
