"""The null renderer (pipeline/null.py): images of the request's size, whose PNG costs what a
render's does, deterministic per seed; and the simulated GPU's sleep (a lower bound only)."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from infra.schemas import RenderRequest
from infra.storage.images import PNG_COMPRESS_LEVEL
from pipeline.null import NullRenderer


def _request(width: int, height: int, seed: int = 1) -> RenderRequest:
    return RenderRequest(prompt="null", model="null", width=width, height=height, seed=seed)


def _png_bytes(image: Image.Image) -> int:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)  # as the worker encodes
    return len(buf.getvalue())


def test_each_image_has_its_requests_size():
    sizes = [(64, 64), (512, 512), (96, 64), (64, 128)]
    steps: list[tuple[int, int]] = []
    images = NullRenderer().render([_request(w, h, seed=i) for i, (w, h) in enumerate(sizes)],
                                   on_step=lambda step, total: steps.append((step, total)))
    assert [im.size for im in images] == sizes
    assert {im.mode for im in images} == {"RGB"} and steps == [(1, 1)]


def test_images_are_deterministic_per_seed_and_differ_between_seeds():
    renderer = NullRenderer()
    a, again, other = (np.asarray(im) for im in renderer.render([_request(128, 64, 7), _request(128, 64, 7),
                                                                  _request(128, 64, 8)]))
    assert np.array_equal(a, again) and not np.array_equal(a, other)


def test_a_512_image_costs_as_much_to_encode_as_a_render_not_a_flat_colour():
    (image,) = NullRenderer().render([_request(512, 512)])
    flat = Image.new("RGB", (512, 512), (128, 128, 128))
    encoded = _png_bytes(image)
    assert encoded > 100 * _png_bytes(flat)
    assert 300_000 < encoded < 512 * 512 * 3  # a photograph's order (the module docstring), below raw pixels


def test_the_simulated_gpu_sleeps_at_least_ms_per_image_times_the_batch():
    renderer = NullRenderer(ms_per_image=20)
    t0 = time.perf_counter()
    images = renderer.render([_request(64, 64, seed=i) for i in range(4)])
    assert time.perf_counter() - t0 >= 4 * 0.020 and len(images) == 4


def test_a_negative_render_time_is_refused():
    with pytest.raises(ValueError, match="ms_per_image must be >= 0"):
        NullRenderer(ms_per_image=-1)
