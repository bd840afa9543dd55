"""ControlNet units beyond SD 1/2 txt2img/img2img, on the real diffusers pipelines with offline
tiny models: SD3 (``SD3ControlNetModel``) and FLUX.1 (``FluxControlNetModel``) ControlNets built
from the tiny transformers, whose control image goes through the VAE; and inpainting with units
(SD 1.x, SDXL and FLUX.1 ControlNet inpaint pipelines, ``AutoPipelineForInpainting.from_pipe``).
Each: weight 0 is the plain render within 1/255, the control image visibly changes the image, a
seed renders the same image again, the unmasked region stays the init image's."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from infra.schemas import RenderRequest
from tests.control_images import shapes

SIZE = 64
_MASK = np.zeros((SIZE, SIZE), np.uint8)
_MASK[:, SIZE // 2:] = 255  # white (repaint) on the right half
INPUTS = {"a.png": shapes(1), "b.png": shapes(7), "photo.png": shapes(3).rotate(90),
          "mask.png": PIL.Image.fromarray(_MASK)}
CLASSES = {"tiny": ("ControlNetModel", "StableDiffusionControlNetInpaintPipeline"),
           "tiny-sdxl": ("ControlNetModel", "StableDiffusionXLControlNetInpaintPipeline"),
           "tiny-sd3": ("SD3ControlNetModel", "StableDiffusion3ControlNetPipeline"),
           "tiny-flux": ("FluxControlNetModel", "FluxControlNetInpaintPipeline")}


@pytest.fixture(scope="module")
def renderers(offline_cache):
    from pipeline.controlnet import ControlNets
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    made: dict = {}

    def get(model: str):
        if model not in made:
            renderer = Renderer(load_pipeline(model, cache_dir=offline_cache), model=model)
            renderer.input_loader = INPUTS.__getitem__
            renderer.controlnets = ControlNets(renderer.pipe, {n: f"tiny-controlnet-{n}" for n in ("canny", "depth")},
                                               cache_dir=offline_cache, prepare=renderer.prepare_controlnet)
            made[model] = renderer
        return made[model]
    return get


def _render(renderer, *units: dict, **fields) -> np.ndarray:
    request = RenderRequest(prompt="a bottle on a beach", model=renderer.model, width=SIZE, height=SIZE,
                            num_inference_steps=2, seed=3, guidance_scale=1.0 if "flux" in renderer.model else 7.5,
                            controls=list(units), **fields)
    return np.asarray(renderer.render([request])[0], dtype=np.float64)


def _unit(image: str, **fields) -> dict:
    return {"type": "canny", "image": image, **fields}


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_latent_controlnets_follow_their_image_and_weight_zero_is_the_plain_render(renderers, model):
    renderer = renderers(model)
    plain = _render(renderer)
    zero = _render(renderer, _unit("a.png", weight=0.0))
    assert np.abs(zero - plain).max() <= 1.0, np.abs(zero - plain).max()
    a, b = _render(renderer, _unit("a.png")), _render(renderer, _unit("b.png"))
    assert np.abs(a - plain).mean() > 1.0, np.abs(a - plain).mean()
    assert np.abs(a - b).mean() > 1.0, np.abs(a - b).mean()  # only the control image differs
    assert np.array_equal(_render(renderer, _unit("a.png")), a)  # the control latents draw no noise
    two = _render(renderer, _unit("a.png"), {"type": "depth", "image": "b.png"})
    assert np.abs(two - a).mean() > 0.5
    made = renderer.controlnets.pipeline("txt2img", ["canny"])
    assert type(made).__name__ == CLASSES[model][1].replace("Inpaint", "")
    assert type(made.controlnet.nets[0]).__name__ == CLASSES[model][0]
    assert renderer.controlnets.shares_base_weights("txt2img", ["canny"])


def test_sd3_has_no_img2img_or_inpaint_controlnet_pipeline(renderers):
    controlnets = renderers("tiny-sd3").controlnets
    for mode in ("img2img", "inpaint"):
        with pytest.raises(ValueError, match=f"StableDiffusion3Pipeline has no {mode} ControlNet pipeline"):
            controlnets.pipeline(mode, ["canny"])


def test_flux_units_in_img2img(renderers):
    renderer = renderers("tiny-flux")
    fields = {"init_image": "photo.png", "strength": 0.7}
    plain = _render(renderer, **fields)
    assert np.abs(_render(renderer, _unit("a.png", weight=0.0), **fields) - plain).max() <= 1.0
    a, b = _render(renderer, _unit("a.png"), **fields), _render(renderer, _unit("b.png"), **fields)
    assert np.abs(a - b).mean() > 1.0, np.abs(a - b).mean()
    assert type(renderer.controlnets.pipeline("img2img", ["canny"])).__name__ == "FluxControlNetImg2ImgPipeline"


@pytest.mark.parametrize("model", ["tiny", "tiny-sdxl", "tiny-flux"])
def test_inpaint_with_a_unit_keeps_the_unmasked_region_and_follows_its_image(renderers, model):
    """Left half kept (mask black), right half repainted: a unit changes the repainted half at least
    twice as much as the kept one, against the plain inpaint render and against another control
    image. (A random-weight VAE neither reproduces the init image nor keeps its decoder from
    spreading the repainted latents a little into the kept half, so "kept" is measured against the
    plain inpaint render, not the photo; ``test_modes`` checks the mode itself.)"""
    renderer = renderers(model)
    fields = {"init_image": "photo.png", "mask_image": "mask.png", "strength": 1.0}
    plain = _render(renderer, **fields)
    assert np.abs(_render(renderer, _unit("a.png", weight=0.0), **fields) - plain).max() <= 1.0
    a, b = _render(renderer, _unit("a.png"), **fields), _render(renderer, _unit("b.png"), **fields)
    kept, repainted = slice(0, SIZE // 2 - 8), slice(SIZE // 2 + 8, SIZE)
    for changed in (np.abs(a - plain), np.abs(a - b)):
        assert changed[:, repainted].mean() > max(1.0, 2 * changed[:, kept].mean()), (
            changed[:, repainted].mean(), changed[:, kept].mean())
    assert type(renderer.controlnets.pipeline("inpaint", ["canny"])).__name__ == CLASSES[model][1]
    assert renderer.controlnets.shares_base_weights("inpaint", ["canny"])


@pytest.mark.parametrize("invariance", ["per-sample", "cpu-kernels"])
@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_two_requests_with_units_render_together_as_alone(offline_cache, model, invariance):
    """Both batch invariances: the CPU's invariant kernels, and accelerators' per-sample calls of the
    denoiser and the ControlNets (made here on the CPU), where the transformers' ControlNet residual
    lists (SD3's ``block_controlnet_hidden_states``, FLUX's ``controlnet_block_samples`` and
    ``controlnet_single_block_samples``) are split tensor by tensor: two requests rendered together
    are each the image rendered alone."""
    from pipeline.controlnet import ControlNets
    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    per_sample = invariance == "per-sample"
    renderer = Renderer(load_pipeline(model, cache_dir=offline_cache), model=model, batch_invariant=not per_sample)
    if per_sample:
        renderer.invariance = "per-sample"
    assert renderer.invariance == invariance
    renderer.input_loader = INPUTS.__getitem__
    renderer.controlnets = ControlNets(renderer.pipe, {"canny": "tiny-controlnet-canny"}, cache_dir=offline_cache,
                                       prepare=renderer.prepare_controlnet)
    requests = [RenderRequest(prompt=prompt, model=model, width=SIZE, height=SIZE, num_inference_steps=2, seed=seed,
                              guidance_scale=1.0 if "flux" in model else 7.5, controls=[_unit(image)])
                for prompt, seed, image in (("a bottle", 3, "a.png"), ("a red car on a road", 4, "b.png"))]
    alone = [np.asarray(renderer.render([r])[0], dtype=np.float64) for r in requests]
    together = [np.asarray(image, dtype=np.float64) for image in renderer.render(requests)]
    for lone, grouped in zip(alone, together, strict=True):
        assert np.abs(lone - grouped).max() <= 1.0, np.abs(lone - grouped).max()


def test_a_flux_controlnet_from_a_single_file_is_refused_by_name(renderers, tmp_path):
    """diffusers' FluxControlNetModel has no ``from_single_file``: a checkpoint file (or ``s3://`` key)
    declared for a FLUX.1 worker fails with the class named, before anything is fetched."""
    from pipeline.controlnet import ControlNets

    checkpoint = tmp_path / "canny.safetensors"
    checkpoint.write_bytes(b"not read")
    fetched: list[str] = []
    controlnets = ControlNets(renderers("tiny-flux").pipe, {"file": str(checkpoint), "bucket": "s3://cn/canny.st"},
                              fetch=lambda key: fetched.append(key) or checkpoint)
    for name in ("file", "bucket"):
        with pytest.raises(ValueError, match="a FluxControlNetModel loads from a diffusers directory or hub id"):
            controlnets.pipeline("txt2img", [name])
    assert fetched == []
