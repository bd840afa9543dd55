"""IP-Adapter on the warm tiny pipeline: an offline adapter (random weights, the tiny UNet's
layout, a tiny CLIP image encoder) loaded through diffusers' ``load_ip_adapter`` around one call,
the reference image steering the image, scale 0 rendering the plain image, one reference per call
(diffusers repeats it over the batch), and the pinned
pipeline left as it was (its own attention processors, no image projection) after the call,
even one that raised."""

from __future__ import annotations

import numpy as np
import pytest

from tests.control_images import shapes

SIZE = 64


@pytest.fixture(scope="module")
def adapters(offline_cache):
    from pipeline.ip_adapter import IPAdapters
    from pipeline.models import load_pipeline

    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    return IPAdapters(pipe, {"style": "tiny-ip-adapter-style"}, cache_dir=offline_cache)


def _render(pipe, embeds=None) -> np.ndarray:
    import torch

    extra = {} if embeds is None else {"ip_adapter_image_embeds": embeds}
    out = pipe("a bottle on a beach", height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=7.5,
               generator=torch.Generator().manual_seed(5), output_type="np", **extra)
    return out.images[0].astype(np.float64) * 255


def _styled(adapters, reference, scale: float = 1.0) -> np.ndarray:
    with adapters.applied("style", scale) as pipe:
        return _render(pipe, adapters.image_embeds("style", reference, guidance=True))


def test_the_reference_image_steers_the_image_and_scale_0_does_not(adapters):
    plain = _render(adapters.pipe)
    a, again, b = _styled(adapters, shapes(1)), _styled(adapters, shapes(1)), _styled(adapters, shapes(7))
    assert np.array_equal(a, again)  # one reference, one seed: one image
    assert np.abs(a - b).mean() > 1.0, np.abs(a - b).mean()  # another reference, another image
    assert np.abs(a - plain).mean() > 1.0
    assert np.abs(_styled(adapters, shapes(1), scale=0.0) - plain).max() < 0.5  # no effect at scale 0


def test_the_pinned_pipeline_is_left_as_it_was_even_after_a_failed_call(adapters):
    pipe = adapters.pipe
    own = dict(pipe.unet.attn_processors)
    before = _render(pipe)
    with pytest.raises(RuntimeError, match="mid-call"), adapters.applied("style", 0.7):
        assert pipe.unet.encoder_hid_proj is not None and pipe.image_encoder is not None
        raise RuntimeError("mid-call")
    assert pipe.unet.encoder_hid_proj is None and pipe.image_encoder is None
    assert all(pipe.unet.attn_processors[k] is v for k, v in own.items())  # the very same processors
    assert np.array_equal(_render(pipe), before)


def test_one_reference_conditions_every_sample_of_a_call(adapters):
    """diffusers repeats the embedding over the call's batch: two prompts, two seeds, one reference."""
    import torch

    with adapters.applied("style", 1.0) as pipe:
        embeds = adapters.image_embeds("style", shapes(1), guidance=True)
        assert embeds[0].shape[:2] == (2, 1)  # the unconditional half, then the reference
        out = pipe(["a bottle on a beach"] * 2, height=SIZE, width=SIZE, num_inference_steps=3,
                   generator=[torch.Generator().manual_seed(s) for s in (5, 6)], output_type="np",
                   ip_adapter_image_embeds=embeds).images.astype(np.float64) * 255
    assert np.abs(out[0] - _styled(adapters, shapes(1))).max() < 0.5  # as the call of one, same seed
    assert np.abs(out[0] - out[1]).mean() > 1.0  # its own seed


def test_undeclared_adapters_and_pipelines_without_a_unet_are_refused(adapters, offline_cache):
    from pipeline.ip_adapter import build_offline_ip_adapter

    with pytest.raises(KeyError):
        with adapters.applied("mood-board", 1.0):
            pass

    class NoUNet:
        transformer = object()

    with pytest.raises(ValueError, match="made for a UNet"):
        build_offline_ip_adapter("tiny-ip-adapter-x", NoUNet(), offline_cache)


# ---- through the renderer: IP-Adapter units in requests -------------------------------------------

INPUTS = {"ref-a.png": shapes(1), "ref-b.png": shapes(7), "edges.png": shapes(3)}


@pytest.fixture(scope="module")
def renderer(offline_cache):
    from pipeline.controlnet import ControlNets
    from pipeline.ip_adapter import IPAdapters
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    made = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny")
    made.input_loader = INPUTS.__getitem__
    made.controlnets = ControlNets(made.pipe, {"canny": "tiny-controlnet-canny"}, cache_dir=offline_cache,
                                   prepare=made.prepare_controlnet)
    made.ip_adapters = IPAdapters(made.pipe, {"style": "tiny-ip-adapter-style"}, cache_dir=offline_cache)
    return made


def _request(*units: dict, seed: int = 5):
    from infra.schemas import RenderRequest

    return RenderRequest(prompt="a bottle on a beach", model="tiny", width=SIZE, height=SIZE, num_inference_steps=3,
                         seed=seed, controls=list(units))


def _px(image) -> np.ndarray:
    return np.asarray(image, dtype=np.float64)


STYLE_A = {"type": "style", "image": "ref-a.png"}
STYLE_B = {"type": "style", "image": "ref-b.png"}
CANNY = {"type": "canny", "image": "edges.png", "preprocess": "canny"}


def test_a_group_with_two_references_is_rendered_as_each_alone(renderer):
    from infra.controls import CONTROL_MAPS_INFO

    alone_a, alone_b = renderer.render([_request(STYLE_A)])[0], renderer.render([_request(STYLE_B, seed=6)])[0]
    together = renderer.render([_request(STYLE_A), _request(STYLE_B, seed=6)])
    assert np.abs(_px(together[0]) - _px(alone_a)).max() <= 1 and np.abs(_px(together[1]) - _px(alone_b)).max() <= 1
    plain = renderer.render([_request()])[0]
    assert np.abs(_px(alone_a) - _px(plain)).mean() > 1.0  # the reference steers it
    weightless = renderer.render([_request({**STYLE_A, "weight": 0.0})])[0]
    assert np.abs(_px(weightless) - _px(plain)).max() <= 1  # weight 0: the plain image
    (reference_map,) = together[0].info[CONTROL_MAPS_INFO]  # the unit's image, as the render's size
    assert reference_map.size == (SIZE, SIZE)
    assert renderer.pipe.unet.encoder_hid_proj is None  # unloaded after each call


def test_an_ip_adapter_and_a_controlnet_in_one_request(renderer):
    from infra.controls import CONTROL_MAPS_INFO

    both = renderer.render([_request(CANNY, STYLE_A)])[0]
    canny_only = renderer.render([_request(CANNY)])[0]
    style_only = renderer.render([_request(STYLE_A)])[0]
    assert np.abs(_px(both) - _px(canny_only)).mean() > 1.0 and np.abs(_px(both) - _px(style_only)).mean() > 1.0
    edge_map, reference = both.info[CONTROL_MAPS_INFO]
    assert set(np.unique(np.asarray(edge_map))) <= {0, 255} and len(np.unique(np.asarray(reference))) > 2


def test_each_input_is_read_once_per_call(renderer):
    from collections import Counter

    reads: Counter[str] = Counter()

    def counting(key: str):
        reads[key] += 1
        return INPUTS[key]

    renderer.input_loader = counting
    try:
        renderer.render([_request(CANNY, STYLE_A)])
    finally:
        renderer.input_loader = INPUTS.__getitem__
    # the reference is the IP-Adapter's embedding and its unit's stored map: fetched and decoded once
    assert reads == {"edges.png": 1, "ref-a.png": 1}, reads


def test_sdxl_takes_an_ip_adapter_too(offline_cache):
    """The tiny SDXL pipeline (two text encoders, text_time embedding) with an offline adapter made
    for its UNet: weight 0 is the plain render, a reference changes it."""
    from pipeline.ip_adapter import IPAdapters
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    sdxl = Renderer(load_pipeline("tiny-sdxl", cache_dir=offline_cache), model="tiny-sdxl")
    sdxl.input_loader = INPUTS.__getitem__
    sdxl.ip_adapters = IPAdapters(sdxl.pipe, {"style": "tiny-ip-adapter-style"}, cache_dir=offline_cache)

    def render(*units: dict) -> np.ndarray:
        from infra.schemas import RenderRequest

        request = RenderRequest(prompt="a bottle", model="tiny-sdxl", width=SIZE, height=SIZE, num_inference_steps=2,
                                seed=3, controls=list(units))
        return _px(sdxl.render([request])[0])

    plain = render()
    assert np.abs(render({**STYLE_A, "weight": 0.0}) - plain).max() <= 1.0
    assert np.abs(render(STYLE_A) - plain).mean() > 0.5


def test_on_a_compiled_unet_the_adapters_call_runs_eager_and_the_next_plain_one_compiled(offline_cache):
    """A compiled UNet (TorchDynamo; its eager backend: which graph serves a call is decided by the
    guards whatever the backend, tests/unit/pipeline/test_compile_count.py) held after warm-up: the
    IP-Adapter call meets other processors and runs eagerly, nothing compiles, and the next plain
    call is served by the warm-up's graph again (the pinned UNet's state exactly restored)."""
    import torch

    from pipeline import compile_count
    from pipeline.ip_adapter import IPAdapters
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    compiled = Renderer(load_pipeline("tiny", cache_dir=offline_cache), model="tiny", batch_invariant=False)
    compiled.input_loader = INPUTS.__getitem__
    compiled.ip_adapters = IPAdapters(compiled.pipe, {"style": "tiny-ip-adapter-style"}, cache_dir=offline_cache)
    torch._dynamo.reset()
    compile_count.install()
    compiled.pipe.unet.compile(dynamic=False, backend="eager")
    try:
        compiled.render([_request()])  # the warm-up's graph for this shape
        compile_count.hold_compiled()
        before = compile_count.compiles()
        calls = []
        for request in (_request(), _request(STYLE_A), _request(), _request(STYLE_B), _request()):
            with compile_count.observed() as seen:
                compiled.render([request])
            calls.append((seen.compiled > 0, seen.eager > 0))
        assert compile_count.compiles() == before
        plain, styled = (True, False), (False, True)
        assert calls == [plain, styled, plain, styled, plain], calls
    finally:
        compile_count.release_compiled()
        torch._dynamo.reset()


def test_units_in_inpaint_mode(renderer):
    """Routing lets units into inpaint for SD 1/2 and SDXL: an IP-Adapter unit beside a ControlNet
    one steers the inpaint ControlNet pipeline's image, and weight 0 leaves it as without."""
    import PIL.Image

    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[:, SIZE // 2:] = 255
    INPUTS["mask.png"] = PIL.Image.fromarray(mask)

    def inpaint(*units: dict) -> np.ndarray:
        request = _request(CANNY, *units).model_copy(update={"init_image": "edges.png", "mask_image": "mask.png",
                                                             "strength": 1.0})
        assert request.mode == "inpaint"
        return _px(renderer.render([request])[0])

    without = inpaint()
    assert np.abs(inpaint({**STYLE_A, "weight": 0.0}) - without).max() <= 1
    assert np.abs(inpaint(STYLE_A) - inpaint(STYLE_B)).mean() > 0.5
    assert renderer.pipe.unet.encoder_hid_proj is None
