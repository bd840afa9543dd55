"""A compiled worker warmed with a declared ControlNet unit set: after ready, a run mixing plain
txt2img, img2img and ControlNet units (txt2img and img2img, one unit and two) compiles nothing,
and every pipeline call, the ControlNet ones included, is seen running the UNet's compiled graphs
(``compiled_renders``), under ``fail_on_recompile``. A warm-up that skips the unit set is caught:
the run fails under ``fail_on_recompile``, and held, the ControlNet calls count as eager.

The tiny UNet is compiled as the recipe says (``compile_denoiser``, the pool declaring ControlNets
keeps it in PyTorch), then again with TorchDynamo's ``eager`` backend before its first call: which
graph serves a call is decided by TorchDynamo's guards whatever the backend
(``tests/unit/pipeline/test_compile_count.py``), and Inductor took minutes per static shape of the
tiny UNet on a 2-core machine (``tests/unit/pipeline/test_warm_compile.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from infra.schemas import RenderRequest
from pipeline import compile_count, warm
from pipeline.pool_options import PoolOptions
from pipeline.render import Renderer
from pipeline.warm import prepare_renderer, warm_plan, warm_up
from pipeline.warm_controls import warm_control_sets
from tests.control_images import shapes

pytestmark = pytest.mark.long

SIZE = 64
POOL = PoolOptions(sizes=((SIZE, SIZE),), steps=1, controlnets=True, control_sets=(("canny",),))
OVERRIDES = '{"compile_denoiser": true, "batch_invariant": false}'
INPUTS = {"a.png": shapes(1), "b.png": shapes(7), "photo.png": shapes(3)}
CANNY, DEPTH = {"type": "canny", "image": "a.png", "preprocess": "canny"}, {"type": "depth", "image": "b.png"}
#: (images, units, img2img): with buckets (1, 2) eight pipeline calls: plain 2+1, img2img 2, canny 1,
#: canny 2, canny img2img 1, canny + depth 1, plain 1.
MIXED = [(3, (), False), (2, (), True), (1, (CANNY,), False), (2, (CANNY,), False), (1, (CANNY,), True),
         (1, (CANNY, DEPTH), False), (1, (), False)]


def _renderer(offline_cache) -> Renderer:
    from pipeline.controlnet import ControlNets

    renderer, _ = prepare_renderer("tiny", "cpu", "exact", OVERRIDES, pool=POOL)
    assert renderer.recipe["report"]["applied"]["compile"]["modules"] == ["unet"]
    renderer.pipe.unet.compile(dynamic=False, backend="eager")  # the same guards (module docstring)
    renderer.input_loader = INPUTS.__getitem__
    renderer.controlnets = ControlNets(renderer.pipe, {"canny": "tiny-controlnet-canny",
                                                      "depth": "tiny-controlnet-depth"},
                                       cache_dir=offline_cache, prepare=renderer.prepare_controlnet)
    return renderer


@pytest.fixture(scope="module")
def warmed(offline_cache) -> Iterator[tuple[Renderer, dict]]:
    import torch

    torch._dynamo.reset()  # graphs another test compiled in this process for the same code would be reused
    compile_count.release_compiled()
    renderer = _renderer(offline_cache)
    plan = warm_plan(renderer, POOL, 2)
    try:
        yield renderer, warm_up(renderer, plan)
    finally:
        compile_count.release_compiled()  # the stance is process-wide
        torch._dynamo.reset()


def _mixed_run(renderer: Renderer) -> tuple[int, int, int]:
    """Render :data:`MIXED`; returns the (compiles, compiled renders, eager renders) it added."""
    before = compile_count.compiles(), renderer.compiled_renders, renderer.eager_renders
    for n, units, img2img in MIXED:
        inputs = {"init_image": "photo.png", "strength": 0.5} if img2img else {}
        requests = [RenderRequest(prompt=f"a red kite {i}", model="tiny", seed=i, width=SIZE, height=SIZE,
                                  num_inference_steps=2, controls=list(units), **inputs) for i in range(n)]
        assert len(renderer.render(requests)) == n
    return (compile_count.compiles() - before[0], renderer.compiled_renders - before[1],
            renderer.eager_renders - before[2])


def test_the_declared_unit_set_is_warmed_at_every_bucket(warmed):
    renderer, report = warmed
    assert report["compiled"] and renderer.graphs_warmed is True
    assert report["plan"]["control_sets"] == [["canny"]] and report["renders"] == 4
    assert [(s["batch"], s["controls"]) for s in report["shapes"]] == [(1, []), (2, []), (1, ["canny"]),
                                                                      (2, ["canny"])]
    assert all(s["compiles"] >= 1 for s in report["shapes"])  # the residuals' graphs are new graphs


def test_a_mixed_run_after_ready_recompiles_nothing_and_runs_compiled(warmed):
    renderer, _ = warmed
    with compile_count.fail_on_recompile():  # a call without its graph raises here instead of running eagerly
        assert _mixed_run(renderer) == (0, 8, 0)
    assert _mixed_run(renderer) == (0, 8, 0)  # held, as a worker after ready


def test_a_warm_up_that_skips_the_unit_set_is_caught(offline_cache, monkeypatch):
    """Broken on purpose: the warm-up renders the plain shapes only. The ControlNet calls then have
    no graph: the run fails under fail_on_recompile, and held, its four ControlNet calls run
    eagerly and count so while nothing compiles."""
    import torch

    torch._dynamo.reset()
    compile_count.release_compiled()
    renderer = _renderer(offline_cache)
    render_plan = warm._render_plan
    monkeypatch.setattr(warm, "_render_plan", lambda r, p, *a: render_plan(r, replace(p, control_sets=()), *a))
    try:
        warm_up(renderer, warm_plan(renderer, POOL, 2))
        with compile_count.fail_on_recompile(), pytest.raises(RuntimeError, match="fail_on_recompile"):
            _mixed_run(renderer)
        assert _mixed_run(renderer) == (0, 4, 4)
    finally:
        compile_count.release_compiled()
        torch._dynamo.reset()


def test_the_unit_sets_default_to_each_declared_controlnet_alone(tiny_pipe, offline_cache):
    from pipeline.controlnet import ControlNets

    declared = Renderer(tiny_pipe, model="tiny")
    assert warm_control_sets(declared, POOL) == ()  # no ControlNets on this renderer
    declared.controlnets = ControlNets(tiny_pipe, {"canny": "tiny-controlnet-canny", "depth": "tiny-controlnet-depth"},
                                       cache_dir=offline_cache)  # loads nothing until a render names one
    assert warm_control_sets(declared, PoolOptions()) == (("canny",), ("depth",))
    assert warm_control_sets(declared, PoolOptions(control_sets=())) == ()
    assert warm_control_sets(declared, POOL) == (("canny",),)
