"""The farm's public types (ARCHITECTURE.md, "Public contract"), validated with pydantic v2 at every edge.

A :class:`RenderRequest` enters at the producer (Python, CLI or HTTP), travels as JSON in the
Celery message, and is rendered by a worker. A :class:`JobStatus` is what the job-state store
returns for it. Validation errors name the field and the rule that failed.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.controls import MAX_CONTROLS
from infra.controls import ControlUnit as ControlUnit
from infra.image_refs import IMAGE_REF_RE as IMAGE_REF_RE
from infra.image_refs import INPUT_KEY_PREFIX as INPUT_KEY_PREFIX
from infra.image_refs import check_image_ref
from infra.image_refs import is_url as is_url
from infra.video import MAX_FPS, MAX_FRAMES, MIN_FPS
from infra.worker_schemas import QueueDepth as QueueDepth
from infra.worker_schemas import WorkerInfo as WorkerInfo

JobState = Literal["queued", "running", "succeeded", "failed", "canceled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "canceled"})
JOB_STATES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "canceled")

OutputFormat = Literal["png", "webp", "jpeg"]
Priority = Literal["high", "normal", "low"]

#: Scheduler names a request may ask for; ``default`` keeps the model's own scheduler.
#: The pipeline package maps each name to a diffusers scheduler class; :mod:`infra.storage.samplers`
#: maps them to AUTOMATIC1111's sampler names (``_karras``: the Karras noise schedule).
SchedulerName = Literal[
    "default", "ddim", "pndm", "euler", "euler_ancestral", "dpmpp_2m", "lms", "heun", "unipc", "lcm",
    "dpmpp_2m_karras", "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "lms_karras", "dpm2", "dpm2_karras",
    "dpm2_ancestral", "dpm2_ancestral_karras",
]

MAX_SEED = 2**32 - 1
#: diffusers' default strength per mode (StableDiffusionImg2ImgPipeline 0.8, StableDiffusionInpaintPipeline 1.0).
DEFAULT_STRENGTH: dict[str, float] = {"img2img": 0.8, "inpaint": 1.0}
#: A job or batch id: 32 lowercase hex digits (a UUID4's hex, :func:`infra.submission.submitter.new_id`).
FARM_ID_RE = re.compile(r"[0-9a-f]{32}")


def is_farm_id(value: str) -> bool:
    """Whether ``value`` is shaped like a job or batch id (32 lowercase hex digits). Anything else
    is never a stored id, and must never become part of a Redis key name (``rf:batch:{id}:jobs``
    would read another key)."""
    return FARM_ID_RE.fullmatch(value) is not None

#: The metadata field of a RenderRequest that carries its catalog key (:mod:`infra.state.catalog_index`).
CATALOG_KEY_FIELD = "catalog_key"
#: Most catalog keys one ``POST /v1/catalog/lookup`` may ask about.
MAX_LOOKUP_KEYS = 10_000
CONTENT_TYPES: dict[str, str] = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}

RenderMode = Literal["txt2img", "img2img", "inpaint"]
#: What a job renders: one image, or a video (frames encoded as MP4, :mod:`infra.video`).
JobKind = Literal["image", "video"]
#: An adapter name as pools declare it (and as A1111's ``<lora:name:weight>`` writes it).
LORA_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: Most adapters one request may combine.
MAX_LORAS = 8


class LoraRef(BaseModel):
    """One adapter of a request: a ``name`` its pool declares and its ``weight`` (the scale
    diffusers' ``set_adapters`` applies; 1.0 is the adapter as trained, -4…4)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, description="An adapter the pool declares.")
    weight: float = Field(1.0, ge=-4.0, le=4.0, description="Adapter scale, -4…4 (1: as trained).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not LORA_NAME_RE.fullmatch(v):
            raise ValueError(f"adapter name must be 1–100 of A-Z a-z 0-9 . _ - starting alphanumeric, got {v[:100]!r}")
        return v


class RenderRequest(BaseModel):
    """One render: text to image, image to image, or inpainting (:attr:`mode`, from the fields present).

    ``init_image`` and ``mask_image`` are image references (an object key in the farm's bucket,
    e.g. ``inputs/<sha256>.png`` from ``POST /v1/uploads``, or an ``https`` URL that the API
    fetches once and replaces by such a key); workers read them from the bucket only. A mask is
    white where the image is repainted (diffusers' convention) and must have the init image's
    size. ``strength`` (0 < strength ≤ 1, diffusers' meaning: the fraction of the denoising
    schedule that is run, so about ``num_inference_steps × strength`` steps) applies to img2img
    and inpainting; None means diffusers' defaults (0.8 img2img, 1.0 inpaint: :data:`DEFAULT_STRENGTH`).
    ``loras`` are adapters the pool declares, with their weights. ``controls`` are ControlNet units
    (:class:`infra.controls.ControlUnit`): a type the pool declares, a control image referenced as
    ``init_image`` is, its weight (``controlnet_conditioning_scale``) and guidance range.

    A **video** (``kind: video``, or any request for a model of a video family, :mod:`infra.video`)
    renders ``num_frames`` frames played at ``fps`` frames per second, text-to-video, or
    image-to-video with ``init_image`` as the first frame (families with image-to-video only);
    it is stored as an H.264 MP4 with a poster frame (in ``output_format``) and an animated WebP
    preview. Video requests take no mask, strength, upscaling, adapters or control units.

    Sizes are pixels; ``width`` and ``height`` must be multiples of 8 in 64…2048 (the VAE
    downsamples by 8). They are the diffusion size: with ``upscale`` (2 or 4) and an ``upscaler``
    the stored image is ``upscale`` times larger per side. ``seed`` is assigned by the producer
    when absent, so that every stored job is reproducible. ``model`` ``None`` means the farm's default model.

    Raises:
        pydantic.ValidationError: naming the field and the rule, e.g.
            ``width: Value error, width must be a multiple of 8, got 100``.
    """

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    prompt: str = Field(min_length=1, max_length=2000, description="Text prompt, 1…2,000 characters.")
    negative_prompt: str = Field("", max_length=2000, description="Negative prompt, up to 2,000 characters.")
    model: str | None = Field(None, min_length=1, max_length=200, description="Hub id, local path or offline name.")
    width: int = Field(512, ge=64, le=2048, description="Pixels, multiple of 8.")
    height: int = Field(512, ge=64, le=2048, description="Pixels, multiple of 8.")
    num_inference_steps: int = Field(20, ge=1, le=150, description="Denoising steps.")
    guidance_scale: float = Field(7.5, ge=0.0, le=30.0, description="Classifier-free guidance scale.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="RNG seed; assigned when absent.")
    scheduler: SchedulerName = Field("default", description="Scheduler name; default keeps the model's.")
    output_format: OutputFormat = Field("png", description="Image file format.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Free str→str map, kept with the job.")
    upscale: int | None = Field(None, description="Upscale the rendered image by 2 or 4 (needs upscaler); "
                                                            "the result is width·upscale × height·upscale.")
    upscaler: str | None = Field(None, min_length=1, max_length=300,
                                 description="The upscaler (one its pool declares), e.g. an ESRGAN network.")
    init_image: str | None = Field(None, max_length=2048,
                                   description="img2img/inpaint input: an object key in the farm's bucket "
                                               "(POST /v1/uploads answers one) or an https URL the API fetches once.")
    mask_image: str | None = Field(None, max_length=2048,
                                   description="Inpainting mask (white = repaint), the init image's size; "
                                               "a key or https URL like init_image. Needs init_image.")
    strength: float | None = Field(None, gt=0.0, le=1.0,
                                   description="0 < strength ≤ 1: how much of the init image is re-noised "
                                               "(diffusers' meaning; default 0.8 img2img, 1.0 inpaint).")
    loras: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORAS,
                                 description="Adapters (names the pool declares) and weights, at most 8.")
    # left out of a dump when empty: a request without units serializes as it did before units
    # existed (the same bytes in a batch body, the same catalog content keys)
    controls: list[ControlUnit] = Field(default_factory=list, max_length=MAX_CONTROLS, exclude_if=lambda v: not v,
                                        description="ControlNet units (types the pool declares), each with its "
                                                    "control image, weight and guidance range; at most the pool's "
                                                    "max_controls (default 3).")
    # video fields: left out of a dump when absent, so an image request serializes as before them
    kind: JobKind | None = Field(None, exclude_if=lambda v: v is None,
                                 description="image or video; absent: the model's kind (a video model renders "
                                             "video, with its family's default num_frames and fps).")
    num_frames: int | None = Field(None, ge=1, le=MAX_FRAMES, exclude_if=lambda v: v is None,
                                   description="Video frames, within the family's rule (Wan 4k+1, LTX-Video 8k+1) "
                                               "and the pool's max_frames; absent: the family's default.")
    fps: int | None = Field(None, ge=MIN_FPS, le=MAX_FPS, exclude_if=lambda v: v is None,
                            description="Video frames per second, 1…60 (the MP4's frame rate); absent: the "
                                        "family's default.")

    @property
    def mode(self) -> RenderMode:
        """``inpaint`` with a mask, ``img2img`` with an init image alone, else ``txt2img``."""
        if self.mask_image is not None:
            return "inpaint"
        return "img2img" if self.init_image is not None else "txt2img"

    @property
    def is_video(self) -> bool:
        """Whether this request renders a video: ``kind`` video, or video fields without a kind
        (a request with ``kind`` absent for a video model becomes one at submission)."""
        return self.kind == "video" or (self.kind is None and (self.num_frames is not None or self.fps is not None))

    @property
    def duration_s(self) -> float | None:
        """A video's length in seconds (``num_frames / fps``) once both are set, else None."""
        return self.num_frames / self.fps if self.is_video and self.num_frames and self.fps else None

    @property
    def effective_strength(self) -> float | None:
        """The strength the pipeline runs with: the request's, else the mode's default (None for
        txt2img and for video, whose init image is the first frame, not re-noised)."""
        if self.mode == "txt2img" or self.is_video:
            return None
        return self.strength if self.strength is not None else DEFAULT_STRENGTH[self.mode]

    @field_validator("init_image", "mask_image")
    @classmethod
    def _image_ref(cls, v: str | None, info) -> str | None:
        return v if v is None else check_image_ref(v, info.field_name)

    @field_validator("loras")
    @classmethod
    def _unique_loras(cls, v: list[LoraRef]) -> list[LoraRef]:
        names = [lora.name for lora in v]
        if len(set(names)) != len(names):
            raise ValueError(f"each adapter may appear once, got {names}")
        return v

    @model_validator(mode="after")
    def _inputs_pair(self) -> "RenderRequest":
        if self.init_image is None and self.mask_image is not None:
            raise ValueError("mask_image needs init_image (inpainting repaints the masked part of an init image)")
        if self.init_image is None and self.strength is not None:
            raise ValueError("strength needs init_image (it is how much of the init image is re-noised)")
        return self

    @model_validator(mode="after")
    def _video_fields(self) -> "RenderRequest":
        if self.kind == "image" and (self.num_frames is not None or self.fps is not None):
            raise ValueError("num_frames and fps are video fields; an image request (kind 'image') takes neither")
        if not self.is_video:
            return self
        refused = [name for name, present in (
            ("mask_image", self.mask_image is not None), ("strength", self.strength is not None),
            ("upscale", self.upscale is not None), ("loras", bool(self.loras)), ("controls", bool(self.controls)))
            if present]
        if refused:
            raise ValueError(f"a video request takes no {', '.join(refused)} (video jobs are text-to-video, or "
                             "image-to-video with init_image as the first frame)")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt must contain a non-whitespace character")
        return v

    @field_validator("width", "height")
    @classmethod
    def _multiple_of_8(cls, v: int, info) -> int:
        if v % 8:
            raise ValueError(f"{info.field_name} must be a multiple of 8, got {v}")
        return v

    @field_validator("upscale")
    @classmethod
    def _upscale_factor(cls, v: int | None) -> int | None:
        if v is not None and v not in (2, 4):
            raise ValueError(f"upscale must be 2 or 4, got {v}")
        return v

    @model_validator(mode="after")
    def _upscale_pair(self) -> "RenderRequest":
        if (self.upscale is None) != (self.upscaler is None):
            raise ValueError("upscale and upscaler go together: give both (upscale 2 or 4 and an upscaler) or neither")
        return self

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 32:
            raise ValueError(f"metadata may hold at most 32 entries, got {len(v)}")
        for key, value in v.items():
            for text in (key, value):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(
                        f"metadata key {key[:64]!r} or its value is not valid UTF-8 (lone surrogate)") from None
            if not 1 <= len(key) <= 64:
                raise ValueError(f"metadata key {key[:64]!r} must be 1…64 characters")
            if len(value) > 1024:
                raise ValueError(f"metadata value for {key!r} must be at most 1,024 characters")
        return v


class BatchSubmission(BaseModel):
    """Body of ``POST /v1/batches``: up to 10,000 requests submitted as one batch."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[RenderRequest] = Field(min_length=1, max_length=10_000)
    priority: Priority = "normal"
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    webhook_url: str | None = Field(None, max_length=2000)


class JobAccepted(BaseModel):
    """Answer to ``POST /v1/jobs``."""

    job_id: str
    batch_id: str


class BatchAccepted(BaseModel):
    """Answer to ``POST /v1/batches``: job ids in submission order."""

    batch_id: str
    job_ids: list[str]


class JobResult(BaseModel):
    """Where a rendered image (or a video's MP4) is: S3 ``key`` and a presigned GET ``url`` (a
    video's URL answers HTTP range requests, so players seek); sizes in pixels and bytes;
    ``denoising_steps``, what the worker counted while it rendered the image."""

    key: str
    url: str | None = None
    width: int
    height: int
    seed: int
    content_type: str
    bytes: int
    denoising_steps: int | None = Field(
        None, ge=0, description="Denoising steps the worker ran for the pipeline call(s) that rendered this "
        "image's group: its step callbacks, counted (a step is one pass of the denoising loop, which calls the "
        "denoiser on the call's whole batch). "
        "txt2img runs num_inference_steps; img2img and inpainting about num_inference_steps × strength "
        "(diffusers' rule); a group split into several batch-bucket calls counts the steps of each. "
        "None: a result recorded by a worker that did not count them.")
    control_maps: list[str] | None = Field(None, description="Object keys of the control maps that conditioned the "
                                           "render, one per control unit in order ({job_id}.control-N.png).")
    preprocess_s: float | None = Field(None, ge=0, description="Seconds the worker took to read and preprocess "
                                       "this job's control images (inside its group's render time).")
    # a video's: left out of an image's result
    num_frames: int | None = Field(None, exclude_if=lambda v: v is None, description="A video's frames.")
    fps: int | None = Field(None, exclude_if=lambda v: v is None, description="A video's frames per second.")
    duration_s: float | None = Field(None, exclude_if=lambda v: v is None, description="A video's length, seconds.")
    poster: str | None = Field(None, exclude_if=lambda v: v is None,
                               description="A video's poster frame (its first frame, in the request's "
                                           "output_format): object key ({job_id}.poster.<ext>).")
    poster_url: str | None = Field(None, exclude_if=lambda v: v is None, description="Presigned GET URL of the poster.")
    preview: str | None = Field(None, exclude_if=lambda v: v is None,
                                description="A video's animated WebP preview: object key ({job_id}.preview.webp).")
    preview_url: str | None = Field(None, exclude_if=lambda v: v is None,
                                    description="Presigned GET URL of the preview.")


class JobError(BaseModel):
    """Why a job failed: the exception type and its message."""

    type: str
    message: str


class JobStatus(BaseModel):
    """The state of one job, as the job-state store records it.

    ``progress`` is 0…1 (denoising steps done / steps). Times are UTC.
    """

    job_id: str
    batch_id: str
    state: JobState
    progress: float = Field(0.0, ge=0.0, le=1.0)
    attempts: int = 0
    worker: str | None = None
    pool: str | None = None
    waiting_for: str | None = Field(None, description="Set while the job is queued for a pool with no live worker: "
                                                      "'a worker of pool <name>' (an autoscaler starts one).")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    result: JobResult | None = None
    error: JobError | None = None
    request: RenderRequest | None = None


class BatchStatus(BaseModel):
    """The state of one batch: counts by state, overall progress 0…1, and one page of jobs."""

    batch_id: str
    created_at: datetime
    total: int
    counts: dict[str, int]
    progress: float = Field(ge=0.0, le=1.0)
    done: bool
    jobs: list[JobStatus]
    offset: int = 0
    limit: int = 0
    next_offset: int | None = None

    @model_validator(mode="after")
    def _counts_cover_states(self) -> "BatchStatus":
        for state in JOB_STATES:
            self.counts.setdefault(state, 0)
        return self
