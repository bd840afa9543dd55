"""Render modes from one pinned pipeline: img2img and inpainting share its weights, honour the
mask, run about steps × strength denoising steps, and refuse what diffusers cannot do."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from infra.pools import FAMILIES, OFFLINE_FAMILIES
from infra.schemas import RenderRequest
from pipeline.render import compat_key

SIZE = 64


def _photo(seed: int = 1) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def _mask() -> PIL.Image.Image:  # white (repaint) on the right half
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[:, SIZE // 2:] = 255
    return PIL.Image.fromarray(mask)


INPUTS = {"photo.png": _photo(), "other.png": _photo(2), "mask.png": _mask()}


def _request(model: str, **fields) -> RenderRequest:
    return RenderRequest(prompt="a product on a table", model=model, width=SIZE, height=SIZE, num_inference_steps=4,
                         seed=3, guidance_scale=1.0 if model == "tiny-flux" else 7.5, **fields)


def test_compat_key_separates_modes_strengths_and_adapters():
    txt = _request("tiny")
    img = _request("tiny", init_image="photo.png", strength=0.5)
    assert compat_key(txt) == compat_key(txt.model_copy(update={"prompt": "other"}))
    assert compat_key(img) == compat_key(img.model_copy(update={"init_image": "other.png", "seed": 9}))
    keys = {compat_key(r) for r in (txt, img, img.model_copy(update={"strength": 0.6}),
                                      img.model_copy(update={"mask_image": "mask.png"}),
                                      _request("tiny", loras=[{"name": "brand", "weight": 0.8}]),
                                      _request("tiny", loras=[{"name": "brand", "weight": 0.5}]))}
    assert len(keys) == 6


@pytest.fixture(scope="module")
def renderers(offline_cache):
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    made = {}

    def get(model: str):
        if model not in made:
            renderer = Renderer(load_pipeline(model, cache_dir=offline_cache), model=model)
            renderer.input_loader = INPUTS.__getitem__
            made[model] = renderer
        return made[model]
    return get


MODE_MODELS = ["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux"]


@pytest.mark.parametrize("model", MODE_MODELS)
def test_img2img_and_inpaint_share_the_pinned_weights(renderers, model):
    renderer = renderers(model)
    steps: dict[str, list[tuple[int, int]]] = {"img2img": [], "inpaint": []}
    for mode, extra in (("img2img", {}), ("inpaint", {"mask_image": "mask.png"})):
        request = _request(model, init_image="photo.png", strength=0.5, **extra)
        assert request.mode == mode
        images = renderer.render([request], on_step=lambda done, total, m=mode: steps[m].append((done, total)))
        assert images[0].size == (SIZE, SIZE)
        assert renderer.modes.shares_weights(mode), f"{model} {mode}: from_pipe copied a module"
    # strength 0.5 of 4 steps: 2 denoising steps run, and progress counts those
    assert steps["img2img"][-1] == (2, 2), steps
    assert steps["inpaint"][-1][0] == steps["inpaint"][-1][1] == 2, steps


def test_inpaint_keeps_the_unmasked_half_closer_than_img2img(renderers):
    renderer = renderers("tiny")
    photo = np.asarray(INPUTS["photo.png"], dtype=np.float32)
    inpainted = np.asarray(renderer.render([_request("tiny", init_image="photo.png", mask_image="mask.png",
                                                     strength=1.0)])[0], dtype=np.float32)
    diff = np.abs(inpainted - photo)
    left, right = diff[:, : SIZE // 2 - 8].mean(), diff[:, SIZE // 2 + 8:].mean()
    assert left < right, (left, right)


def test_a_family_without_a_mode_says_so(renderers):
    assert "img2img" not in FAMILIES["ernie-image"].modes and "inpaint" not in FAMILIES["kolors"].modes
    assert {OFFLINE_FAMILIES[m] for m in MODE_MODELS} <= {f for f, c in FAMILIES.items() if "inpaint" in c.modes}


def test_a_renderer_without_a_loader_refuses_inputs(offline_cache, tiny_pipe):
    from pipeline.render import Renderer

    with pytest.raises(ValueError, match="no input loader"):
        Renderer(tiny_pipe, model="tiny").render([_request("tiny", init_image="photo.png")])


def test_kolors_renders_img2img_from_its_components(renderers):
    renderer = renderers("tiny-kolors")
    steps: list[tuple[int, int]] = []
    [image] = renderer.render([_request("tiny-kolors", init_image="photo.png", strength=0.5)],
                              on_step=lambda done, total: steps.append((done, total)))
    assert image.size == (SIZE, SIZE) and steps[-1] == (2, 2) and renderer.modes.shares_weights("img2img")
    assert FAMILIES["kolors"].modes == ("txt2img", "img2img")
