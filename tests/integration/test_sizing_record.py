"""The batch sizing record kept beside the compile cache (pipeline/sizing.py, worker/warmup.py's
``size_renderer``), in SeaweedFS: a first start measures and saves, the next one reads it and renders
nothing, a corrupt or mismatched record is measured again with one log line; the measurement skips
its second render where the first one's upper bound (the resident bytes plus its whole growth per
image) fits the device at ``max_batch_size``, and
renders nothing where that cap is 1. The ``tiny`` pipeline, in this process, at the one size its
pool serves (64²)."""

from __future__ import annotations

import argparse
import logging

import pytest

from infra.settings import Settings
from infra.storage.compile_artifacts import CompileCacheStore, object_name

pytestmark = pytest.mark.integration
BUCKET = "sizing-record-test"  # its own bucket: the records here are this file's alone


@pytest.fixture(scope="module")
def renderer():
    from pipeline.pool_options import PoolOptions
    from pipeline.warm import prepare_renderer

    renderer, profile = prepare_renderer("tiny", "cpu", "exact", pool=PoolOptions(sizes=((64, 64),), steps=2))
    renderer.profile = profile
    calls: list[tuple[int, int]] = []
    render = renderer.render

    def counted(requests, on_step=None):
        calls.append((len(requests), requests[0].num_inference_steps))
        return render(requests, on_step)

    renderer.render, renderer.calls = counted, calls  # type: ignore[method-assign]
    return renderer


@pytest.fixture
def store(compile_cache_in) -> CompileCacheStore:
    return compile_cache_in(BUCKET)


def _size(renderer, cache, profile=None):
    """``size_renderer`` as the worker calls it (no batch size given); (batch size, state)."""
    from worker.warmup import StartupState, size_renderer

    state, seen = StartupState(), []
    state.on_change = lambda: seen.append((state.state, dict(state.progress)))
    args = argparse.Namespace(batch_size=None, model="tiny")
    renderer.calls.clear()
    size = size_renderer(renderer, profile or renderer.profile, args, Settings(batch_size=0), None, cache, state)
    state.seen = seen
    return size, state


def test_first_start_measures_and_saves_the_next_reads_it(renderer, store) -> None:
    from pipeline.memory import PeakMeasurement, batch_size_for_stages

    size, state = _size(renderer, store)
    sizing = state.sizing
    assert sizing["record"] == "miss" and sizing["measured"] and sizing["saved"]["bytes"] > 0, sizing
    # at the served size, one step; the diffusion path rendered (1, then 2 unless bounded)
    assert (sizing["width"], sizing["height"], sizing["steps"]) == (64, 64, 1)
    bounded = "diffusion" in sizing["bounded"]
    # a first-call render of one image, then 1 (and 2 unless the bound fits) images, one step each
    assert renderer.calls == [(1, 1), (1, 1)] + ([] if bounded else [(2, 1)]), renderer.calls
    assert ("sizing", {"done": 0, "total": 2, "eta_s": None}) in state.seen
    assert state.seen[-1][0] == "sizing" and state.seen[-1][1]["done"] == (1 if bounded else 2)
    measured = [PeakMeasurement(base, per) for base, per in sizing["paths"].values()]
    assert size == batch_size_for_stages(measured, renderer.profile["total_memory_bytes"],
                                         renderer.recipe["memory_fraction"], cap=renderer.max_batch_size)
    [listed] = [a for a in store.list() if a.key == sizing["key"]]
    assert listed.kind == "sizing" and listed.meta["component"] == "sizing" and listed.meta["model"] == "tiny"

    again, state2 = _size(renderer, store)
    assert state2.sizing["record"] == "hit" and not state2.sizing["measured"], state2.sizing
    assert renderer.calls == [] and again == size  # nothing rendered: the record decided
    assert state2.sizing["paths"] == sizing["paths"]


def test_a_corrupt_or_mismatched_record_is_measured_again(renderer, store, caplog) -> None:
    from pipeline.compile_cache import CacheKey, pack

    _, state = _size(renderer, store)
    name = state.sizing["key"]
    blob = bytearray(store.get(name) or b"")
    blob[-3] ^= 0xFF  # a payload byte: the header reads, its checksum does not match
    store.storage.client.put_object(Bucket=store.storage.bucket, Key=object_name(name), Body=bytes(blob))
    with caplog.at_level(logging.WARNING, logger="renderfarm.worker"):
        _, corrupt = _size(renderer, store)
    assert corrupt.sizing["record"] == "corrupt" and "SHA-256" in corrupt.sizing["reason"], corrupt.sizing
    assert renderer.calls and f"sizing record corrupt: {name}" in caplog.text
    assert _size(renderer, store)[1].sizing["record"] == "hit"  # the measurement replaced it

    other = CacheKey({"model": "tiny", "component": "sizing", "size": [512, 512]})
    store.put(name, pack(other, b'{"width": 512}'))  # another key's record under this name
    _, mismatch = _size(renderer, store)
    assert mismatch.sizing["record"] == "mismatch" and "key fields differ" in mismatch.sizing["reason"]
    assert renderer.calls


def test_a_second_render_only_where_the_bound_does_not_fit(renderer, store) -> None:
    """With the device's memory far above the first render's bound at ``max_batch_size`` the
    measurement stops after one image, and the bound is what it keeps (the resident bytes as the
    base); with too little it renders two; with ``max_batch_size`` 1 none."""
    roomy = {**renderer.profile, "total_memory_bytes": 1 << 44}  # 16 TiB
    size, state = _size(renderer, None, roomy)
    assert state.sizing["bounded"] == ["diffusion"] and size == renderer.max_batch_size
    assert [n for n, _ in renderer.calls] == [1, 1]  # the first-call warm render, then one measured image
    ((base, per),) = state.sizing["paths"].values()
    assert base > 100 * 2**20 and per > 0  # the process's resident bytes (torch and the pipeline) as the base
    tight = {**renderer.profile, "total_memory_bytes": 1 << 30}  # 1 GiB: the process alone holds most of it
    size, state = _size(renderer, None, tight)
    assert state.sizing["bounded"] == [] and [n for n, _ in renderer.calls] == [1, 1, 2] and size == 1

    cap = renderer.max_batch_size
    try:
        renderer.max_batch_size = 1
        size, state = _size(renderer, store)
        assert size == 1 and state.sizing["record"] == "skipped" and renderer.calls == []
    finally:
        renderer.max_batch_size = cap
