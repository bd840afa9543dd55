"""Control units per request (ControlNet, and IP-Adapter image prompts): what a request asks
(:class:`ControlUnit`), what a pool declares (:class:`ControlSpec`), and the submission checks
between the two (:func:`control_errors`).

Place in the data flow: producer → ``RenderRequest.controls`` (validated here, pydantic) → routing
(:mod:`infra.routing`: each unit's ``type`` must be a ControlNet the pool declares, at most its
``max_controls`` units; the model family must have a diffusers ControlNet pipeline for the mode,
:func:`infra.pools.capability_errors`) → the compat key (:mod:`pipeline.compat`: the unit set,
``(type, preprocess)`` per unit, so only jobs with the same units share a pipeline call) → the
worker (:mod:`pipeline.controlnet`) loads the ControlNets, preprocesses each unit's image and
renders with diffusers' ControlNet pipelines.

A unit follows diffusers' terms (``StableDiffusionControlNetPipeline``): ``weight`` is the unit's
``controlnet_conditioning_scale`` (0 leaves the render as without the unit; 1 as trained; up to 2),
``guidance_start`` / ``guidance_end`` are its ``control_guidance_start`` / ``control_guidance_end``
(the fraction of the denoising steps during which it conditions, 0…1). ``image`` is an image
reference exactly as ``init_image`` (:mod:`infra.image_refs`). ``preprocess`` says what turns the
image into the control map: ``none`` (it already is one) or ``canny`` (OpenCV's Canny edge
detector with hysteresis thresholds ``low_threshold`` / ``high_threshold``, 0…255; J. Canny, "A
Computational Approach to Edge Detection", IEEE PAMI 1986; defaults 100 / 200, those of
sd-webui-controlnet's canny preprocessor). ``resize`` fits the image to the render's size:
``resize`` (stretch), ``crop`` (scale to cover, centre crop) or ``fill`` (scale to fit, black
borders: "no control" for an edge map), sd-webui-controlnet's "Just Resize", "Crop and Resize" and
"Resize and Fill".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.image_refs import check_image_ref

#: A ControlNet name as pools declare it (and as requests name it in ``controls[].type``).
CONTROL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: The preprocessors a worker runs (``none``: the image is the control map).
Preprocess = Literal["none", "canny"]
PREPROCESSORS: tuple[str, ...] = ("none", "canny")
#: How a control image is fitted to width × height (sd-webui-controlnet's resize modes).
ControlResize = Literal["resize", "crop", "fill"]
#: Canny's default hysteresis thresholds (sd-webui-controlnet's canny preprocessor), 0…255.
CANNY_LOW, CANNY_HIGH = 100, 200
#: Most units any request may carry (the schema's bound); a pool allows ``max_controls`` of them.
MAX_CONTROLS = 8
#: Units per request a pool allows when it declares no ``max_controls`` (and with no pool declared).
DEFAULT_MAX_CONTROLS = 3
#: Keys of a rendered PIL image's ``info`` through which the worker's renderer hands storage the
#: image's control maps (a list of RGB images, one per unit) and the seconds they took to make.
CONTROL_MAPS_INFO = "renderfarm.control_maps"
PREPROCESS_S_INFO = "renderfarm.preprocess_s"


class ControlUnit(BaseModel):
    """One ControlNet unit of a request (see the module docstring for each field's meaning).

    Raises:
        pydantic.ValidationError: naming the field, e.g. ``controls.0.guidance_end: Value error,
            guidance_start (0.8) must be at most guidance_end (0.5)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(min_length=1, max_length=100, description="A ControlNet its pool declares (e.g. canny).")
    image: str = Field(min_length=1, max_length=2048, description="The control image: an object key in the "
                       "farm's bucket (POST /v1/uploads) or an https URL the API fetches once, as init_image.")
    weight: float = Field(1.0, ge=0.0, le=2.0, description="controlnet_conditioning_scale, 0…2 (0: no effect).")
    guidance_start: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of the steps at which it starts, 0…1.")
    guidance_end: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of the steps at which it stops, 0…1.")
    preprocess: Preprocess = Field("none", description="none (the image is a control map) or canny (edges).")
    low_threshold: int | None = Field(None, ge=0, le=255, description=f"canny: lower hysteresis threshold, 0…255 "
                                      f"(default {CANNY_LOW}).")
    high_threshold: int | None = Field(None, ge=0, le=255, description=f"canny: upper hysteresis threshold, 0…255 "
                                       f"(default {CANNY_HIGH}).")
    resize: ControlResize = Field("resize", description="Fit to the render's size: resize (stretch), crop "
                                  "(cover, centre crop) or fill (fit, black borders).")

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if not CONTROL_NAME_RE.fullmatch(v):
            raise ValueError(f"type must be 1–100 of A-Z a-z 0-9 . _ - starting alphanumeric, got {v[:100]!r}")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check_image_ref(v, "image")

    @model_validator(mode="after")
    def _ranges(self) -> "ControlUnit":
        if self.guidance_start > self.guidance_end:
            raise ValueError(f"guidance_start ({self.guidance_start:g}) must be at most guidance_end "
                             f"({self.guidance_end:g})")
        thresholds = [name for name in ("low_threshold", "high_threshold") if getattr(self, name) is not None]
        if thresholds and self.preprocess != "canny":
            raise ValueError(f"{' and '.join(thresholds)} apply to preprocess 'canny' only, "
                             f"this unit's preprocess is {self.preprocess!r}")
        if self.preprocess == "canny" and self.canny_thresholds[0] > self.canny_thresholds[1]:
            low, high = self.canny_thresholds
            raise ValueError(f"low_threshold ({low}) must be at most high_threshold ({high})")
        return self

    @property
    def canny_thresholds(self) -> tuple[int, int]:
        """``(low, high)``, the defaults filled in."""
        return (CANNY_LOW if self.low_threshold is None else self.low_threshold,
                CANNY_HIGH if self.high_threshold is None else self.high_threshold)

    @property
    def kind(self) -> tuple[str, str]:
        """``(type, preprocess)``: what a pipeline call's units must share (:mod:`pipeline.compat`)."""
        return self.type, self.preprocess


class ControlSpec(BaseModel):
    """One control a pool allows: the ``name`` requests use as a unit's ``type``, its ``kind`` and
    its ``source``.

    ``kind="controlnet"`` (the default): a hub id or local directory (diffusers'
    ``ControlNetModel.from_pretrained``), a single checkpoint file (``from_single_file``),
    ``s3://<key>`` of such a file in the farm's bucket, or an offline build name
    (``tiny-controlnet…``: made from the pinned model's denoiser config, random weights). The
    ControlNet must be of the model family's class: ``ControlNetModel`` (SD 1/2, SDXL),
    ``SD3ControlNetModel`` (SD3) or ``FluxControlNetModel`` (FLUX.1).

    ``kind="ip-adapter"``: an IP-Adapter (Ye et al. 2023; diffusers' ``load_ip_adapter``): a local
    directory or hub id holding ``weight_name`` in ``subfolder`` and the CLIP image encoder in
    ``image_encoder_folder`` (``h94/IP-Adapter``: ``subfolder="models"``,
    ``weight_name="ip-adapter_sd15.safetensors"``, ``image_encoder_folder="models/image_encoder"``),
    or an offline build name (``tiny-ip-adapter…``). A unit of this type is an image prompt: its
    ``weight`` is the adapter's scale, its image is not preprocessed, and it conditions every step.

    Raises:
        pydantic.ValidationError: IP-Adapter fields on a ControlNet, or an ``s3://`` IP-Adapter.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
                      description="The name requests use (controls[].type).")
    source: str = Field(min_length=1, max_length=1000, description="Hub id, local path, s3://<key> or offline name.")
    kind: Literal["controlnet", "ip-adapter"] = Field("controlnet", description="controlnet or ip-adapter.")
    subfolder: str = Field("", max_length=200, description="ip-adapter: the weights file's folder in source.")
    weight_name: str | None = Field(None, max_length=200, description="ip-adapter: the weights file "
                                    "(default ip-adapter.safetensors).")
    image_encoder_folder: str = Field("image_encoder", max_length=200, description="ip-adapter: the CLIP image "
                                      "encoder's folder in source.")

    @model_validator(mode="after")
    def _kind_fields(self) -> "ControlSpec":
        if self.kind == "controlnet":
            given = [f for f in ("subfolder", "weight_name", "image_encoder_folder")
                     if getattr(self, f) != type(self).model_fields[f].default]
            if given:
                raise ValueError(f"{', '.join(given)} apply to kind 'ip-adapter' only; {self.name!r} is a controlnet")
        elif self.source.startswith("s3://"):
            raise ValueError(f"IP-Adapter {self.name!r}: a local directory, hub id or offline name, not an s3:// key")
        return self


def control_errors(request: Any, allowed: Sequence[ControlSpec], where: str,
                   max_controls: int = DEFAULT_MAX_CONTROLS, ip_adapters: bool = True) -> list[dict[str, Any]]:
    """Error dicts (``type``, ``field``, ``msg``, ``input``) for the units of ``request`` (a
    ``RenderRequest``) that ``allowed`` cannot serve: more than ``max_controls`` units
    (``too_many_controls``), a ``type`` not declared (``unknown_control``, naming it and the declared
    ones), an IP-Adapter unit where the model's family takes none (``ip_adapters`` false:
    ``unsupported_ip_adapter``). ``where`` names the declaration (a pool, or RENDERFARM_CONTROLS).
    Empty without units."""
    units = getattr(request, "controls", ())
    if not units:
        return []
    errors = []
    if len(units) > max_controls:
        errors.append({"type": "too_many_controls", "field": "controls", "input": len(units),
                       "msg": f"{where} allows at most {max_controls} control unit(s) per request, got {len(units)}"})
    kinds = {spec.name: spec.kind for spec in allowed}
    errors += [{"type": "unknown_control", "field": "controls", "input": unit.type,
                "msg": f"{where} has no ControlNet or IP-Adapter {unit.type!r} (it has: "
                       f"{', '.join(map(repr, sorted(kinds))) or 'none'})"}
               for unit in units if unit.type not in kinds]
    adapters = [u for u in units if kinds.get(u.type) == "ip-adapter"]
    if adapters and not ip_adapters:
        errors.append({"type": "unsupported_ip_adapter", "field": "controls", "input": adapters[0].type,
                       "msg": f"model {request.model!r} takes no IP-Adapter units ({adapters[0].type!r} is one): "
                              f"IP-Adapters are served for the UNet families (SD 1/2, SDXL)"})
    return errors + _ip_adapter_errors(adapters)


def _ip_adapter_errors(units: Sequence[ControlUnit]) -> list[dict[str, Any]]:
    """What an IP-Adapter unit cannot do: more than one per request (one adapter is loaded around
    a call), a preprocessor (its image is a reference, not a map), a guidance range other than
    0…1 (diffusers applies the adapter at every step)."""
    errors: list[dict[str, Any]] = []
    if len(units) > 1:
        errors.append({"type": "too_many_ip_adapters", "field": "controls", "input": [u.type for u in units],
                       "msg": f"at most one IP-Adapter unit per request, got {len(units)}"})
    for unit in units:
        if unit.preprocess != "none":
            errors.append({"type": "ip_adapter_preprocess", "field": "controls", "input": unit.preprocess,
                           "msg": f"IP-Adapter unit {unit.type!r} takes its reference image as it is: "
                                  f"preprocess must be 'none', not {unit.preprocess!r}"})
        if (unit.guidance_start, unit.guidance_end) != (0.0, 1.0):
            errors.append({"type": "ip_adapter_guidance", "field": "controls",
                           "input": [unit.guidance_start, unit.guidance_end],
                           "msg": f"IP-Adapter unit {unit.type!r} conditions every step: guidance_start 0 and "
                                  f"guidance_end 1, not {unit.guidance_start:g}…{unit.guidance_end:g}"})
    return errors
