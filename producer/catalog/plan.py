"""Planning a catalog: each item's request, seed and content key, or why it has none.

Place in the data flow: items + template → **plan** → the run, which looks the content keys up
in the farm's catalog index and submits only what has no image.

Content-addressed keys: an item's key is the SHA-256 of its model, prompt, negative prompt,
parameters (size, steps, guidance, scheduler, format), seed and, for an item with an ``image``
(and ``mask``) column, the input images' content keys (``inputs/<sha256>.<ext>``, hashed here from
the local files; an https URL's image is downloaded first and counts by its bytes, then uploaded
like a local file) and ``strength``, and for an item with a ``control_image`` column (and
``control_type``, optional ``control_weight`` and ``control_preprocess``: one ControlNet unit) the
unit with its image's content key: a re-run after a photo or control image changed renders that
item again, and only that one. A video item (a ``video`` column saying yes: ``1``/``true``/``yes``/
``video``; or ``kind`` ``video``; or a ``frames``/``fps`` column; or ``--video`` with ``--frames``/``--fps``
on the command line) adds ``kind``, ``num_frames`` and ``fps`` to its key (absent ones as null:
the family's defaults), so another frame count or rate renders again; ``video`` saying no (``0``/
``false``/``no``/``image``) keeps an item an image under ``--video``. Local paths are relative to
the catalog's folder; the run uploads them (:mod:`producer.local_inputs`) before submitting. Its
seed is the item's ``seed`` field, or else derived from that same content, so a re-run computes
the same keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from infra.schemas import CATALOG_KEY_FIELD, RenderRequest
from producer.catalog.items import CatalogError, Item, read_catalog
from producer.catalog.templates import Template, TemplateFieldError
from producer.local_inputs import fetch_url_input, local_input_key

#: Item fields that set request parameters (field name → RenderRequest field).
PARAM_FIELDS = {"seed": "seed", "width": "width", "height": "height", "steps": "num_inference_steps",
                "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale",
                "negative_prompt": "negative_prompt", "scheduler": "scheduler", "output_format": "output_format",
                "model": "model", "upscale": "upscale", "upscaler": "upscaler", "strength": "strength",
                "kind": "kind", "frames": "num_frames", "num_frames": "num_frames", "fps": "fps"}
#: Values of a ``video`` column that make an item a video (case-insensitive; JSON ``true`` too),
#: and those that leave it an image; anything else fails the item.
VIDEO_YES, VIDEO_NO = ("1", "true", "yes", "y", "video"), ("0", "false", "no", "n", "image")
#: Item columns that name input images (local paths relative to the catalog, or https URLs).
IMAGE_COLUMNS = {"image": "init_image", "mask": "mask_image", "control_image": "control_image"}
#: Item columns of a ControlNet unit (``control_image`` is its image; ``control_type`` is required with it).
CONTROL_COLUMNS = {"control_type": "type", "control_weight": "weight", "control_preprocess": "preprocess"}
#: The request fields a content key covers (with ``seed``, and ``upscale``/``upscaler`` when set);
#: metadata is not part of it.
KEY_FIELDS = ("model", "prompt", "negative_prompt", "width", "height", "num_inference_steps", "guidance_scale",
              "scheduler", "output_format")


def _canonical(request: RenderRequest, with_seed: bool) -> bytes:
    data = {k: getattr(request, k) for k in KEY_FIELDS}
    if request.upscale is not None:  # only then, so that the keys of catalogs without upscaling stay as they were
        data["upscale"], data["upscaler"] = request.upscale, request.upscaler
    if request.mode != "txt2img":  # only then, so that the keys of text-only catalogs stay as they were
        data["init_image"], data["mask_image"] = request.init_image, request.mask_image
        data["strength"] = request.effective_strength
    if request.controls:  # only then: the unit set, each unit's image key (naming its SHA-256) and settings
        data["controls"] = [unit.model_dump(mode="json") for unit in request.controls]
    if request.is_video:  # only then: a video's frames and rate (None: the family's defaults) make another key
        data["kind"], data["num_frames"], data["fps"] = "video", request.num_frames, request.fps
    if with_seed:
        data["seed"] = request.seed
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def derive_seed(request: RenderRequest) -> int:
    """A seed in 0…2³²−1 derived from the request's content (``KEY_FIELDS``, not its seed)."""
    return int.from_bytes(hashlib.sha256(b"renderfarm-catalog-seed\0" + _canonical(request, False)).digest()[:4],
                          "big")


def content_key(request: RenderRequest) -> str:
    """The catalog key of a request: hex SHA-256 of its ``KEY_FIELDS`` and seed (which must be set)."""
    if request.seed is None:
        raise ValueError("a content key needs a seed")
    return hashlib.sha256(_canonical(request, True)).hexdigest()


@dataclass
class Plan:
    """An item, and either its request and key or why it cannot be rendered (``error``:
    ``{"type", "message"}``)."""

    item: Item
    request: RenderRequest | None = None
    key: str | None = None
    error: dict[str, str] | None = None
    inputs: dict[str, Path] = field(default_factory=dict)  # input key → local file to upload


def _value(v: Any) -> Any:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False) if isinstance(v, (dict, list)) else v


def _video_kind(values: Mapping[str, Any]) -> dict[str, Any]:
    """``{"kind": "video"}`` when the item's ``video`` column says yes (or it sets ``frames``/``fps``
    without a ``kind``), ``{"kind": "image"}`` when it says no, ``{}`` otherwise. Raises ValueError
    for a ``video`` value that is neither."""
    video = values.get("video")
    if video is not None:
        text = str(video).strip().lower()
        if text not in VIDEO_YES + VIDEO_NO:
            raise ValueError(f"column 'video': {video!r} is not one of {', '.join(VIDEO_YES + VIDEO_NO)}")
        return {"kind": "video" if text in VIDEO_YES else "image"}
    framed = any(values.get(c) is not None for c in ("frames", "num_frames", "fps"))
    return {"kind": "video"} if framed and values.get("kind") is None else {}


def _inputs(values: Mapping[str, Any], base_dir: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """The item's image columns as request fields (keys) and the local files behind the keys (an
    https URL's image downloaded by :func:`producer.local_inputs.fetch_url_input`).
    Raises ValueError naming the column: a missing file, a URL that cannot be fetched, or not a PNG, JPEG or WebP."""
    fields, files = {}, {}
    for column, target in IMAGE_COLUMNS.items():
        ref = values.get(column)
        if ref is None:
            continue
        ref = str(ref)
        try:
            path = fetch_url_input(ref) if ref.startswith("https://") else (base_dir / ref).resolve()
        except ValueError as exc:
            raise ValueError(f"column {column!r}: {exc}") from None
        if not path.is_file():
            raise ValueError(f"column {column!r}: no file {str(path)!r}")
        try:
            key = local_input_key(path)
        except ValueError as exc:
            raise ValueError(f"column {column!r}: {exc}") from None
        fields[target], files[key] = key, path
    return fields, files


def _control_unit(inputs: dict[str, str], values: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` (request fields from :func:`_inputs`) with a ``control_image`` key turned into a
    ``controls`` list of one unit: its type from ``control_type``, and ``control_weight`` /
    ``control_preprocess`` when the item sets them.

    Raises:
        ValueError: a control column without ``control_image``, or ``control_image`` without ``control_type``.
    """
    fields = {k: v for k, v in inputs.items() if k != "control_image"}
    unit = {target: values[column] for column, target in CONTROL_COLUMNS.items() if values.get(column) is not None}
    if "control_image" not in inputs:
        if unit:
            raise ValueError(f"columns {', '.join(sorted(c for c in CONTROL_COLUMNS if values.get(c) is not None))} "
                             "need a control_image")
        return fields
    if "type" not in unit:
        raise ValueError("column 'control_image' needs a control_type (a ControlNet the pool declares)")
    return {**fields, "controls": [{**unit, "image": inputs["control_image"]}]}


def plan_item(item: Item, template: Template, defaults: Mapping[str, Any],
              negative: Template | None = None, base_dir: Path = Path(".")) -> Plan:
    """The request and content key of one item, or the reason it has none.

    ``defaults`` are RenderRequest fields from the command line (``model`` is required, so that
    the key never depends on the farm's default model); the item's parameter fields override them.
    """
    if item.problem:
        return Plan(item, error={"type": "InvalidItem", "message": item.problem})
    values = {k: _value(v) for k, v in item.fields.items()}
    try:
        params: dict[str, Any] = {"prompt": template.render(values), **defaults}
        if negative is not None and "negative_prompt" not in values:
            params["negative_prompt"] = negative.render(values)
    except TemplateFieldError as exc:
        have = ", ".join(sorted(values)) or "none"
        return Plan(item, error={"type": "TemplateError", "message": f"item {item.id!r} (line {item.line}) has no "
                                 f"field {exc.args[0]!r} for the template; its fields: {have}"})
    except (ValueError, TypeError) as exc:
        return Plan(item, error={"type": "TemplateError", "message": f"item {item.id!r} (line {item.line}): {exc}"})
    for name, target in PARAM_FIELDS.items():
        if name in values:
            params[target] = values[name]
    try:
        params.update(_video_kind(values))
    except ValueError as exc:
        return Plan(item, error={"type": "ValidationError", "message": f"item {item.id!r} (line {item.line}): {exc}"})
    if params.get("kind") == "image":  # an image item in a --video catalog: the command line's frames are not its
        params = {k: v for k, v in params.items() if k not in ("num_frames", "fps") or k in values}
    try:
        inputs, files = _inputs(values, base_dir)
    except (ValueError, OSError) as exc:
        return Plan(item, error={"type": "InputError", "message": f"item {item.id!r} (line {item.line}): {exc}"})
    try:
        params.update(_control_unit(inputs, values))
    except ValueError as exc:
        return Plan(item, error={"type": "InputError", "message": f"item {item.id!r} (line {item.line}): {exc}"})
    try:
        request = RenderRequest.model_validate({**params, "seed": None})
        seed = params.get("seed")
        seed = derive_seed(request) if seed is None else seed
        request = RenderRequest.model_validate({**params, "seed": seed})
    except ValidationError as exc:
        message = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
        return Plan(item, error={"type": "ValidationError", "message": message})
    key = content_key(request)
    metadata = {CATALOG_KEY_FIELD: key, "catalog_item": item.id[:1024]}
    return Plan(item, request.model_copy(update={"metadata": metadata}), key, inputs=files)


def plan_items(items: Sequence[Item], template: Template, defaults: Mapping[str, Any],
               negative: Template | None = None, base_dir: Path = Path(".")) -> list[Plan]:
    """:func:`plan_item` for every item.

    Raises:
        CatalogError: a template field that no item has (a typo, or the wrong catalog).
    """
    for tmpl in (t for t in (template, negative) if t):
        for name in (tmpl.fields if tmpl else ()):
            if not any(name in it.fields for it in items if not it.problem):
                raise CatalogError(f"{tmpl.option} {tmpl.text!r}: no item has a field {name!r}")
    return [plan_item(item, template, defaults, negative, base_dir) for item in items]


def prepare_catalog(path: str | Path, template: str, *, model: str, params: Mapping[str, Any] | None = None,
                    negative_template: str | None = None, input_format: str = "auto") -> tuple[list[Plan], dict]:
    """Read and plan a catalog; returns the plans and the report's context (file, format,
    template, model). ``params`` are RenderRequest defaults (``width``, ``num_inference_steps``, …).

    Raises:
        CatalogError: the file or a template is unusable (nothing has been sent).
    """
    tmpl = Template(template)
    negative = Template(negative_template, "--negative-template") if negative_template is not None else None
    fmt, items = read_catalog(path, input_format)
    plans = plan_items(items, tmpl, {"model": model, **(params or {})}, negative, Path(path).parent)
    return plans, {"catalog": str(path), "format": fmt, "template": template, "model": model}
