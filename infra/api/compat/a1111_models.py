"""Request and answer bodies of the AUTOMATIC1111-compatible API, and their mapping onto the farm's
:class:`~infra.schemas.RenderRequest`.

Place in the data flow: an A1111 client (``webuiapi``, the many tools built on the
stable-diffusion-webui API) → ``POST /sdapi/v1/txt2img`` (:mod:`infra.api.compat.a1111`) →
**these models** validate the body with A1111's field names and turn it into one render request
per image → the farm's submission path.

Field names, defaults and meanings follow the webui's ``StableDiffusionTxt2ImgProcessingAPI``:
``seed`` −1 draws a random seed, and the images of one call get consecutive seeds, as the webui
gives them; ``batch_size`` × ``n_iter`` images in all; ``sampler_name`` (or the deprecated
``sampler_index``) and ``scheduler`` map onto a farm scheduler (:mod:`infra.storage.samplers`);
``override_settings.sd_model_checkpoint`` picks the model; ``<lora:name:weight>`` tags in the prompt
(the webui's extra-networks syntax; weight 1 when omitted) become the request's ``loras``. Fields
the webui has and the farm does not use at their defaults are accepted and ignored, as the webui
ignores unknown ones; features the farm cannot render (hires fix, face restoration, tiling,
variation seeds, styles, scripts, extensions) are refused with a 422 naming the field, rather than
silently dropped; ControlNet units (``alwayson_scripts.controlnet``) are mapped by
:mod:`infra.api.compat.a1111_controlnet`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from infra.api.compat.a1111_controlnet import SCRIPT_KEYS
from infra.api.compat.sync import requested_field
from infra.schemas import MAX_SEED, RenderRequest
from infra.storage import samplers

#: Most images one txt2img call may ask for (``batch_size`` × ``n_iter``).
MAX_IMAGES = 100
#: RenderRequest field → the A1111 field that fills it (for error locations).
A1111_FIELD = {"num_inference_steps": "steps", "guidance_scale": "cfg_scale", "scheduler": "sampler_name",
               "model": "override_settings", "controls": "alwayson_scripts"}


#: ``<lora:name>`` or ``<lora:name:weight>``, as the webui's extra networks write them.
LORA_TAG_RE = re.compile(r"<lora:([^:>]+)(?::([^:>]+))?>")


def split_lora_tags(prompt: str) -> tuple[str, list[dict[str, Any]]]:
    """The prompt without its ``<lora:…>`` tags (whitespace around them collapsed), and the
    adapters they name as ``{"name", "weight"}`` dicts in order (a repeated name: its last weight).

    Raises:
        ValueError: a weight that is not a number.
    """
    loras: dict[str, float] = {}
    for match in LORA_TAG_RE.finditer(prompt):
        name, weight = match.group(1).strip(), match.group(2)
        try:
            loras[name] = float(weight) if weight is not None else 1.0
        except ValueError:
            raise ValueError(f"<lora:{name}:{weight}>: the weight must be a number") from None
    if not loras:
        return prompt, []
    text = re.sub(r"[ \t]{2,}", " ", LORA_TAG_RE.sub("", prompt)).strip(" ,")
    return text, [{"name": n, "weight": w} for n, w in loras.items()]



class Txt2ImgRequest(BaseModel):
    """Body of ``POST /sdapi/v1/txt2img`` (the webui's names; unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = ""
    negative_prompt: str = ""
    seed: int = Field(-1, ge=-1, le=MAX_SEED, description="−1: random; image i gets seed + i.")
    sampler_name: str | None = None
    sampler_index: str | None = Field(None, description="Deprecated alias of sampler_name.")
    scheduler: str | None = Field(None, description="Schedule type: automatic, uniform or karras.")
    batch_size: int = Field(1, ge=1, le=MAX_IMAGES)
    n_iter: int = Field(1, ge=1, le=MAX_IMAGES)
    steps: int = Field(50, ge=1, le=150)
    cfg_scale: float = Field(7.0, ge=0.0, le=30.0)
    width: int = Field(512, ge=64, le=2048)
    height: int = Field(512, ge=64, le=2048)
    styles: list[str] = Field(default_factory=list)
    subseed: int = -1
    subseed_strength: float = 0.0
    restore_faces: bool | None = None
    tiling: bool | None = None
    enable_hr: bool = False
    override_settings: dict[str, Any] = Field(default_factory=dict)
    script_name: str | None = None
    alwayson_scripts: dict[str, Any] = Field(default_factory=dict)
    send_images: bool = True
    save_images: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """``(field, reason)`` for each asked-for feature the farm cannot render."""
        out = []
        checks = (("enable_hr", self.enable_hr, "hires fix"), ("restore_faces", self.restore_faces, "face restoration"),
                  ("tiling", self.tiling, "tiling"), ("subseed_strength", self.subseed_strength > 0, "variation seeds"),
                  ("styles", self.styles, "styles"), ("script_name", self.script_name, "scripts"),
                  ("alwayson_scripts", any(v for k, v in self.alwayson_scripts.items() if k not in SCRIPT_KEYS),
                   "an extension other than ControlNet"))
        for field, asked, what in checks:
            if asked:
                out.append((field, f"{what} is not available on this farm"))
        if self.batch_size * self.n_iter > MAX_IMAGES:
            out.append(("n_iter", f"batch_size × n_iter must be at most {MAX_IMAGES}, got "
                                  f"{self.batch_size * self.n_iter}"))
        return out

    @property
    def image_count(self) -> int:
        """Images this call renders: ``batch_size`` × ``n_iter``."""
        return self.batch_size * self.n_iter

    @property
    def checkpoint(self) -> str | None:
        """The model ``override_settings.sd_model_checkpoint`` names (None: the farm's default)."""
        value = self.override_settings.get("sd_model_checkpoint")
        return str(value).strip() or None if value is not None else None

    def first_seed(self) -> int:
        """The seed of the first image: the given one, or a random one (−1) that leaves room for
        the consecutive seeds of the others."""
        if self.seed >= 0:
            return self.seed
        return secrets.randbelow(MAX_SEED + 2 - self.image_count)

    def render_requests(self, first_seed: int, model: str | None,
                        controls: Sequence[Mapping[str, Any]] = ()) -> list[RenderRequest]:
        """One :class:`RenderRequest` per image, seeds ``first_seed`` + i (wrapping at 2³²), each
        with the control units ``controls`` (:func:`infra.api.compat.a1111_controlnet.control_units`).

        Raises:
            samplers.SamplerError: unknown sampler or schedule.
            ValueError: a ``<lora:…>`` tag's weight is not a number.
            pydantic.ValidationError: a value the farm refuses (``loc`` names the A1111 field,
                see :func:`a1111_errors`).
        """
        scheduler = samplers.scheduler_for(self.sampler_name or self.sampler_index, self.scheduler)
        prompt, loras = split_lora_tags(self.prompt)
        common = {"prompt": prompt, "loras": loras, "negative_prompt": self.negative_prompt, "model": model,
                  "width": self.width, "height": self.height, "num_inference_steps": self.steps,
                  "guidance_scale": self.cfg_scale, "scheduler": scheduler, "output_format": "png",
                  "metadata": {"api": "a1111"}, "controls": list(controls), "kind": "image"}  # a video model: 422
        first = RenderRequest(**common, seed=first_seed)
        return [first, *(first.model_copy(update={"seed": (first_seed + i) % (MAX_SEED + 1)})
                         for i in range(1, self.image_count))]


def a1111_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Validation errors of render requests (a RenderRequest's, or a submission's whose ``loc`` is
    ``body.jobs.<i>[.<field>]``) with ``loc`` on the A1111 body's field names; an error naming
    no field is the model's (no pool serves it)."""
    out = []
    for err in errors:
        field = requested_field(err["loc"])
        out.append({"type": err["type"], "loc": ("body", A1111_FIELD.get(field, field)), "msg": err["msg"],
                    "input": err.get("input")})
    return out


class Txt2ImgResponse(BaseModel):
    """Answer of ``POST /sdapi/v1/txt2img``: base64 PNGs (with their infotext), the request as
    received, and ``info``, a JSON *string* (the webui's format) with per-image seeds and
    infotexts, plus the farm's ``batch_id`` and ``job_ids``."""

    images: list[str]
    parameters: dict[str, Any]
    info: str


class SdModel(BaseModel):
    """One entry of ``GET /sdapi/v1/sd-models``: a model the farm serves (no checkpoint file)."""

    title: str
    model_name: str
    hash: str | None = None
    sha256: str | None = None
    filename: str
    config: str | None = None


class LoraItem(BaseModel):
    """One entry of ``GET /sdapi/v1/loras``: an adapter requests may name, and where it loads from."""

    name: str
    alias: str
    path: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class SamplerItem(BaseModel):
    """One entry of ``GET /sdapi/v1/samplers``."""

    name: str
    aliases: list[str]
    options: dict[str, str]


class SchedulerItem(BaseModel):
    """One entry of ``GET /sdapi/v1/schedulers`` (A1111 ≥ 1.9 schedule types)."""

    name: str
    label: str
    aliases: list[str] | None = None
    default_rho: float = -1
    need_inner_model: bool = False


class ProgressState(BaseModel):
    """The ``state`` of ``GET /sdapi/v1/progress``: jobs of the tenant's unfinished batches."""

    skipped: bool = False
    interrupted: bool = False
    job: str = ""
    job_count: int = 0
    job_timestamp: str = "0"
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0


class Progress(BaseModel):
    """``GET /sdapi/v1/progress``: progress 0…1 and seconds left (estimated) of this tenant's
    unfinished batches; 0 when there are none."""

    progress: float = 0.0
    eta_relative: float = 0.0
    state: ProgressState = Field(default_factory=ProgressState)
    current_image: str | None = None
    textinfo: str | None = None
