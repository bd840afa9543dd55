"""Call arguments filtered per pipeline, capabilities derived from loaded pipelines, and the same
record refusing requests at submission (``infra.pools``) and at render time (``pipeline``)."""

from __future__ import annotations

import pytest
import torch

from infra.pools import FAMILIES, PoolSpec, capability_errors
from infra.routing import NoPoolError, Router
from infra.schemas import RenderRequest
from pipeline.capabilities import call_arguments, call_parameters, check_pool_family, derive_capabilities


def _bare(cls_name: str):
    """An instance of a diffusers pipeline class without its components (only the class matters)."""
    import diffusers

    cls = getattr(diffusers, cls_name)
    return cls.__new__(cls)


def _req(**kw) -> RenderRequest:
    return RenderRequest(**{"prompt": "a fox", "seed": 1, "model": "m", "width": 64, "height": 64, **kw})


def test_flux2_gets_no_negative_prompt_and_sdxl_gets_both():
    flux2 = _bare("Flux2Pipeline")
    assert "negative_prompt" not in call_parameters(flux2)
    kwargs = call_arguments(flux2, [_req(), _req(seed=2)], generators=[None, None], step_end=print)
    assert "negative_prompt" not in kwargs and kwargs["guidance_scale"] == 7.5
    assert kwargs["callback_on_step_end"] is print and kwargs["prompt"] == ["a fox", "a fox"]
    with pytest.raises(ValueError, match="takes no negative prompt"):
        call_arguments(flux2, [_req(negative_prompt="blurry")], generators=[None])
    sdxl = call_arguments(_bare("StableDiffusionXLPipeline"), [_req(negative_prompt="blurry")], generators=[None])
    assert sdxl["negative_prompt"] == ["blurry"] and sdxl["guidance_scale"] == 7.5 and "use_pe" not in sdxl


def test_ernie_gets_use_pe_from_the_pool():
    ernie = _bare("ErnieImagePipeline")
    assert call_arguments(ernie, [_req()], generators=[None])["use_pe"] is False
    assert call_arguments(ernie, [_req()], generators=[None], use_pe=True)["use_pe"] is True


@pytest.mark.parametrize("cls_name, family", [("StableDiffusionXLPipeline", "sdxl"),
                                              ("StableDiffusion3Pipeline", "sd3"),
                                              ("ErnieImagePipeline", "ernie-image"), ("Flux2Pipeline", "flux2")])
def test_derived_capabilities_are_the_table(cls_name, family):
    assert derive_capabilities(_bare(cls_name)) == FAMILIES[family]


def test_flux_schnell_and_dev_differ_by_guidance(offline_cache):
    from pipeline.models import load_pipeline

    pipe = load_pipeline("tiny-flux", cache_dir=offline_cache)
    assert derive_capabilities(pipe) == FAMILIES["flux-schnell"] and not FAMILIES["flux-schnell"].guidance_scale
    assert check_pool_family(pipe, "flux-schnell") == "flux-schnell" and check_pool_family(pipe, None) == "flux-schnell"
    with pytest.raises(ValueError, match="declares family 'flux-dev'"):
        check_pool_family(pipe, "flux-dev")  # a misdeclared pool is refused at worker start
    with pytest.raises(ValueError, match="declares family 'sdxl'"):
        check_pool_family(pipe, "sdxl")


def test_capability_errors_name_the_field():
    assert capability_errors(_req(negative_prompt="x", scheduler="ddim", width=72), "sd1") == []
    errors = {e["field"]: e for e in capability_errors(_req(negative_prompt="x", scheduler="ddim", width=72,
                                                            guidance_scale=3.5), "flux-schnell")}
    assert set(errors) == {"negative_prompt", "scheduler", "width", "guidance_scale"}
    assert capability_errors(_req(guidance_scale=7.5), "flux-schnell") == []  # the schema default: no preference
    assert capability_errors(_req(negative_prompt="x"), None) == []  # unknown family: the worker decides


def test_router_refuses_by_the_pools_family_or_the_offline_name():
    pools = [PoolSpec(name="h100-flux", model="black-forest-labs/FLUX.1-schnell", family="flux-schnell"),
             PoolSpec(name="cpu-tiny", model="tiny")]
    router = Router(pools)
    req = _req(model="black-forest-labs/FLUX.1-schnell", negative_prompt="blurry")
    with pytest.raises(NoPoolError) as info:
        router.route_all([_req(model="tiny"), req])
    assert info.value.errors[0]["index"] == 1 and info.value.errors[0]["field"] == "negative_prompt"
    assert router.route_all([_req(model="tiny", negative_prompt="blurry")]) == ["cpu-tiny"]
    assert pools[1].model_family == "sd1"
    with pytest.raises(NoPoolError, match="multiple of 16"):
        Router([]).route_all([_req(model="tiny-sd3", width=72)])  # no pools: the offline name implies sd3
    with pytest.raises(ValueError, match="unknown model family"):
        PoolSpec(name="x", model="m", family="sd9")


def test_generators_reach_the_pipeline_per_request():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    kwargs = call_arguments(_bare("StableDiffusionXLPipeline"), [_req(), _req(seed=2)], generators=gens)
    assert kwargs["generator"] is gens and kwargs["num_inference_steps"] == 20 and kwargs["output_type"] == "pil"


def test_no_negative_prompt_keeps_the_pipelines_default():
    sdxl = _bare("StableDiffusionXLPipeline")
    assert "negative_prompt" not in call_arguments(sdxl, [_req(), _req(seed=2)], generators=[None, None])


def test_sdxl_matches_diffusers_and_stays_invariant_with_mixed_negative_prompts(offline_cache):
    """SDXL encodes "no negative prompt" as zero embeddings only when a call has none: a mixed group
    is rendered as two calls, so each image is diffusers' image for that request alone."""
    import numpy as np
    from diffusers import DiffusionPipeline

    from pipeline.models import load_pipeline
    from pipeline.render import Renderer

    renderer = Renderer(load_pipeline("tiny-sdxl", cache_dir=offline_cache), model="tiny-sdxl")
    reqs = [RenderRequest(prompt=p, seed=i, model="tiny-sdxl", width=64, height=64, num_inference_steps=2,
                          negative_prompt=n) for i, (p, n) in enumerate([("a red fox", ""), ("a cat", "blurry")])]
    mixed = [np.asarray(im) for im in renderer.render(reqs)]
    base = DiffusionPipeline.from_pretrained(offline_cache / "models" / "tiny-sdxl")
    base.set_progress_bar_config(disable=True)
    ref = base(prompt=["a red fox"], width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
               generator=[torch.Generator().manual_seed(0)], output_type="np").images[0]
    assert np.abs(mixed[0].astype(float) - ref * 255).max() <= 1.0  # zero negative embeddings, as diffusers
    assert np.array_equal(np.asarray(renderer.render(reqs[1:])[0]), mixed[1])
