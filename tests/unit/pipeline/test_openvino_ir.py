"""The converted OpenVINO UNet shared through a store (pipeline.optimize.openvino_ir), on ``tiny``:
a first load converts and stores the IR, a second reads it instead of tracing and renders the same
pixels, and a corrupt, incomplete or unreachable store only means converting again."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.optimize import apply_recipe
from pipeline.optimize.openvino_ir import FILES, MANIFEST, DirectoryIRStore, file_digest, ir_key
from pipeline.recipes import BASELINE

pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino)")
OPENVINO = dataclasses.replace(BASELINE, backend="openvino", attention="sdpa")


def _requests():
    from infra.schemas import RenderRequest

    return [RenderRequest(prompt=p, seed=i, model="tiny", width=64, height=64, num_inference_steps=2)
            for i, p in enumerate(["a red fox", "a cat on a mat"])]


def _load(offline_cache: Path, store) -> tuple[list[np.ndarray], dict | None]:
    """Load tiny with the OpenVINO UNet through ``store``; its images for two requests and the
    report's IR outcome."""
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    report = apply_recipe(pipe, OPENVINO, ir_store=store)
    images = [np.asarray(im) for im in Renderer(pipe, model="tiny", batch_invariant=False).render(_requests())]
    return images, report["applied"]["backend"].get("ir")


class BrokenStore:
    """A store whose storage is away: every call raises."""

    def fetch_files(self, key, dest):
        raise ConnectionError("storage unreachable")

    def store_files(self, key, src, fields):
        raise ConnectionError("storage unreachable")


@pytest.fixture
def no_local_store(monkeypatch):
    """Neither ``RENDERFARM_OPENVINO_IR_DIR`` (the suite sets one, tests/conftest.py) nor a cached
    settings object that holds it."""
    from infra.settings import get_settings

    monkeypatch.delenv("RENDERFARM_OPENVINO_IR_DIR", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_a_second_load_reads_the_stored_ir_and_renders_the_same_pixels(offline_cache, tmp_path, caplog,
                                                                      no_local_store):
    caplog.set_level(logging.INFO, logger="renderfarm.worker")
    uncached, none = _load(offline_cache, None)
    assert none is None  # no store: converted, nothing reported
    store = DirectoryIRStore(tmp_path)
    cold, miss = _load(offline_cache, store)
    assert miss is not None and miss["outcome"] == "miss" and miss["saved"]["bytes"] == miss["bytes"] > 0, miss
    entry = tmp_path / miss["key"]
    assert sorted(p.name for p in entry.iterdir()) == sorted([*FILES, MANIFEST])
    warm, hit = _load(offline_cache, store)
    assert hit is not None and hit["outcome"] == "hit" and hit["key"] == miss["key"] and hit["saved"] is None, hit
    assert f"openvino IR cache hit: {hit['key']}" in caplog.text
    for a, b, c in zip(uncached, cold, warm):  # the IR is the same graph: bit-identical pixels
        assert np.array_equal(a, b) and np.array_equal(b, c)


def test_without_a_store_the_local_directory_of_the_setting_is_used(offline_cache, tmp_path, monkeypatch,
                                                                    no_local_store):
    from infra.settings import get_settings

    monkeypatch.setenv("RENDERFARM_OPENVINO_IR_DIR", str(tmp_path / "ir"))
    get_settings.cache_clear()
    first, miss = _load(offline_cache, None)
    assert miss is not None and miss["outcome"] == "miss" and miss["saved"]["bytes"] > 0, miss
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == [miss["key"]]  # no staging left behind
    second, hit = _load(offline_cache, None)
    assert hit is not None and hit["outcome"] == "hit" and hit["key"] == miss["key"], hit
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    given = DirectoryIRStore(tmp_path / "given")  # a store passed in wins over the setting
    assert _load(offline_cache, given)[1]["outcome"] == "miss" and (tmp_path / "given" / miss["key"]).is_dir()


def test_a_corrupt_or_incomplete_entry_is_converted_again_and_replaced(offline_cache, tmp_path, caplog):
    store = DirectoryIRStore(tmp_path)
    reference, first = _load(offline_cache, store)
    assert first is not None
    weights = tmp_path / first["key"] / FILES[1]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    images, corrupt = _load(offline_cache, store)
    assert corrupt is not None and corrupt["outcome"] == "corrupt" and "digest differs" in corrupt["reason"], corrupt
    assert corrupt["saved"]["bytes"] > 0  # the good conversion replaced the corrupt entry
    assert all(np.array_equal(a, b) for a, b in zip(reference, images))
    assert _load(offline_cache, store)[1]["outcome"] == "hit"
    (tmp_path / first["key"] / MANIFEST).unlink()  # an upload cut short before its manifest
    _, incomplete = _load(offline_cache, store)
    assert incomplete is not None and incomplete["outcome"] == "corrupt" and "incomplete" in incomplete["reason"]
    assert f"openvino IR cache corrupt: {first['key']}" in caplog.text


def test_unreachable_storage_only_means_converting(offline_cache):
    images, outcome = _load(offline_cache, BrokenStore())
    assert outcome is not None and outcome["outcome"] == "error" and "storage unreachable" in outcome["reason"]
    assert "storage unreachable" in outcome["saved"]["error"]
    assert len(images) == 2 and all(im.shape == (64, 64, 3) for im in images)


def test_a_scratch_disk_that_cannot_hold_the_ir_keeps_the_converted_unet(offline_cache, tmp_path, monkeypatch):
    from pipeline.optimize import openvino_ir

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(openvino_ir, "_write", full_disk)
    images, outcome = _load(offline_cache, DirectoryIRStore(tmp_path))
    assert outcome is not None and outcome["outcome"] == "error" and "No space left" in outcome["reason"], outcome
    assert outcome["saved"] is None and not any(tmp_path.iterdir())  # nothing half-written was stored
    assert len(images) == 2  # the UNet still runs in OpenVINO: the backend was applied


def test_the_key_follows_the_weights_and_the_options(offline_cache):
    from pipeline.models import load_pipeline

    unet = load_pipeline("tiny", cache_dir=offline_cache).unet
    key, fields = ir_key(unet)
    assert key.startswith("openvino-") and ir_key(unet)[0] == key and fields["versions"]["openvino"]
    assert ir_key(unet, int8_weights=True)[0] != key
    with torch.no_grad():
        next(iter(unet.parameters())).view(-1)[0] += 1e-3  # a fine-tune changes the weights: another key
    assert ir_key(unet)[0] != key


def test_the_file_digest_sees_every_byte_of_every_segment(tmp_path, monkeypatch):
    """The segmented digest (segments hashed on threads) changes with a flipped byte in any
    segment, at a segment's edges, with a byte appended, and with the segments' order."""
    from pipeline.optimize import openvino_ir

    monkeypatch.setattr(openvino_ir, "_SEGMENT", 1000)
    monkeypatch.setattr(openvino_ir, "_CHUNK", 300)  # reads end inside segments too
    data = bytes(np.random.default_rng(0).integers(0, 256, 3500, dtype=np.uint8))
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    reference = file_digest(path)
    assert file_digest(path) == reference
    for index in (0, 999, 1000, 2500, 3499):
        flipped = bytearray(data)
        flipped[index] ^= 0x01
        path.write_bytes(bytes(flipped))
        assert file_digest(path) != reference, index
    path.write_bytes(data + b"\0")
    assert file_digest(path) != reference
    path.write_bytes(data[1000:2000] + data[:1000] + data[2000:])
    assert file_digest(path) != reference
    path.write_bytes(b"")
    assert file_digest(path) != reference
