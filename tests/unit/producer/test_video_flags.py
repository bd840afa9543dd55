"""``renderfarm submit``'s video flags: ``--video``, ``--frames`` and ``--fps`` make video requests
(positional prompts as well as ``--prompt``); without them a request stays an image's; what a
video cannot take is refused by name before anything is sent."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from producer.cli import _requests_from_args, register


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["submit", *argv])


def test_video_frames_and_fps_make_a_video_request():
    (request,) = _requests_from_args(_parse("--video", "--frames", "49", "--fps", "24", "a product turning"))
    assert (request.prompt, request.kind, request.num_frames, request.fps) == ("a product turning", "video", 49, 24)
    assert request.duration_s == pytest.approx(49 / 24)


@pytest.mark.parametrize("flags", [["--video"], ["--frames", "9"], ["--fps", "8"]])
def test_each_video_flag_alone_makes_a_video_leaving_the_rest_to_the_family(flags):
    (request,) = _requests_from_args(_parse(*flags, "--prompt", "a mug"))
    assert request.kind == "video" and request.is_video
    dumped = request.model_dump()
    assert ("num_frames" in dumped) == ("--frames" in flags) and ("fps" in dumped) == ("--fps" in flags)


def test_without_video_flags_the_request_is_an_images_as_before():
    requests = _requests_from_args(_parse("a mug", "a cup", "--seed", "5"))
    assert [r.prompt for r in requests] == ["a mug", "a cup"] and [r.seed for r in requests] == [5, 6]
    assert all(not r.is_video and "kind" not in r.model_dump() for r in requests)


def test_what_a_video_cannot_take_is_refused_by_name():
    with pytest.raises(ValidationError, match="a video request takes no upscale"):
        _requests_from_args(_parse("--frames", "9", "--upscale", "2", "--upscaler", "x", "a mug"))
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        _requests_from_args(_parse("--frames", "0", "a mug"))
