"""ControlNet units at the edge: the request's validation (each refusal names its field), the pool
declarations and routing (an undeclared type, too many units, a family or mode without a ControlNet
pipeline), the compat key (the unit set, not images or weights) and the units' infotext."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from infra.controls import ControlSpec
from infra.pools import PoolSpec
from infra.routing import NoPoolError, Router
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.storage.images import format_parameters, parse_parameters
from pipeline.compat import compat_key

CANNY = {"type": "canny", "image": "inputs/edges.png"}


def _request(*units: dict, **fields) -> RenderRequest:
    return RenderRequest(prompt="a bottle on a beach", model="tiny", width=64, height=64, seed=1,
                         controls=list(units), **fields)


@pytest.mark.parametrize(("unit", "field", "words"), [
    ({**CANNY, "weight": 2.5}, "weight", "less than or equal to 2"),
    ({**CANNY, "weight": -0.1}, "weight", "greater than or equal to 0"),
    ({**CANNY, "guidance_start": 0.8, "guidance_end": 0.5}, "controls.0", "guidance_start (0.8) must be at most"),
    ({**CANNY, "guidance_end": 1.5}, "guidance_end", "less than or equal to 1"),
    ({**CANNY, "preprocess": "depth_midas"}, "preprocess", "'none' or 'canny'"),
    ({**CANNY, "low_threshold": 50}, "controls.0", "apply to preprocess 'canny' only"),
    ({**CANNY, "preprocess": "canny", "low_threshold": 200, "high_threshold": 100}, "controls.0",
     "low_threshold (200) must be at most high_threshold (100)"),
    ({**CANNY, "preprocess": "canny", "high_threshold": 256}, "high_threshold", "less than or equal to 255"),
    ({**CANNY, "image": "../secrets.png"}, "image", "image must be an object key"),
    ({**CANNY, "image": "http://example.com/a.png"}, "image", "https:// URL"),
    ({**CANNY, "type": "no spaces"}, "type", "type must be 1–100"),
    ({**CANNY, "strength": 1}, "strength", "Extra inputs are not permitted"),
    ({"type": "canny"}, "image", "Field required"),
])
def test_a_bad_unit_is_refused_naming_its_field(unit, field, words):
    with pytest.raises(ValidationError) as refused:
        _request(unit)
    [error] = refused.value.errors()
    assert ".".join(map(str, error["loc"])).startswith("controls.0")
    assert field in ".".join(map(str, error["loc"])) and words in str(refused.value), refused.value


def test_at_most_eight_units_fit_the_schema():
    with pytest.raises(ValidationError, match="at most 8"):
        _request(*[CANNY] * 9)
    unit = _request({**CANNY, "preprocess": "canny"}).controls[0]
    assert unit.canny_thresholds == (100, 200) and unit.weight == 1.0 and unit.resize == "resize"


def test_the_compat_key_holds_the_unit_set_not_images_or_weights():
    plain, canny = _request(), _request(CANNY)
    other_image = _request({**CANNY, "image": "inputs/other.png", "weight": 0.3, "guidance_end": 0.5})
    assert compat_key(canny) == compat_key(other_image) != compat_key(plain)
    assert compat_key(canny) != compat_key(_request({**CANNY, "preprocess": "canny"}))
    assert compat_key(canny) != compat_key(_request(CANNY, {**CANNY, "type": "depth"}))
    assert compat_key(_request(CANNY, {**CANNY, "type": "depth"})) != compat_key(_request({**CANNY, "type": "depth"},
                                                                                          CANNY))


POOL = PoolSpec(name="cn", model="tiny", max_controls=2,
                controls=(ControlSpec(name="canny", source="tiny-controlnet-canny"),
                          ControlSpec(name="depth", source="tiny-controlnet-depth")))


def _refusal(router: Router, request: RenderRequest) -> dict:
    with pytest.raises(NoPoolError) as refused:
        router.route_all([request])
    return refused.value.errors[0]


def test_routing_checks_the_pools_declared_controls():
    router = Router([POOL, PoolSpec(name="ernie", model="tiny-ernie-image")])
    assert router.route_all([_request(CANNY, {**CANNY, "type": "depth"})]) == ["cn"]
    unknown = _refusal(router, _request({**CANNY, "type": "pose"}))
    assert unknown["type"] == "unknown_control" and unknown["field"] == "controls"
    assert "pool 'cn' has no ControlNet or IP-Adapter 'pose' (it has: 'canny', 'depth')" in unknown["msg"]
    many = _refusal(router, _request(CANNY, CANNY, CANNY))
    assert many["type"] == "too_many_controls" and "at most 2 control unit(s) per request, got 3" in many["msg"]
    family = _refusal(router, _request(CANNY).model_copy(update={"model": "tiny-ernie-image"}))
    assert family["type"] == "unsupported_controlnet"
    assert ("model 'tiny-ernie-image' (family ernie-image) has no ControlNet pipeline for mode 'txt2img'"
            in family["msg"])
    assert router.route_all([_request(CANNY, init_image="inputs/a.png", mask_image="inputs/m.png")]) == ["cn"]


def _pool(model: str, *extra: ControlSpec) -> PoolSpec:
    return PoolSpec(name=model, model=model, controls=(ControlSpec(name="canny", source="tiny-controlnet-canny"),
                                                      *extra))


IMG2IMG = {"init_image": "inputs/a.png"}
INPAINT = {"init_image": "inputs/a.png", "mask_image": "inputs/m.png"}


@pytest.mark.parametrize(("model", "fields"), [
    ("tiny", INPAINT), ("tiny-sdxl", INPAINT), ("tiny-sd3", {}), ("tiny-flux", {}), ("tiny-flux", IMG2IMG),
    ("tiny-flux", INPAINT)])
def test_routing_accepts_units_where_diffusers_has_a_controlnet_pipeline(model, fields):
    request = _request(CANNY, **fields).model_copy(update={"model": model})
    assert Router([_pool(model)]).route_all([request]) == [model]


@pytest.mark.parametrize(("model", "fields", "words"), [
    ("tiny-sd3", IMG2IMG, "(family sd3) has no ControlNet pipeline for mode 'img2img' on this farm; it takes "
                          "control units in txt2img"),
    ("tiny-sd3", INPAINT, "(family sd3) has no ControlNet pipeline for mode 'inpaint'"),
    ("tiny-ernie-image", {}, "(family ernie-image) has no ControlNet pipeline for mode 'txt2img' on this farm"),
    ("tiny-kolors", {}, "(family kolors) has no ControlNet pipeline for mode 'txt2img'")])
def test_routing_refuses_units_where_diffusers_has_none(model, fields, words):
    refused = _refusal(Router([_pool(model)]), _request(CANNY, **fields).model_copy(update={"model": model}))
    assert refused["type"] == "unsupported_controlnet" and refused["field"] == "controls"
    assert words in refused["msg"], refused["msg"]


def test_ip_adapter_units_are_refused_outside_the_unet_families():
    style = ControlSpec(name="style", source="tiny-ip-adapter-style", kind="ip-adapter")
    unit = {"type": "style", "image": "inputs/a.png"}
    assert Router([_pool("tiny", style)]).route_all([_request(unit)]) == ["tiny"]
    refused = _refusal(Router([_pool("tiny-flux", style)]), _request(unit).model_copy(update={"model": "tiny-flux"}))
    assert refused["type"] == "unsupported_ip_adapter" and refused["field"] == "controls"
    assert "model 'tiny-flux' takes no IP-Adapter units ('style' is one)" in refused["msg"]


def test_without_declared_pools_the_settings_list_applies(monkeypatch):
    monkeypatch.setenv("RENDERFARM_CONTROLS", '[{"name": "canny", "source": "tiny-controlnet-canny"}]')
    settings = Settings()
    assert [c.name for c in settings.controls] == ["canny"]
    router = Router(controls=settings.controls)
    assert router.route_all([_request(CANNY, CANNY, CANNY)]) == ["tiny"]
    assert "RENDERFARM_CONTROLS (no pool is declared) allows at most 3" in _refusal(
        router, _request(CANNY, CANNY, CANNY, CANNY))["msg"]
    assert "has no ControlNet or IP-Adapter 'canny' (it has: none)" in _refusal(Router(), _request(CANNY))["msg"]


def test_a_pool_declares_controls_as_it_declares_adapters():
    with pytest.raises(ValidationError, match="max_controls"):
        PoolSpec(name="cn", model="tiny", max_controls=9)
    with pytest.raises(ValidationError, match="source"):
        PoolSpec.model_validate({"name": "cn", "model": "tiny", "controls": [{"name": "canny"}]})


def test_a_pool_declares_the_unit_sets_its_compiled_workers_warm():
    assert POOL.control_sets is None  # the warm-up's default: each declared ControlNet alone
    pool = PoolSpec.model_validate({**POOL.model_dump(), "control_sets": [["canny"], ["canny", "depth"]]})
    assert pool.control_sets == (("canny",), ("canny", "depth"))
    assert PoolSpec.model_validate({**POOL.model_dump(), "control_sets": []}).control_sets == ()
    style = ControlSpec(name="style", source="tiny-ip-adapter-style", kind="ip-adapter")
    for sets, words in (([["pose"]], "unknown: ['pose']"), ([[]], "must name 1 to max_controls (2)"),
                        ([["canny", "depth", "canny"]], "must name 1 to max_controls (2)"),
                        ([["style"]], "unknown: ['style']")):  # an IP-Adapter is no ControlNet: nothing to warm
        with pytest.raises(ValidationError, match=re.escape(words)):
            PoolSpec.model_validate({**POOL.model_dump(), "controls": [*POOL.controls, style], "control_sets": sets})


def test_the_infotext_carries_each_unit_as_sd_webui_controlnet_writes_it():
    request = _request({**CANNY, "preprocess": "canny", "weight": 0.8, "low_threshold": 50},
                       {**CANNY, "type": "depth", "guidance_start": 0.2, "resize": "crop"})
    text = format_parameters(request, model="tiny")
    assert ('ControlNet 0: "Module: canny, Model: canny, Weight: 0.8, Resize Mode: Just Resize, Threshold A: 50, '
            'Threshold B: 200, Guidance Start: 0, Guidance End: 1, Pixel Perfect: True, Control Mode: Balanced"'
            ) in text
    params = parse_parameters(text)
    assert params["ControlNet 1"].startswith("Module: none, Model: depth, Weight: 1, Resize Mode: Crop and Resize, "
                                             "Guidance Start: 0.2")
    assert params["Seed"] == "1"  # the fields after the units still parse


def test_ip_adapter_declarations_and_the_units_they_refuse():
    pool = PoolSpec(name="ip", model="tiny", max_controls=3, controls=[
        ControlSpec(name="canny", source="tiny-controlnet-canny"),
        ControlSpec(name="style", source="h94/IP-Adapter", kind="ip-adapter", subfolder="models",
                    weight_name="ip-adapter_sd15.safetensors", image_encoder_folder="models/image_encoder")])
    router = Router([pool])
    style = {"type": "style", "image": "inputs/mood.png"}
    assert router.route_all([_request(CANNY, style)]) == ["ip"]
    two = _refusal(router, _request(style, {**style, "image": "inputs/other.png"}))
    assert two["type"] == "too_many_ip_adapters" and "at most one IP-Adapter unit per request, got 2" in two["msg"]
    edges = _refusal(router, _request({**style, "preprocess": "canny"}))
    assert edges["type"] == "ip_adapter_preprocess" and "preprocess must be 'none', not 'canny'" in edges["msg"]
    late = _refusal(router, _request({**style, "guidance_start": 0.5}))
    assert late["type"] == "ip_adapter_guidance" and "conditions every step" in late["msg"]
    with pytest.raises(ValidationError, match="apply to kind 'ip-adapter' only"):
        ControlSpec(name="canny", source="lllyasviel/sd-controlnet-canny", weight_name="x.safetensors")
    with pytest.raises(ValidationError, match="not an s3:// key"):
        ControlSpec(name="style", source="s3://adapters/ip.safetensors", kind="ip-adapter")
