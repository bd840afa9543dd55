"""The A1111 ``parameters`` infotext survives encoding in every output format."""

import io

import pytest
from PIL import Image

from infra.schemas import RenderRequest
from infra.storage.images import (
    encode_image,
    format_parameters,
    parse_parameters,
    read_parameters,
    request_from_parameters,
)
from infra.storage.s3 import object_metadata


@pytest.fixture
def request_():
    return RenderRequest(prompt='a "red" fox, snow: deep\nsecond line ünïcode', negative_prompt="blurry, lowres",
                         model="tiny", width=96, height=64, num_inference_steps=12, guidance_scale=6.5, seed=123,
                         scheduler="euler_ancestral")


def test_infotext_layout(request_):
    text = format_parameters(request_, model="tiny")
    assert text.splitlines()[-1] == "Steps: 12, Sampler: Euler a, CFG scale: 6.5, Seed: 123, Size: 96x64, Model: tiny"
    assert "\nNegative prompt: blurry, lowres\n" in text


@pytest.mark.parametrize("fmt,content_type", [("png", "image/png"), ("webp", "image/webp"), ("jpeg", "image/jpeg")])
def test_round_trip_through_encoded_bytes(request_, fmt, content_type):
    image = Image.new("RGB", (96, 64), (10, 200, 30))
    text = format_parameters(request_, model="tiny", job_id="j1")
    data, ct = encode_image(image, fmt, text)
    assert ct == content_type
    assert Image.open(io.BytesIO(data)).format == {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}[fmt]
    assert read_parameters(data) == text
    back = request_from_parameters(read_parameters(data))
    skip = {"output_format", "metadata"}
    assert back.model_dump(exclude=skip) == request_.model_dump(exclude=skip)
    assert parse_parameters(text)["Job id"] == "j1"


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="output_format"):
        encode_image(Image.new("RGB", (8, 8)), "gif", "x")


def test_object_metadata_is_ascii_and_bounded(request_):
    long = request_.model_copy(update={"prompt": "ü" * 2000})
    meta = object_metadata({"seed": "1"}, format_parameters(long, model="tiny"))
    assert all(v.isascii() for v in meta.values())
    assert sum(len(k) + len(v) for k, v in meta.items()) <= 2048
    assert meta["parameters-truncated"] == "true"
    short = object_metadata({"seed": "1"}, format_parameters(request_, model="tiny"))
    assert "parameters-truncated" not in short
