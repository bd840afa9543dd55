"""After warm-up, the compiled graphs serve: the tiny model's VAE decoder compiled on the CPU with
static shapes, warmed at every (bucket × declared size). A run mixing batch sizes and the declared
sizes runs under ``fail_on_recompile`` (a compile there is an error, not a silent eager run) and
every one of its pipeline calls is seen running compiled code (``compiled_renders``); a size the
pool did not declare runs eagerly and is seen so (``eager_renders``); and a warm-up that skipped a
bucket is caught both ways: the run fails under ``fail_on_recompile``, and held, the calls of the
skipped bucket count as eager, not compiled.

The decoder alone is compiled (``compile_vae``): each static shape of the tiny UNet took minutes of
Inductor's C++ work on this 2-core machine, the decoder's about 20 s unloaded; the mechanism (one
graph per shape, ``set_stance("eager_on_recompile")`` afterwards) is the same for both. Two paths
compile it, and both are checked: AOTInductor packages (the CPU recipe's default, ``compile_aot``),
and TorchDynamo graphs (``compile_aot: false``, the path of every accelerator recipe). The
TorchDynamo decoder is compiled again with its ``eager`` backend: which graph serves a call is
decided by TorchDynamo's guards whatever the backend (a small module compiled by Inductor gave
the same hits, misses and ``fail_on_recompile`` error as with the eager backend, which
``tests/unit/pipeline/test_compile_count.py`` checks), and Inductor's frozen graphs would add about
a minute of compiling on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from infra.schemas import RenderRequest
from pipeline import compile_count, warm
from pipeline.device import probe
from pipeline.recipes import recipe_for
from pipeline.render import Renderer
from pipeline.warm import PoolOptions, WarmPlan, prepare_renderer, warm_plan, warm_up

pytestmark = pytest.mark.long

SIZES = ((64, 64), (64, 72))
POOL = PoolOptions(sizes=SIZES, steps=1)
AOT, DYNAMO = '{"compile_vae": true}', '{"compile_vae": true, "compile_aot": false}'
#: Groups of (images, size): with buckets (1, 2) they split into 2+1, 1, 2 and 2+2+1, seven
#: pipeline calls (three of one image, four of two).
MIXED = [(3, SIZES[0]), (1, SIZES[1]), (2, SIZES[1]), (5, SIZES[0])]


def _renderer(overrides: str) -> Renderer:
    renderer, _ = prepare_renderer("tiny", "cpu", "exact", overrides, pool=POOL)
    assert renderer.recipe["report"]["applied"]["compile"]["modules"] == ["vae.decoder"]
    assert ("aot" in renderer.recipe["report"]["applied"]["compile"]) == (overrides == AOT)
    if overrides == DYNAMO:  # the same graphs, built by TorchDynamo's eager backend (module docstring)
        renderer.pipe.vae.decoder.compile(dynamic=False, backend="eager")
    return renderer


@pytest.fixture(scope="module")
def warmed() -> Iterator[tuple[Renderer, WarmPlan, dict]]:
    """The AOTInductor path, warmed at buckets (1, 2) × both sizes."""
    import torch

    torch._dynamo.reset()  # graphs another test compiled in this process for the same code would be reused
    renderer = _renderer(AOT)
    assert renderer.invariance == "none"
    # Where this CPU's class recipe turns the invariant kernels on, compile turns them off at
    # resolution, with why; where it runs the decoder in OpenVINO, the configured compile_vae
    # takes the decoder back, with why; elsewhere there is nothing to settle.
    adjusted, class_recipe = renderer.recipe["adjusted"], recipe_for(probe("cpu"))
    assert any("mkldnn_convolution" in a for a in adjusted) == class_recipe.batch_invariant
    assert any(a.startswith("vae_backend torch") for a in adjusted) == (class_recipe.vae_backend == "openvino")
    assert len(adjusted) == class_recipe.batch_invariant + (class_recipe.vae_backend == "openvino")
    plan = warm_plan(renderer, POOL, 2)
    try:
        yield renderer, plan, warm_up(renderer, plan)
    finally:
        compile_count.release_compiled()  # the stance is process-wide


def _requests(n: int, width: int, height: int) -> list[RenderRequest]:
    return [RenderRequest(prompt=f"a blue sphere {i}", model="tiny", seed=i, width=width, height=height,
                          num_inference_steps=2) for i in range(n)]


def _mixed_run(renderer: Renderer) -> tuple[int, int, int]:
    """Render :data:`MIXED`; returns the (compiles, compiled renders, eager renders) it added."""
    before = compile_count.compiles(), renderer.compiled_renders, renderer.eager_renders
    for n, (width, height) in MIXED:
        assert len(renderer.render(_requests(n, width, height))) == n
    return (compile_count.compiles() - before[0], renderer.compiled_renders - before[1],
            renderer.eager_renders - before[2])


def test_a_mixed_run_after_warm_up_runs_compiled_graphs_only(warmed):
    renderer, plan, report = warmed
    assert plan.buckets == (1, 2) and plan.sizes == SIZES
    assert report["compiled"] and report["renders"] == 4 and report["compiles"] >= 4  # one graph per shape
    assert renderer.graphs_warmed is True
    with compile_count.fail_on_recompile():  # a shape without its graph raises here instead of running eagerly
        assert _mixed_run(renderer) == (0, 7, 0)  # nothing compiled, all seven calls ran packages


def test_an_undeclared_size_runs_eagerly_and_is_counted(warmed):
    renderer, _, _ = warmed
    compiles, compiled, eager = compile_count.compiles(), renderer.compiled_renders, renderer.eager_renders
    (image,) = renderer.render(_requests(1, 72, 64))
    assert image.size == (72, 64)
    assert compile_count.compiles() == compiles  # not compiled in the hot path
    assert (renderer.compiled_renders, renderer.eager_renders) == (compiled, eager + 1)
    with compile_count.fail_on_recompile(), pytest.raises(RuntimeError, match="fail_on_recompile"):
        renderer.render(_requests(1, 72, 64))


@pytest.mark.parametrize("overrides", [AOT, DYNAMO], ids=["aot", "dynamo"])
def test_a_warm_up_that_skips_a_bucket_is_caught(overrides, monkeypatch):
    """A warm-up broken on purpose: it renders bucket 1 only, while the worker splits groups into
    buckets 1 and 2. The mixed run fails under fail_on_recompile; held, its four 2-image calls run
    eagerly and count so, its three 1-image calls run compiled. Warmed up fully afterwards, the
    same run compiles nothing and runs compiled code only."""
    import torch

    torch._dynamo.reset()  # another renderer's decoder graphs would serve this one's (same class)
    compile_count.release_compiled()  # the fixture's hold is process-wide: a held warm-up would compile nothing
    renderer = _renderer(overrides)
    plan = warm_plan(renderer, POOL, 2)
    render_plan = warm._render_plan
    monkeypatch.setattr(warm, "_render_plan", lambda r, p, *a: render_plan(r, replace(p, buckets=p.buckets[:1]), *a))
    try:
        report = warm_up(renderer, plan)
        assert renderer.buckets == (1, 2) and report["renders"] == 2 and report["compiles"] >= 2
        with compile_count.fail_on_recompile(), pytest.raises(RuntimeError, match="fail_on_recompile"):
            _mixed_run(renderer)
        assert _mixed_run(renderer) == (0, 3, 4)  # held: nothing compiled, the 2-image calls eager
        monkeypatch.undo()
        compile_count.release_compiled()
        assert warm_up(renderer, plan)["renders"] == 4
        with compile_count.fail_on_recompile():
            assert _mixed_run(renderer) == (0, 7, 0)
    finally:
        compile_count.release_compiled()
