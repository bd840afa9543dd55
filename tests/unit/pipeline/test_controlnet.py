"""ControlNet per request on the warm tiny pipeline: offline tiny ControlNets made with
``ControlNetModel.from_unet`` (the real layout, random weights), pipelines made with ``from_pipe``
(no copy of the base weights), the canny preprocessor, weight 0 rendering the plain image, several
units at once, img2img, per-unit settings inside one group, and the LRU's bounds."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from infra.controls import CONTROL_MAPS_INFO, PREPROCESS_S_INFO, ControlUnit
from infra.schemas import RenderRequest
from tests.control_images import shapes

SIZE = 64


INPUTS = {"a.png": shapes(1), "b.png": shapes(7), "photo.png": shapes(3).rotate(90)}


@pytest.fixture(scope="module")
def renderer(offline_cache):
    from pipeline.controlnet import ControlNets
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    made = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny")
    made.input_loader = INPUTS.__getitem__
    made.controlnets = ControlNets(made.pipe, {n: f"tiny-controlnet-{n}" for n in ("canny", "depth", "pose")},
                                   max_count=2, cache_dir=offline_cache, prepare=made.prepare_controlnet)
    return made


def _request(*units: dict, seed: int = 5, **fields) -> RenderRequest:
    return RenderRequest(prompt="a bottle on a beach", model="tiny", width=SIZE, height=SIZE, num_inference_steps=3,
                         seed=seed, controls=list(units), **fields)


def _pixels(image: PIL.Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.float64)


def test_canny_maps_are_edges_at_the_render_size():
    from pipeline.preprocess import control_map

    unit = ControlUnit(type="canny", image="a.png", preprocess="canny", low_threshold=50, high_threshold=150)
    edges = np.asarray(control_map(unit, INPUTS["a.png"].resize((96, 80)), SIZE, SIZE))
    assert edges.shape == (SIZE, SIZE, 3) and set(np.unique(edges)) <= {0, 255}
    assert 0.02 < (edges[:, :, 0] == 255).mean() < 0.5  # the shapes' outlines, not the noise
    plain = np.asarray(control_map(unit.model_copy(update={"preprocess": "none", "low_threshold": None,
                                                           "high_threshold": None, "resize": "fill"}),
                                   INPUTS["a.png"].resize((96, 48)), SIZE, SIZE))
    assert plain.shape == (SIZE, SIZE, 3) and plain[:8].max() == 0  # fill: black borders above and below


def test_weight_zero_renders_the_plain_image_and_a_unit_follows_its_image(renderer):
    plain = _pixels(renderer.render([_request()])[0])
    [zero] = renderer.render([_request({"type": "canny", "image": "a.png", "weight": 0.0})])
    assert np.abs(_pixels(zero) - plain).max() <= 1.0, np.abs(_pixels(zero) - plain).max()
    [empty] = renderer.render([_request({"type": "canny", "image": "a.png", "guidance_start": 0.5,
                                         "guidance_end": 0.5})])  # a range of no steps: as weight 0
    assert np.abs(_pixels(empty) - plain).max() <= 1.0
    a, b = (_pixels(renderer.render([_request({"type": "canny", "image": key, "preprocess": "canny"})])[0])
            for key in ("a.png", "b.png"))
    assert np.abs(a - plain).mean() > 1.0, np.abs(a - plain).mean()
    assert np.abs(a - b).mean() > 0.5, np.abs(a - b).mean()  # only the control image differs
    assert renderer.controlnets.shares_base_weights("txt2img", ["canny"])


def test_the_maps_and_their_seconds_travel_with_the_images(renderer):
    [image] = renderer.render([_request({"type": "canny", "image": "a.png", "preprocess": "canny"},
                                        {"type": "depth", "image": "b.png"})])
    maps = image.info[CONTROL_MAPS_INFO]
    assert [m.size for m in maps] == [(SIZE, SIZE)] * 2 and image.info[PREPROCESS_S_INFO] > 0
    assert set(np.unique(np.asarray(maps[0]))) <= {0, 255}
    assert np.array_equal(np.asarray(maps[1]), np.asarray(INPUTS["b.png"]))


def test_two_units_and_img2img(renderer):
    one = _pixels(renderer.render([_request({"type": "canny", "image": "a.png"})])[0])
    two = _pixels(renderer.render([_request({"type": "canny", "image": "a.png"},
                                            {"type": "depth", "image": "b.png"})])[0])
    assert np.abs(one - two).mean() > 0.5
    steps: list[tuple[int, int]] = []
    [image] = renderer.render([_request({"type": "canny", "image": "a.png"}, init_image="photo.png", strength=0.5)],
                              on_step=lambda done, total: steps.append((done, total)))
    assert image.size == (SIZE, SIZE) and steps[-1] == (1, 1)  # 3 steps × 0.5 → 1 step (diffusers' rule)
    assert renderer.controlnets.shares_base_weights("img2img", ["canny"])


def test_weights_and_guidance_may_differ_inside_a_group(renderer):
    units = [{"type": "canny", "image": key, "weight": w, "guidance_end": e} for key, w, e in
             (("a.png", 1.0, 1.0), ("a.png", 0.5, 1.0), ("a.png", 1.0, 0.5), ("b.png", 1.0, 1.0))]
    requests = [_request(unit, seed=11) for unit in units]
    alone = [_pixels(renderer.render([r])[0]) for r in requests]
    together = [_pixels(image) for image in renderer.render(requests)]
    for lone, grouped in zip(alone, together):
        assert np.abs(lone - grouped).max() <= 1.0
    assert np.abs(alone[0] - alone[1]).mean() > 0.1 and np.abs(alone[0] - alone[2]).mean() > 0.1


def test_the_lru_is_bounded_by_count_and_bytes_and_undeclared_types_fail(renderer):
    cache = renderer.controlnets
    renderer.render([_request({"type": "canny", "image": "a.png"}, {"type": "depth", "image": "b.png"})])
    loads = cache.loads
    renderer.render([_request({"type": "pose", "image": "a.png"})])  # count bound 2: the least recently used goes
    assert len(cache.loaded) == 2 and cache.loaded[-1] == "pose" and cache.loads == loads + 1
    one = cache.loaded_bytes // 2
    cache.max_count, cache.max_bytes = 8, one  # byte bound: one ControlNet at a time
    renderer.render([_request({"type": "canny", "image": "a.png"})])
    assert cache.loaded == ["canny"] and cache.loaded_bytes <= one and cache.evictions >= 2
    cache.max_count, cache.max_bytes = 2, 4 << 30
    with pytest.raises(ValueError, match="not declared"):
        renderer.render([_request({"type": "segmentation", "image": "a.png"})])


def test_a_renderer_without_controlnets_refuses_units(tiny_pipe):
    from pipeline.render import Renderer

    with pytest.raises(ValueError, match="declares no ControlNets"):
        Renderer(tiny_pipe, model="tiny").render([_request({"type": "canny", "image": "a.png"})])


def test_per_sample_calls_split_the_controlnet_residuals(renderer):
    """Accelerators' batch invariance calls the denoiser and the ControlNet once per sample: the
    UNet's residual lists are split tensor by tensor (not taken as a list of samples), and the
    result is the batched call's."""
    import copy

    import torch

    from pipeline.invariance import make_per_sample

    controlnet = renderer.controlnets.pipeline("txt2img", ["canny"]).controlnet.nets[0]
    unet, net = copy.deepcopy(renderer.pipe.unet), copy.deepcopy(controlnet)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 4, 8, 8, generator=generator)
    text = torch.randn(3, 77, 32, generator=generator)
    cond = torch.rand(3, 3, 64, 64, generator=generator)
    with torch.no_grad():
        def run():
            down, mid = net(sample, 10, encoder_hidden_states=text, controlnet_cond=cond, return_dict=False)
            return unet(sample, 10, encoder_hidden_states=text, down_block_additional_residuals=down,
                        mid_block_additional_residual=mid, return_dict=False)[0]

        batched = run()
        make_per_sample(unet)
        make_per_sample(net)
        per_sample = run()
    assert per_sample.shape == batched.shape and torch.allclose(per_sample, batched, atol=1e-4)


def test_sdxl_takes_units_too(offline_cache):
    """SDXL's ControlNet pipeline from the pinned SDXL one (from_pipe), its tiny ControlNet from the
    tiny SDXL UNet (text_time embedding and all): weight 0 is the plain render, a unit changes it."""
    from pipeline.controlnet import ControlNets
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    renderer = Renderer(load_pipeline("tiny-sdxl", cache_dir=offline_cache), model="tiny-sdxl")
    renderer.input_loader = INPUTS.__getitem__
    renderer.controlnets = ControlNets(renderer.pipe, {"canny": "tiny-controlnet-canny"}, cache_dir=offline_cache,
                                       prepare=renderer.prepare_controlnet)

    def render(*units: dict) -> np.ndarray:
        request = RenderRequest(prompt="a bottle", model="tiny-sdxl", width=SIZE, height=SIZE, num_inference_steps=2,
                                seed=3, controls=list(units))
        return _pixels(renderer.render([request])[0])

    plain = render()
    assert np.abs(render({"type": "canny", "image": "a.png", "weight": 0.0}) - plain).max() <= 1.0
    assert np.abs(render({"type": "canny", "image": "a.png", "preprocess": "canny"}) - plain).mean() > 0.5
    assert type(renderer.controlnets.pipeline("txt2img", ["canny"])).__name__ == "StableDiffusionXLControlNetPipeline"
    assert renderer.controlnets.shares_base_weights("img2img", ["canny"])
