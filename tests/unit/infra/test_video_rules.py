"""Video requests as data: the schema's video fields, each family's frame rules, a video pool's
declaration, routing's refusals and the cost a video is charged (no Redis, no model)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.pools import PoolSpec
from infra.routing import NoPoolError, Router
from infra.schemas import RenderRequest
from infra.video import VIDEO_RULES, frames_factor, video_errors, with_video_defaults


def video(**fields) -> RenderRequest:
    return RenderRequest(**{"prompt": "a kettle", "model": "tiny-wan", "width": 64, "height": 64,
                            "kind": "video", **fields})


def test_an_image_request_serializes_without_the_video_fields():
    image = RenderRequest(prompt="a kettle", seed=1)
    assert not image.is_video and image.duration_s is None
    assert not {"kind", "num_frames", "fps"} & set(image.model_dump())
    clip = video(num_frames=17, fps=8)
    assert clip.is_video and clip.duration_s == pytest.approx(17 / 8)
    assert RenderRequest.model_validate_json(clip.model_dump_json()) == clip


def test_video_fields_alone_make_a_video_and_an_image_kind_refuses_them():
    assert RenderRequest(prompt="x", num_frames=9).is_video
    with pytest.raises(ValidationError, match="num_frames and fps are video fields"):
        RenderRequest(prompt="x", kind="image", fps=8)


@pytest.mark.parametrize("fields, word", [({"mask_image": "inputs/" + "a" * 64 + ".png",
                                            "init_image": "inputs/" + "a" * 64 + ".png"}, "mask_image"),
                                          ({"init_image": "inputs/" + "a" * 64 + ".png", "strength": 0.5}, "strength"),
                                          ({"loras": [{"name": "x"}]}, "loras"),
                                          ({"upscale": 2, "upscaler": "tiny-esrgan-x2"}, "upscale")])
def test_a_video_refuses_the_image_only_fields(fields, word):
    with pytest.raises(ValidationError, match=f"a video request takes no {word}"):
        video(**fields)


@pytest.mark.parametrize("fps", [0, 61])
def test_fps_is_1_to_60(fps):
    with pytest.raises(ValidationError, match="fps"):
        video(fps=fps)


def test_wan_takes_4k_plus_1_frames_and_ltx_8k_plus_1_and_the_error_names_the_neighbours():
    wan, ltx = VIDEO_RULES["wan"], VIDEO_RULES["ltx"]
    assert [n for n in range(1, 20) if wan.frames_ok(n)] == [1, 5, 9, 13, 17]
    assert [n for n in range(1, 30) if ltx.frames_ok(n)] == [1, 9, 17, 25]
    [error] = video_errors(video(num_frames=10), "wan")
    assert error["type"] == "frames_rule" and "ask for 9 or 13" in error["msg"]


def test_the_pools_max_frames_and_image_to_video_are_checked():
    [over] = video_errors(video(num_frames=21), "wan", max_frames=17)
    assert over["type"] == "over_max_frames" and "max_frames 17" in over["msg"]
    assert video_errors(video(num_frames=17), "wan", max_frames=17) == []
    [i2v] = video_errors(video(num_frames=9, init_image="inputs/" + "b" * 64 + ".png"), "wan")
    assert i2v["type"] == "no_image_to_video"
    assert video_errors(video(model="tiny-ltx", num_frames=9, init_image="inputs/" + "b" * 64 + ".png"), "ltx") == []
    [image_model] = video_errors(video(model="tiny", num_frames=9), "sd1")
    assert image_model["type"] == "not_a_video_model"
    [image_kind] = video_errors(RenderRequest(prompt="x", model="tiny-wan", kind="image"), "wan")
    assert image_kind["type"] == "video_model"
    [steps] = video_errors(video(model="tiny-ltx", num_frames=9, num_inference_steps=1), "ltx")
    assert steps["type"] == "too_few_steps" and "at least 2" in steps["msg"]
    assert video_errors(video(num_frames=9, num_inference_steps=1), "wan") == []


def test_defaults_fill_what_a_video_of_its_family_leaves_out():
    filled = with_video_defaults(RenderRequest(prompt="x", model="tiny-ltx"), "ltx")
    assert (filled.kind, filled.num_frames, filled.fps) == ("video", 121, 25)
    image = RenderRequest(prompt="x")
    assert with_video_defaults(image, "sd1") is image


def test_a_video_costs_its_frames():
    assert frames_factor(video(num_frames=33, fps=16)) == 33
    assert frames_factor(RenderRequest(prompt="x")) == 1


def test_a_video_pool_batches_one_and_only_a_video_pool_takes_max_frames():
    pool = PoolSpec(name="wan", model="tiny-wan", family="wan")
    assert pool.max_batch == 1 and pool.max_frames is None  # the family's limit applies (81)
    with pytest.raises(ValidationError, match="one job per batch"):
        PoolSpec(name="wan", model="x", family="wan", max_batch=4)
    with pytest.raises(ValidationError, match="max_frames is for video pools"):
        PoolSpec(name="img", model="tiny", family="sd1", max_frames=9)


def test_routing_refuses_what_the_video_pool_cannot_render():
    router = Router([PoolSpec(name="wan", model="x/wan", family="wan", max_frames=17, max_pixels=128 * 128)])
    assert router.route_all([video(model="x/wan", num_frames=17)]) == ["wan"]
    with pytest.raises(NoPoolError) as caught:
        router.route_all([video(model="x/wan", num_frames=17), video(model="x/wan", num_frames=21, width=72)])
    [error] = caught.value.errors
    assert error["index"] == 1 and error["type"] == "size_not_multiple"


def test_wan_i2v_needs_an_init_image_and_routing_refuses_a_clip_without_one():
    image = "inputs/" + "c" * 64 + ".png"
    [missing] = video_errors(video(model="tiny-wan-i2v", num_frames=9), "wan-i2v")
    assert (missing["type"], missing["field"]) == ("needs_init_image", "init_image")
    assert "image-to-video only: send an init_image" in missing["msg"]
    assert video_errors(video(model="tiny-wan-i2v", num_frames=9, init_image=image), "wan-i2v") == []
    [rule] = video_errors(video(model="tiny-wan-i2v", num_frames=8, init_image=image), "wan-i2v")
    assert rule["type"] == "frames_rule" and "ask for 5 or 9" in rule["msg"]
    filled = with_video_defaults(RenderRequest(prompt="x", model="tiny-wan-i2v", init_image=image), "wan-i2v")
    assert (filled.kind, filled.num_frames, filled.fps) == ("video", 81, 16)  # the Wan 2.1 I2V card's clip
    assert not VIDEO_RULES["wan"].needs_image and not VIDEO_RULES["ltx"].needs_image
    router = Router([PoolSpec(name="i2v", model="tiny-wan-i2v", family="wan-i2v", max_pixels=128 * 128)])
    assert router.route_all([video(model="tiny-wan-i2v", num_frames=9, init_image=image)]) == ["i2v"]
    with pytest.raises(NoPoolError) as caught:
        router.route_all([video(model="tiny-wan-i2v", num_frames=9)])
    assert [e["type"] for e in caught.value.errors] == ["needs_init_image"]
