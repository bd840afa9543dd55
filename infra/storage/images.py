"""Image encoding with generation parameters embedded, as AUTOMATIC1111's "PNG Info" reads them.

Data flow: worker → pipeline renders a PIL image → **here** it becomes PNG/WebP/JPEG bytes with
a ``parameters`` text → storage uploads the bytes. PNG is written by fpng where the worker extra
installed it (17–34× less CPU than Pillow's zlib level 1 for the same bytes, see
:data:`_FPNG`), else by Pillow.

The ``parameters`` text is A1111's infotext layout::

    a red fox in the snow
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 7, Size: 512x512, Model: tiny

``Size`` is the diffusion size; an upscaled image adds ``Postprocess upscale by: 4, Postprocess
upscaler: esrgan-x4-arch`` (the names A1111's extras tab writes).

``Sampler`` names the scheduler the image was really rendered with, in A1111's words
(:mod:`infra.storage.samplers`): for a request that kept the model's own scheduler, the worker names
that scheduler (``DDIM``, ``DPM++ 2M Karras``, …), so the text never says "Default" when a
worker knew better.

PNG keeps it in a ``tEXt``/``iTXt`` chunk named ``parameters``; WebP and JPEG keep it in the EXIF
``UserComment`` tag with the ``UNICODE`` prefix, which is where A1111 writes it for those formats.
"""

from __future__ import annotations

import io
import json
import re
import struct
import zlib
from collections.abc import Callable

from PIL import Image, PngImagePlugin

from infra.schemas import CONTENT_TYPES, ControlUnit, RenderRequest
from infra.storage import samplers

_EXIF_IFD = 0x8769
_USER_COMMENT = 0x9286
_PARAM_RE = re.compile(r'\s*([\w ]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def _quote(value: str) -> str:
    """A1111 quotes a value that holds a comma, colon or quote, JSON style."""
    return json.dumps(value, ensure_ascii=False) if any(c in value for c in ',:"\n') else value


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def format_parameters(request: RenderRequest, *, model: str, job_id: str | None = None,
                      scheduler: str | None = None, lora_hashes: dict[str, str] | None = None) -> str:
    """The A1111 infotext for a rendered request. ``request.seed`` must be set. ``scheduler`` is
    the farm name of the scheduler the image was rendered with (default: ``request.scheduler``);
    a worker passes the model's own scheduler's name for ``default``.

    An img2img or inpainting image adds A1111's ``Denoising strength`` and the farm's ``Mode``,
    ``Init image`` and ``Mask image`` (object keys, which name the inputs' SHA-256); adapters add
    ``Lora weights`` (``name: weight``, the farm's) and, where the worker knows them, A1111's
    ``Lora hashes`` (``name: <first 12 hex digits of the file's SHA-256>``, A1111's AutoV3 short hash);
    control units add one ``ControlNet N`` field each, as sd-webui-controlnet writes them
    (:func:`control_unit_text`)."""
    lines = [request.prompt]
    if request.negative_prompt:
        lines.append(f"Negative prompt: {request.negative_prompt}")
    fields = {
        "Steps": str(request.num_inference_steps),
        "Sampler": samplers.label(scheduler or request.scheduler),
        "CFG scale": f"{request.guidance_scale:g}",
        "Seed": str(request.seed),
        "Size": f"{request.width}x{request.height}",
        "Model": model,
    }
    if request.upscale is not None:  # the names of AUTOMATIC1111's extras tab
        fields["Postprocess upscale by"] = str(request.upscale)
        fields["Postprocess upscaler"] = request.upscaler or ""
    if request.mode != "txt2img":
        if request.effective_strength is not None:  # None for image-to-video: the init image is the first frame
            fields["Denoising strength"] = f"{request.effective_strength:g}"
        fields["Mode"] = request.mode
        fields["Init image"] = request.init_image or ""
        if request.mask_image is not None:
            fields["Mask image"] = request.mask_image
    if request.loras:
        fields["Lora weights"] = ", ".join(f"{a.name}: {a.weight:g}" for a in request.loras)
        if lora_hashes:
            fields["Lora hashes"] = ", ".join(f"{a.name}: {lora_hashes[a.name]}" for a in request.loras
                                              if a.name in lora_hashes)
    for n, unit in enumerate(request.controls):
        fields[f"ControlNet {n}"] = control_unit_text(unit)
    if job_id:
        fields["Job id"] = job_id
    lines.append(", ".join(f"{k}: {_quote(v)}" for k, v in fields.items()))
    return "\n".join(lines)


#: The farm's control unit resize modes → sd-webui-controlnet's names.
RESIZE_LABELS = {"resize": "Just Resize", "crop": "Crop and Resize", "fill": "Resize and Fill"}


def control_unit_text(unit: ControlUnit) -> str:
    """A control unit as sd-webui-controlnet writes one in the infotext (the value of its
    ``ControlNet N`` field, quoted by the caller): ``Module: canny, Model: canny, Weight: 0.8,
    Resize Mode: Just Resize, Threshold A: 100, Threshold B: 200, Guidance Start: 0, Guidance End: 1,
    Pixel Perfect: True, Control Mode: Balanced`` (thresholds for canny only; the farm preprocesses
    at the render's size, which is sd-webui-controlnet's pixel-perfect mode)."""
    parts = [("Module", unit.preprocess), ("Model", unit.type), ("Weight", f"{unit.weight:g}"),
             ("Resize Mode", RESIZE_LABELS[unit.resize])]
    if unit.preprocess == "canny":
        low, high = unit.canny_thresholds
        parts += [("Threshold A", str(low)), ("Threshold B", str(high))]
    parts += [("Guidance Start", f"{unit.guidance_start:g}"), ("Guidance End", f"{unit.guidance_end:g}"),
              ("Pixel Perfect", "True"), ("Control Mode", "Balanced")]
    return ", ".join(f"{k}: {v}" for k, v in parts)


def parse_parameters(text: str) -> dict[str, str]:
    """Parse an A1111 infotext into ``{"prompt", "negative_prompt", "Steps", "Sampler", …}``."""
    *head, last = text.split("\n")
    fields = {m.group(1).strip(): _unquote(m.group(2)) for m in _PARAM_RE.finditer(last)}
    prompt_lines: list[str] = []
    negative_lines: list[str] = []
    in_negative = False
    for line in head:
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:"):].lstrip()
        (negative_lines if in_negative else prompt_lines).append(line)
    return {"prompt": "\n".join(prompt_lines), "negative_prompt": "\n".join(negative_lines), **fields}


def request_from_parameters(text: str) -> RenderRequest:
    """Rebuild the :class:`RenderRequest` that an infotext describes (model included). Its
    scheduler is the one the image names (for an image of a ``default`` request, the model's own
    scheduler by name, which renders the same)."""
    p = parse_parameters(text)
    width, height = (int(x) for x in p["Size"].split("x"))
    return RenderRequest(
        prompt=p["prompt"], negative_prompt=p["negative_prompt"], model=p.get("Model"), width=width,
        height=height, num_inference_steps=int(p["Steps"]), guidance_scale=float(p["CFG scale"]),
        seed=int(p["Seed"]), scheduler=samplers.from_label(p.get("Sampler", ""), p.get("Schedule type")),
        upscale=int(p["Postprocess upscale by"]) if "Postprocess upscale by" in p else None,
        upscaler=p.get("Postprocess upscaler"),
        init_image=p.get("Init image"), mask_image=p.get("Mask image"),
        strength=float(p["Denoising strength"]) if "Denoising strength" in p else None,
        loras=[{"name": n.strip(), "weight": float(w)} for n, _, w in
               (item.partition(":") for item in p["Lora weights"].split(","))] if "Lora weights" in p else [],
    )


#: zlib level of Pillow's PNG encoder, used where fpng is not installed or the image is neither
#: RGB nor RGBA. Pillow 13 (zlib 1.2.13), 512² render-like image, this 2-core AMD EPYC (AVX-512),
#: ``renderfarm bench encode``, median CPU ms: level 0 13.7 ms and 769 KiB, 1: 25.0 ms and
#: 500 KiB, 3: 29.1 ms and 499 KiB, 4–9: ~46 ms and 441 KiB.
PNG_COMPRESS_LEVEL = 1


def png_text_chunk(keyword: str, text: str) -> bytes:
    """One PNG ``iTXt`` chunk (uncompressed, UTF-8, no language tag) holding ``text`` under
    ``keyword``, length and CRC-32 included (PNG specification, section 11.3.4.5)."""
    data = keyword.encode("latin-1") + b"\0\0\0\0\0" + text.encode("utf-8")
    tag = b"iTXt"
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _fpng_encoder() -> Callable[[Image.Image], bytes] | None:
    try:
        import fpng
    except ImportError:
        return None
    return fpng.from_pil


#: fpng (Rich Geldreich's fast PNG writer, the ``fpng`` wheel): the default PNG encoder where it
#: is installed (the worker extra). Same host and image as above, two runs: 0.9–1.5 ms and
#: 500 KiB at 512², 3.8–5.5 ms and 1,992 KiB at 1024², against Pillow level 1's 25.0–25.3 ms and
#: 99.3–129.5 ms for the same bytes within 0.1 %; lossless, and the ``parameters`` chunk is
#: spliced in after ``IHDR`` (fpng writes none).
_FPNG = _fpng_encoder()


def encode_png(image: Image.Image, parameters: str) -> bytes:
    """``image`` as PNG bytes with ``parameters`` in an ``iTXt`` chunk: fpng for RGB and RGBA
    images where it is installed, else Pillow at :data:`PNG_COMPRESS_LEVEL`. Lossless either way."""
    if _FPNG is not None and image.mode in ("RGB", "RGBA"):
        png = _FPNG(image)
        return png[:33] + png_text_chunk("parameters", parameters) + png[33:]  # signature 8 + IHDR 25 bytes
    buf = io.BytesIO()
    info = PngImagePlugin.PngInfo()
    info.add_itxt("parameters", parameters)
    image.save(buf, format="PNG", pnginfo=info, compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def encode_image(image: Image.Image, fmt: str, parameters: str) -> tuple[bytes, str]:
    """Encode ``image`` as ``fmt`` (png, webp or jpeg) with ``parameters`` embedded.

    Returns:
        (bytes, content type). PNG is lossless (:func:`encode_png`); WebP and JPEG use quality 95.
    Raises:
        ValueError: for an unknown format.
    """
    if fmt not in CONTENT_TYPES:
        raise ValueError(f"output_format must be one of {sorted(CONTENT_TYPES)}, got {fmt!r}")
    if fmt == "png":
        return encode_png(image, parameters), CONTENT_TYPES[fmt]
    buf = io.BytesIO()
    exif = Image.Exif()
    exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = b"UNICODE\0" + parameters.encode("utf-16-be")
    image.convert("RGB").save(buf, format=fmt.upper(), quality=95, exif=exif.tobytes())
    return buf.getvalue(), CONTENT_TYPES[fmt]


def read_parameters(data: bytes) -> str | None:
    """The ``parameters`` text embedded in encoded image bytes, or None when absent."""
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "PNG":
            return img.info.get("parameters")
        raw = img.getexif().get_ifd(_EXIF_IFD).get(_USER_COMMENT)
    if not raw:
        return None
    if isinstance(raw, str):
        return raw
    if raw.startswith(b"UNICODE\0"):
        return raw[8:].decode("utf-16-be")
    return raw.split(b"\0", 1)[-1].decode("utf-8", "replace")
