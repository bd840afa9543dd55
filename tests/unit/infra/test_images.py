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


def test_metadata_values_round_trip_as_rfc_2047_encoded_words():
    from email.header import decode_header, make_header

    from infra.storage.s3 import decode_metadata, encode_metadata

    prompt = "一幅山水画，远山与小桥流水，水墨风格"
    encoded = encode_metadata(prompt)
    assert encoded.isascii() and encoded.startswith("=?UTF-8?B?") and encoded.endswith("?=")
    assert all(len(word) <= 75 for word in encoded.split(" "))  # RFC 2047 §2
    assert decode_metadata(encoded) == prompt
    assert str(make_header(decode_header(encoded))) == prompt  # the standard library reads it the same
    assert encode_metadata("tiny") == "tiny" and decode_metadata("tiny") == "tiny"  # plain ASCII stays plain
    text = "line one\nSeed: 7"
    assert decode_metadata(encode_metadata(text)) == text


def test_a_chinese_infotext_round_trips_through_png_and_metadata():
    from infra.storage.s3 import decode_metadata

    request = RenderRequest(prompt="红烧肉，特写，美食摄影", negative_prompt="模糊", model="taiyi", seed=5, width=64,
                            height=64, upscale=4, upscaler="esrgan-x4-arch")
    text = format_parameters(request, model="taiyi")
    assert text.splitlines()[-1].endswith("Postprocess upscale by: 4, Postprocess upscaler: esrgan-x4-arch")
    data, _ = encode_image(Image.new("RGB", (256, 256)), "png", text)
    back = request_from_parameters(read_parameters(data))
    assert back.prompt == request.prompt and back.negative_prompt == "模糊"
    assert (back.upscale, back.upscaler) == (4, "esrgan-x4-arch")
    meta = object_metadata({"seed": "5"}, text)
    assert all(v.isascii() for v in meta.values())
    assert decode_metadata(meta["parameters"]) == text


def test_a_truncated_chinese_infotext_is_cut_at_a_word_boundary():
    from infra.storage.s3 import decode_metadata

    long = RenderRequest(prompt="山" * 2000, model="tiny", seed=1)
    meta = object_metadata({"seed": "1"}, format_parameters(long, model="tiny"))
    assert meta["parameters-truncated"] == "true"
    assert sum(len(k) + len(v) for k, v in meta.items()) <= 2048
    assert set(decode_metadata(meta["parameters"])) == {"山"}  # whole characters only


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_png_is_lossless_and_its_text_chunk_valid_for_every_encoder(request_, mode, monkeypatch):
    """fpng (RGB, RGBA) and Pillow (other modes, or fpng absent) both give back the same pixels and
    the infotext, in a file whose chunk CRCs Pillow checks (``verify``)."""
    from infra.storage import images
    from pipeline.null import null_image

    image = null_image(96, 64, 5).convert(mode)
    text = format_parameters(request_, model="tiny")
    encoded = [images.encode_png(image, text)]
    monkeypatch.setattr(images, "_FPNG", None)
    encoded.append(images.encode_png(image, text))
    for data in encoded:
        with Image.open(io.BytesIO(data)) as check:
            check.verify()  # raises on a bad CRC or a truncated chunk
        with Image.open(io.BytesIO(data)) as back:
            assert back.mode == mode and back.tobytes() == image.tobytes()
        assert read_parameters(data) == text
    assert images._fpng_encoder() is not None  # the worker extra installs it: the first row was fpng's
