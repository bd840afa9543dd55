"""The AUTOMATIC1111 img2img body, mapped onto render requests with input images.

Place in the data flow: an A1111 client (``webuiapi``'s ``img2img``) → ``POST /sdapi/v1/img2img``
(:mod:`infra.api.compat.a1111`) → **this body**: the base64 ``init_images[0]`` and ``mask`` are
checked and stored like uploads (:mod:`infra.storage.input_images`), the mask prepared as the webui does
(``mask_blur``: a Gaussian blur of that radius; ``inpainting_mask_invert``), and the txt2img fields
map as in :mod:`infra.api.compat.a1111_models` → one render request per image with ``init_image``,
``mask_image`` and ``strength`` (``denoising_strength``).

Fields the farm renders differently are refused with a 422 naming them, never ignored:
``resize_mode`` other than 0 (just resize; the farm resizes the input to ``width`` × ``height``),
more than one init image, and, with a mask, ``inpainting_fill`` other than 1 (original: the
masked area starts from the noised original, which is what diffusers' inpainting does at
``strength`` < 1), ``inpaint_full_res`` true ("only masked": not available) and an
``initial_noise_multiplier`` other than 1.

``<lora:name:weight>`` tags are taken out of the prompt into ``loras`` as for txt2img
(:func:`infra.api.compat.a1111_models.split_lora_tags`).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image, ImageFilter, ImageOps
from pydantic import Field

from infra.api.compat.a1111_models import Txt2ImgRequest
from infra.schemas import RenderRequest


def decode_base64_image(value: str) -> bytes:
    """The bytes of a base64 image as A1111 clients send it (with or without a ``data:…;base64,`` prefix).

    Raises:
        ValueError: not base64.
    """
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64 data") from None


class Img2ImgRequest(Txt2ImgRequest):
    """Body of ``POST /sdapi/v1/img2img``: the txt2img fields plus the webui's image fields."""

    init_images: list[str] = Field(min_length=1, description="Base64 images; the farm takes exactly one.")
    mask: str | None = Field(None, description="Base64 mask, white = repaint, the init image's size.")
    denoising_strength: float = Field(0.75, gt=0.0, le=1.0)
    resize_mode: int = 0
    mask_blur: int = Field(4, ge=0, le=64, description="Gaussian blur radius of the mask, pixels.")
    mask_blur_x: int | None = None
    mask_blur_y: int | None = None
    inpainting_fill: int = 0
    inpaint_full_res: bool = True
    inpaint_full_res_padding: int = 0
    inpainting_mask_invert: int = 0
    initial_noise_multiplier: float | None = None
    include_init_images: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """The txt2img refusals plus the image fields the farm renders differently."""
        out = super().unsupported()
        if len(self.init_images) > 1:
            out.append(("init_images", f"the farm takes one init image per call, got {len(self.init_images)}"))
        if self.resize_mode != 0:
            out.append(("resize_mode", "only 0 (just resize) is available"))
        if self.mask is not None:
            if self.inpainting_fill != 1:
                out.append(("inpainting_fill", "only 1 (original) is available: diffusers' inpainting starts the "
                                               "masked area from the noised original"))
            if self.inpaint_full_res:
                out.append(("inpaint_full_res", "inpainting only the masked area is not available; send false"))
            if self.initial_noise_multiplier not in (None, 1, 1.0):
                out.append(("initial_noise_multiplier", "only 1 is available"))
        return out

    def init_bytes(self) -> bytes:
        """The first init image's bytes. Raises ValueError: not base64."""
        return decode_base64_image(self.init_images[0])

    def mask_bytes(self) -> bytes | None:
        """The mask as the farm renders it: blurred by ``mask_blur`` and inverted when asked, as a
        grayscale PNG; None without a mask.

        Raises:
            ValueError: not base64 or not an image Pillow can open.
        """
        if self.mask is None:
            return None
        data = decode_base64_image(self.mask)
        if not self.mask_blur and not self.inpainting_mask_invert:
            return data
        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > 4096 * 4096:
                    return data  # the input checks refuse it with their own reason
                mask = img.convert("L")
        except (OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"the mask is not an image ({type(exc).__name__})") from None
        if self.inpainting_mask_invert:
            mask = ImageOps.invert(mask)
        if self.mask_blur:
            mask = mask.filter(ImageFilter.GaussianBlur(self.mask_blur))
        buf = io.BytesIO()
        mask.save(buf, "PNG")
        return buf.getvalue()

    def image_requests(self, first_seed: int, model: str | None, init_key: str,
                       mask_key: str | None, controls: Sequence[Mapping[str, Any]] = ()) -> list[RenderRequest]:
        """One render request per image with the stored inputs' keys, ``denoising_strength`` and
        the control units ``controls``.

        Raises: as :meth:`Txt2ImgRequest.render_requests`."""
        requests = self.render_requests(first_seed, model, controls)
        update = {"init_image": init_key, "mask_image": mask_key, "strength": self.denoising_strength}
        return [RenderRequest.model_validate({**r.model_dump(), **update}) for r in requests]
