"""Batch sizing keeps the add-ons' bytes free: the ControlNet LRU's ``max_bytes`` and the declared
IP-Adapters' image encoders come off the device budget before the measured bytes (the sizing renders
carry no units, and the add-ons load after it). A stored sizing record stands in for the
measurement, so the batch size follows from the arithmetic alone."""

from __future__ import annotations

import pytest

from pipeline.memory import PeakMeasurement, batch_size_for_stages

GIB = 2**30


def test_reserved_bytes_come_off_the_budget_first():
    diffusion = PeakMeasurement(base_bytes=2 * GIB, per_image_bytes=1 * GIB)
    assert batch_size_for_stages([diffusion], 16 * GIB, 0.9) == 12  # (14.4 - 2) // 1
    assert batch_size_for_stages([diffusion], 16 * GIB, 0.9, reserved_bytes=4 * GIB) == 8  # (14.4 - 4 - 2) // 1
    assert batch_size_for_stages([diffusion], 16 * GIB, 0.9, reserved_bytes=15 * GIB) == 1  # never below 1
    with pytest.raises(ValueError, match="reserved_bytes"):
        batch_size_for_stages([diffusion], 16 * GIB, 0.9, reserved_bytes=-1)


def test_the_batch_shrinks_by_the_controlnets_and_image_encoders_bytes(offline_cache):
    from pipeline.compile_cache import pack
    from pipeline.controlnet import ControlNets
    from pipeline.ip_adapter import IPAdapters
    from pipeline.sizing import SizingRecord, addon_bytes, size_batch
    from pipeline.warm import PoolOptions, prepare_renderer

    # diffusers' own UNet (IP-Adapters load into it), not the CPU recipe's OpenVINO one
    renderer, profile = prepare_renderer("tiny", "cpu", "exact", '{"backend": "torch", "vae_backend": "torch"}',
                                         pool=PoolOptions(max_pixels=64 * 64, steps=1))
    renderer.max_batch_size = 64
    renderer.recipe = {**renderer.recipe, "memory_fraction": 0.5}
    profile = {**profile, "total_memory_bytes": 80 * GIB}  # a budget of 40 GiB
    record = SizingRecord(64, 64, 1, 7.5, {"diffusion": [2 * GIB, 1 * GIB]})

    def fetch(key):
        return pack(key, record.to_json())

    assert addon_bytes(renderer) == 0
    plain = size_batch(renderer, profile, fetch=fetch)
    assert (plain["record"], plain["batch_size"], plain["reserved_bytes"]) == ("hit", 38, 0)  # (40 - 2) // 1

    renderer.controlnets = ControlNets(renderer.pipe, {"canny": "tiny-controlnet-canny"}, max_bytes=5 * GIB,
                                       cache_dir=offline_cache)
    renderer.ip_adapters = IPAdapters(renderer.pipe, {"style": "tiny-ip-adapter-style"}, cache_dir=offline_cache)
    encoder = renderer.ip_adapters.reserved_bytes()
    with renderer.ip_adapters.applied("style", 1.0):  # loaded: the count on meta was the loaded encoder's
        assert renderer.pipe.image_encoder is not None
        loaded = sum(p.numel() * p.element_size() for p in renderer.pipe.image_encoder.parameters())
    assert encoder == loaded == renderer.ip_adapters.reserved_bytes() > 0
    assert addon_bytes(renderer) == 5 * GIB + encoder
    sized = size_batch(renderer, profile, fetch=fetch)
    assert sized["reserved_bytes"] == 5 * GIB + encoder
    assert sized["batch_size"] == (40 * GIB - 5 * GIB - encoder - 2 * GIB) // GIB == 32
