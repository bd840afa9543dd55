"""``renderfarm bench ready``'s flags as the GPU session script passes them, and its refusals."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import build_parser
from bench.pipeline.time_to_ready import ReadyConfig


def test_flags_of_the_gpu_script_parse() -> None:
    args = build_parser().parse_args(["ready", "--model", "sd15-arch", "--device", "cuda", "--recipe", "exact",
                                      "--buckets", "1,8", "--sizes", "512x512,768x512", "--steps", "20",
                                      "--guidance-scale", "7.5", "--json", "/tmp/ready.json"])
    assert (args.model, args.device, args.recipe, args.steps, args.guidance_scale, args.json) == \
        ("sd15-arch", "cuda", "exact", 20, 7.5, "/tmp/ready.json")
    assert args.buckets == (1, 8) and args.sizes == ((512, 512), (768, 512))


def test_bad_values_are_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ready", "--sizes", "512"])
    for bad in ({"buckets": (0,)}, {"sizes": ((4, 4),)}, {"steps": 0}, {"overrides": "{not json"},
                {"controls": ("can ny",)}):
        with pytest.raises(ValueError):
            ReadyConfig(**bad)  # type: ignore[arg-type]
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_declared_controlnets_parse_with_their_sources() -> None:
    args = build_parser().parse_args(["ready", "--controls", "canny,depth=lllyasviel/control_v11f1p_sd15_depth"])
    config = ReadyConfig(controls=args.controls)
    assert config.control_sources == {"canny": "tiny-controlnet-canny", "depth": "lllyasviel/control_v11f1p_sd15_depth"}
