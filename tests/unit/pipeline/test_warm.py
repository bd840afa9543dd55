"""Warm-up plans and static batch buckets on the tiny model (CPU): what a worker warms, how a group
is split into buckets, and that progress counts the whole group."""

from __future__ import annotations

import numpy as np
import pytest

from infra.schemas import RenderRequest
from pipeline.warm import PoolOptions, WarmPlan, warm_plan, warm_up


def _requests(n: int, width: int = 64, height: int = 64, steps: int = 2) -> list[RenderRequest]:
    return [RenderRequest(prompt=f"a red cube {i}", model="tiny", seed=100 + i, width=width, height=height,
                          num_inference_steps=steps) for i in range(n)]


def test_plan_buckets_sizes_steps_and_guidance(tiny_renderer):
    plan = warm_plan(tiny_renderer, PoolOptions(max_pixels=256 * 256), 6)
    # powers of two up to the batch size; the family's native square (512 for SD 1) capped by max_pixels
    assert plan == WarmPlan(buckets=(1, 2, 4), sizes=((256, 256),), steps=2, guidance_scale=7.5)
    declared = warm_plan(tiny_renderer, PoolOptions(sizes=((64, 64), (64, 96), (64, 64)), steps=4,
                                                    guidance_scale=0.0), 16)
    assert declared.buckets == (1, 2, 4, 8, 16) and declared.sizes == ((64, 64), (64, 96))
    assert (declared.steps, declared.guidance_scale, declared.renders) == (4, 0.0, 10)
    assert declared.to_dict()["sizes"] == [[64, 64], [64, 96]]
    with pytest.raises(ValueError, match=">= 1"):
        warm_plan(tiny_renderer, None, 0)


def test_a_group_split_into_buckets_renders_each_image_as_its_bucket_does(tiny_renderer):
    """7 → 4 + 2 + 1 would be slow here; 3 over (1, 2) → 2 + 1: the images are those of the two
    bucket calls made alone, and progress runs once from 1 to the group's total."""
    requests = _requests(3)
    try:
        tiny_renderer.buckets = (1, 2)
        steps: list[tuple[int, int]] = []
        grouped = tiny_renderer.render(requests, on_step=lambda done, total: steps.append((done, total)))
        tiny_renderer.buckets = None
        alone = tiny_renderer.render(requests[:2]) + tiny_renderer.render(requests[2:])
    finally:
        tiny_renderer.buckets = None
    assert [np.asarray(a).tolist() == np.asarray(b).tolist() for a, b in zip(grouped, alone)] == [True] * 3
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_an_eager_recipe_warms_one_image_of_each_declared_size(tiny_renderer):
    """Nothing compiled: one 1-step image per declared size (not every bucket), at the plan's
    guidance, so the first job of each size finds its kernels set up."""
    progress: list[tuple] = []
    asked: list[dict] = []
    plan = WarmPlan(buckets=(1, 2, 4), sizes=((64, 64), (96, 64)), steps=2, guidance_scale=3.0)
    real = tiny_renderer.render
    tiny_renderer.render = lambda requests, **kw: asked.extend(r.model_dump() for r in requests) or real(requests, **kw)
    try:
        report = warm_up(tiny_renderer, plan, on_progress=lambda *a: progress.append(a))
        assert tiny_renderer.buckets == (1, 2, 4)
        assert tiny_renderer.graphs_warmed is False  # nothing compiled: no call is eager for missing a graph
    finally:
        tiny_renderer.buckets = tiny_renderer.graphs_warmed = None
        del tiny_renderer.render
    assert report["compiled"] is False and report["renders"] == 2 and report["compiles"] == 0
    assert [(s["batch"], s["width"], s["height"]) for s in report["shapes"]] == [(1, 64, 64), (1, 96, 64)]
    assert [(r["width"], r["height"], r["num_inference_steps"], r["guidance_scale"]) for r in asked] == \
        [(64, 64, 1, 3.0), (96, 64, 1, 3.0)]
    assert [p[:2] for p in progress] == [(0, 2), (1, 2), (2, 2)] and progress[0][2] is None
    assert progress[1][2] > 0 and progress[2][2] == 0.0 and report["plan"]["buckets"] == [1, 2, 4]
