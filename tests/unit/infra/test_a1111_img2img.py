"""The A1111 mapping of image inputs and adapters, without a server: <lora:…> tags, the img2img
fields the farm renders differently, the mask preparation (blur, invert), OpenAI's alpha mask."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from infra.api.compat.a1111_img2img import Img2ImgRequest, decode_base64_image
from infra.api.compat.a1111_models import Txt2ImgRequest, split_lora_tags
from infra.api.compat.openai_edits import openai_mask


def test_lora_tags_become_adapters():
    assert split_lora_tags("a mug, <lora:brand:0.8> on a table <lora:style>") == (
        "a mug, on a table", [{"name": "brand", "weight": 0.8}, {"name": "style", "weight": 1.0}])
    assert split_lora_tags("no tags here") == ("no tags here", [])
    with pytest.raises(ValueError, match="must be a number"):
        split_lora_tags("<lora:brand:strong>")
    [request] = Txt2ImgRequest(prompt="<lora:brand:0.5> a lamp", width=64, height=64).render_requests(1, "tiny")
    assert request.prompt == "a lamp" and [(a.name, a.weight) for a in request.loras] == [("brand", 0.5)]


def _b64(image: Image.Image) -> str:
    import base64

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_fields_rendered_differently_are_named_only_where_they_matter():
    photo = _b64(Image.new("RGB", (64, 64)))
    assert Img2ImgRequest(init_images=[photo], prompt="x").unsupported() == []  # no mask: inpainting fields moot
    named = [f for f, _ in Img2ImgRequest(init_images=[photo, photo], mask=photo, prompt="x", resize_mode=2,
                                          initial_noise_multiplier=0.9).unsupported()]
    assert named == ["init_images", "resize_mode", "inpainting_fill", "inpaint_full_res", "initial_noise_multiplier"]


def test_the_mask_is_blurred_and_inverted_as_asked():
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255
    body = Img2ImgRequest(init_images=["x"], mask=_b64(Image.fromarray(mask)), prompt="x", mask_blur=4,
                          inpainting_mask_invert=1)
    out = np.asarray(Image.open(io.BytesIO(body.mask_bytes())))
    assert out[0, 0] == 255 and out[0, 63] == 0 and 0 < out[0, 32] < 255  # inverted, soft edge
    with pytest.raises(ValueError, match="not base64"):
        decode_base64_image("***")


def test_openai_masks_repaint_the_transparent_pixels():
    rgba = np.full((8, 8, 4), 255, np.uint8)
    rgba[:, 4:, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    out = np.asarray(Image.open(io.BytesIO(openai_mask(buf.getvalue()))))
    assert out[:, :4].max() == 0 and out[:, 4:].min() == 255
    rgb = io.BytesIO()
    Image.new("RGB", (8, 8)).save(rgb, "PNG")
    with pytest.raises(ValueError, match="alpha channel"):
        openai_mask(rgb.getvalue())
