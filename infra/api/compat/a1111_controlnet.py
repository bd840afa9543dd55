"""sd-webui-controlnet's API on the A1111 front door: ``alwayson_scripts.controlnet.args`` mapped
onto the farm's control units, and the listing routes its clients call first.

Place in the data flow: an A1111 client (``webuiapi``'s ``ControlNetUnit``, the tools built on the
sd-webui-controlnet API) → ``POST /sdapi/v1/txt2img`` or ``/img2img`` (:mod:`infra.api.compat.a1111`)
→ **here**: each enabled unit's base64 image is checked and stored like an upload
(:mod:`infra.storage.input_images`), its fields mapped onto a :class:`~infra.controls.ControlUnit`
→ the render requests' ``controls`` → the farm's submission path (a ``model`` no pool declares is
refused there, naming it).

The script's key is accepted as ``controlnet``, ``ControlNet`` or ``controlNet`` (clients differ;
``webuiapi`` sends ``ControlNet``). Each unit's fields:

- ``enabled`` false: the unit is skipped, as the extension skips it; ``args: []`` asks for nothing.
- ``image`` (or the older ``input_image``; also ``{"image": …, "mask": null}``): base64. Empty in
  img2img: the init image, as the extension uses it.
- ``module``: ``none`` or ``canny`` (the farm's preprocessors); ``threshold_a`` / ``threshold_b``
  are canny's low / high thresholds (the extension ignores them for ``none``, and so does the farm).
  An IP-Adapter unit names one of the extension's CLIP-encoder modules (``ip-adapter_clip_sd15``,
  ``ip-adapter_clip_sdxl``, ``ip-adapter_clip_sdxl_plus_vith``, ``ip-adapter-auto``): the farm's
  unit then takes the image as it is (``preprocess`` none) and its worker encodes it with the
  adapter's own image encoder.
- ``model``: a ControlNet or IP-Adapter the pool declares, with or without the extension's
  `` [hash]`` suffix (``GET /controlnet/model_list``).
- ``weight``, ``guidance_start``, ``guidance_end``: the unit's.
- ``resize_mode``: ``Just Resize`` (0), ``Crop and Resize`` (1) or ``Resize and Fill`` (2).
- ``processor_res``: the farm runs the preprocessor at the render's size (the extension's pixel
  perfect mode), so it is honoured as -1, as the render's shorter side, with ``pixel_perfect``
  true, or with module ``none`` (nothing to run); another value is a 422.
- ``control_mode``: ``Balanced`` (0) only; ``mask``: none only; ``low_vram``, ``hr_option``,
  ``save_detected_map``, ``is_ui``: accepted (they do not change the image).

Any other field with a value (not null, false, empty or 0) is a 422 naming it: a unit the farm
cannot honour is refused, never silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from infra.api.deps import FarmDep, Tenant
from infra.controls import PREPROCESSORS, ControlUnit
from infra.storage.input_images import InputRefused

#: The keys clients put sd-webui-controlnet's arguments under in ``alwayson_scripts``.
SCRIPT_KEYS = ("controlnet", "ControlNet", "controlNet")
RESIZE_MODES = {0: "resize", 1: "crop", 2: "fill", "just resize": "resize", "crop and resize": "crop",
                "resize and fill": "fill"}
#: sd-webui-controlnet's IP-Adapter modules (its CLIP image encoders), as a unit's ``module``.
IP_ADAPTER_MODULES = ("ip-adapter_clip_sd15", "ip-adapter_clip_sdxl", "ip-adapter_clip_sdxl_plus_vith",
                      "ip-adapter-auto")
#: Fields whose value does not change the image (memory use, UI state, hires fix, which the farm refuses).
NEUTRAL_FIELDS = frozenset({"low_vram", "lowvram", "hr_option", "save_detected_map", "is_ui"})
#: ControlNet unit field → the A1111 field that fills it (for error locations).
A1111_UNIT_FIELD = {"type": "model", "preprocess": "module", "low_threshold": "threshold_a",
                    "high_threshold": "threshold_b", "resize": "resize_mode"}
_HASH_SUFFIX = re.compile(r"\s*\[[0-9a-fA-F]{6,64}\]$")

router = APIRouter(prefix="/controlnet", tags=["a1111"])


class UnitArgs(BaseModel):
    """One sd-webui-controlnet unit as clients send it (extra fields kept, to be checked)."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = True
    image: str | dict | None = None
    input_image: str | None = None
    mask: str | None = None
    module: str = "none"
    model: str = "None"
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    threshold_a: float = -1
    threshold_b: float = -1
    processor_res: int = -1
    resize_mode: int | str = 1
    control_mode: int | str = 0
    pixel_perfect: bool = False


def script_args(alwayson: Mapping[str, Any]) -> tuple[str | None, list[Any]]:
    """The script key a body uses and its ``args`` (a list; empty without the script).

    Raises:
        RequestValidationError: two spellings of the key, or ``args`` that is not a list.
    """
    present = [key for key in SCRIPT_KEYS if key in alwayson]
    if not present:
        return None, []
    if len(present) > 1:
        raise _invalid(("alwayson_scripts",), f"send ControlNet units under one key, got {present}")
    value = alwayson[present[0]]
    args = value.get("args", []) if isinstance(value, dict) else value
    if not isinstance(args, list):
        raise _invalid(("alwayson_scripts", present[0], "args"), "args must be a list of ControlNet units")
    return present[0], args


def _invalid(loc: tuple, message: str, value: object = None) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": message, "input": value}])


def _unit_image(unit: UnitArgs) -> tuple[str | None, str | None]:
    """``(image, mask)`` base64 strings of a unit, whichever shape it came in."""
    image = unit.image if unit.image not in (None, "") else unit.input_image
    if isinstance(image, dict):
        return image.get("image") or None, image.get("mask") or None
    return image or None, unit.mask or None


def _module(unit: UnitArgs) -> str:
    """The farm's preprocessor for a unit's ``module``: an IP-Adapter encoder module is ``none``."""
    module = unit.module.strip().lower()
    return "none" if module in IP_ADAPTER_MODULES else module


def _problems(unit: UnitArgs, width: int, height: int) -> list[tuple[str, str]]:
    """``(field, reason)`` for each value of ``unit`` the farm cannot honour."""
    out = []
    module = _module(unit)
    if module not in PREPROCESSORS:
        out.append(("module", f"preprocessor {unit.module!r} is not available; this farm has "
                              f"{[*PREPROCESSORS, *IP_ADAPTER_MODULES]}"))
    if unit.model.strip() in ("", "None"):
        out.append(("model", "name a ControlNet this farm serves (GET /controlnet/model_list)"))
    resize = unit.resize_mode.strip().lower() if isinstance(unit.resize_mode, str) else unit.resize_mode
    if resize not in RESIZE_MODES:
        out.append(("resize_mode", "Just Resize, Crop and Resize or Resize and Fill (0, 1 or 2)"))
    if unit.control_mode not in (0, "Balanced"):
        out.append(("control_mode", "only Balanced (0) is available"))
    if _unit_image(unit)[1] is not None:
        out.append(("mask", "ControlNet unit masks are not available"))
    short = min(width, height)
    if module != "none" and not unit.pixel_perfect and unit.processor_res not in (-1, short):
        out.append(("processor_res", f"the farm preprocesses at the render's size: send {short}, -1 or "
                                     f"pixel_perfect true"))
    for field, value in (unit.model_extra or {}).items():
        if field not in NEUTRAL_FIELDS and value not in (None, False, "", 0, [], {}):
            out.append((field, f"{field} is not available on this farm"))
    return out


def unit_fields(unit: UnitArgs, image_key: str) -> dict[str, Any]:
    """The :class:`~infra.controls.ControlUnit` fields of a checked unit whose image is stored at ``image_key``."""
    module = _module(unit)
    resize = unit.resize_mode.strip().lower() if isinstance(unit.resize_mode, str) else unit.resize_mode
    fields: dict[str, Any] = {"type": _HASH_SUFFIX.sub("", unit.model.strip()), "image": image_key,
                              "weight": unit.weight, "guidance_start": unit.guidance_start,
                              "guidance_end": unit.guidance_end, "preprocess": module,
                              "resize": RESIZE_MODES[resize]}
    if module == "canny":
        for field, value in (("low_threshold", unit.threshold_a), ("high_threshold", unit.threshold_b)):
            if value >= 0:
                fields[field] = round(value)
    return fields


async def control_units(alwayson: Mapping[str, Any], *, width: int, height: int, init_key: str | None,
                        store: Callable[[bytes], Awaitable[str]],
                        decode: Callable[[str], bytes]) -> list[dict[str, Any]]:
    """The control units (dicts of :class:`~infra.controls.ControlUnit` fields) of a body's
    ``alwayson_scripts``, in order, the disabled ones left out; each image stored by ``store``
    (base64 decoded by ``decode``; bytes → object key, raising what the input checks raise).

    Raises:
        RequestValidationError: a unit the farm cannot honour, a bad value or a missing image,
            ``loc`` naming ``alwayson_scripts.<key>.args.<n>.<field>``.
        InputRefused: an image over the byte limit (413) or of a format the farm does not take (415).
    """
    key, args = script_args(alwayson)
    units = []
    for n, raw in enumerate(args):
        loc = ("alwayson_scripts", key, "args", n)
        try:
            unit = UnitArgs.model_validate(raw)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *loc, *e["loc"])} for e in exc.errors()]) from None
        if not unit.enabled:
            continue
        problems = _problems(unit, width, height)
        if problems:
            raise RequestValidationError([{"type": "value_error", "loc": ("body", *loc, field), "msg": msg,
                                           "input": None} for field, msg in problems])
        image, _ = _unit_image(unit)
        if image is None and init_key is None:
            raise _invalid((*loc, "image"), "a ControlNet unit needs an image (base64)")
        try:
            image_key = await store(decode(image)) if image is not None else init_key
        except InputRefused as exc:
            if exc.status != 422:
                raise  # 413, 415: the route answers with that status
            raise _invalid((*loc, "image"), exc.reason) from None
        except ValueError as exc:  # not base64
            raise _invalid((*loc, "image"), str(exc)) from None
        fields = unit_fields(unit, str(image_key))
        try:
            ControlUnit.model_validate(fields)
        except ValidationError as exc:
            raise RequestValidationError([{"type": e["type"], "msg": e["msg"], "input": e.get("input"),
                                           "loc": ("body", *loc, *(A1111_UNIT_FIELD.get(str(x), x) for x in e["loc"]))}
                                          for e in exc.errors()]) from None
        units.append(fields)
    return units


@router.get("/model_list")
def model_list(farm: FarmDep, tenant: Tenant) -> dict[str, list[str]]:
    """The ControlNets a unit's ``model`` may name: ``RENDERFARM_CONTROLS`` and every declared
    pool's, once per name (sd-webui-controlnet's ``{"model_list": [...]}``)."""
    names = [spec.name for spec in (*farm.settings.controls, *(c for pool in farm.settings.pools
                                                                for c in pool.controls))]
    return {"model_list": list(dict.fromkeys(names))}


@router.get("/module_list")
def module_list(tenant: Tenant) -> dict[str, Any]:
    """The preprocessors a unit's ``module`` may name (sd-webui-controlnet's ``module_list``), with
    canny's thresholds in its ``module_detail`` shape."""
    canny_sliders = [{"name": "Low Threshold", "value": 100, "min": 0, "max": 255},
                     {"name": "High Threshold", "value": 200, "min": 0, "max": 255}]
    return {"module_list": [*PREPROCESSORS, *IP_ADAPTER_MODULES],
            "module_detail": {"none": {"model_free": False, "sliders": []},
                              "canny": {"model_free": False, "sliders": canny_sliders},
                              **{m: {"model_free": False, "sliders": []} for m in IP_ADAPTER_MODULES}}}


@router.get("/version")
def version(tenant: Tenant) -> dict[str, int]:
    """The sd-webui-controlnet API version whose unit format this farm reads."""
    return {"version": 2}
