"""Worker pools, their Celery queues and capabilities: what each pool can render.

Data flow: submission routes each request to a pool declared here (:mod:`infra.routing`) before
anything is recorded; the dispatcher (:mod:`infra.broker.dispatch`) feeds that pool's queue; a worker
(``worker.main``) consumes exactly one pool's queue and checks at start-up that its pool and
model match the declaration. All sides name queues with :func:`infra.keys.queue`, so the names cannot
drift apart.

A pool is "model × device class". Pools are declared in ``RENDERFARM_POOLS`` (settings field
``pools``), a JSON list as the Helm chart writes it::

    [{"name": "l4-sdxl", "model": "stabilityai/sdxl-turbo", "device_class": "cuda",
      "max_pixels": 1048576, "max_batch": 8, "queue": "renderfarm.l4-sdxl"}, …]

Routing with declared pools (:class:`infra.routing.Router`): among the pools serving the
request's model, the one with the *smallest* ``max_pixels`` that still fits ``width × height``
(ties: the first declared). Small renders thus go to the smallest (cheapest) pool able to take
them and large-memory pools stay free for the renders only they can do. A request no pool can
serve is refused with :class:`~infra.routing.NoPoolError`, naming the model or the size over the
largest pool's ``max_pixels``.

With no pools declared, each model is its own pool, named by a slug of the model spec, and
every size is accepted (the behaviour before pools were declared).

Upscaling: a pool lists the ``upscalers`` its workers may load; a request asking for another is
refused at submission (``unknown_upscaler``). Only the diffusion size (``width × height``) counts
against ``max_pixels``: the upscaled image may be larger. With no pools declared, a request may
name only the upscalers of ``RENDERFARM_UPSCALERS`` (default :data:`OFFLINE_UPSCALERS`, built
offline without a download), so that no request makes a worker fetch a hub file it names; the
worker holds to the same list.

Capabilities: what a model family cannot do (a negative prompt, guidance, a scheduler, a size
that is not a multiple of its latent patch) is plain data here, :data:`FAMILIES`, so the API
refuses such a request with a 422 at submission without importing diffusers. A pool names its
``family``; an offline model name implies it (:data:`OFFLINE_FAMILIES`). The pipeline derives
the same record from the loaded pipeline (``pipeline.capabilities``), so a worker refuses a pool
declared with the wrong family.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra import keys
from infra.controls import DEFAULT_MAX_CONTROLS, MAX_CONTROLS, ControlSpec
from infra.schemas import SchedulerName
from infra.video import MAX_FRAMES, is_video_family, video_errors

#: Pool names: what :func:`pool_for_model` produces, without ``:`` (the broker's priority separator).
POOL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


class Capabilities(NamedTuple):
    """What one model family can do with a request's fields.

    ``negative_prompt``: the pipeline uses a negative prompt (classifier-free guidance with it).
    ``guidance_scale``: the picture depends on ``guidance_scale`` (false for guidance-distilled
    models such as FLUX.1-schnell). ``schedulers``: the request scheduler names it can run
    (flow-matching models keep their own: ``default`` only). ``size_multiple``: width and height
    must be multiples of it, pixels (VAE factor × patch size). ``batch_invariant``: an image can
    be made independent of its batch-mates (false for ERNIE-Image, whose pipeline pads every
    prompt's text to the longest prompt of the batch). ``modes``: the render modes it has.
    ``controlnet``: the modes in which requests may carry ControlNet units (``controls``).
    ``ip_adapter``: whether a request's units may be IP-Adapters (image prompts) too.
    ``video``: the family renders video (its frame rules: :data:`infra.video.VIDEO_RULES`).
    """

    negative_prompt: bool
    guidance_scale: bool
    schedulers: tuple[str, ...]
    size_multiple: int
    batch_invariant: bool = True
    modes: tuple[str, ...] = ("txt2img",)
    controlnet: tuple[str, ...] = ()
    ip_adapter: bool = False
    video: bool = False


_ANY_SCHEDULER = get_args(SchedulerName)
_OWN_SCHEDULER = ("default",)
_ALL_MODES = ("txt2img", "img2img", "inpaint")
#: Family → capabilities. Sources: the diffusers pipelines' ``__call__`` signatures (0.42) and the
#: model cards (FLUX.1-schnell is guidance-distilled; FLUX.1-dev takes a distilled guidance
#: embedding; FLUX.1 pipelines use a negative prompt only with ``true_cfg_scale``, which the farm
#: does not pass; FLUX.2's pipeline has no negative prompt). Modes: diffusers' AutoPipelineForImage2Image
#: and AutoPipelineForInpainting mappings (0.42): SD 1/2, SDXL, SD3 and FLUX.1 have both; Kolors has an
#: img2img pipeline only; FLUX.2's image input is reference editing, not strength-based img2img, and
#: ERNIE-Image has neither. ControlNet: diffusers' ControlNet pipelines that AutoPipelineForText2Image /
#: AutoPipelineForImage2Image / AutoPipelineForInpainting ``from_pipe(..., controlnet=...)`` reach
#: (0.42): SD 1/2 and SDXL (``ControlNetModel``) and FLUX.1 (``FluxControlNetModel``) in all three
#: modes; SD3 (``SD3ControlNetModel``) in txt2img only (no ControlNet img2img pipeline; its inpainting
#: one is alimama's mask-conditioned ControlNet without an init image); FLUX.2, ERNIE-Image and Kolors
#: none. IP-Adapter units (``ip_adapter``): the UNet families, where ``pipeline.ip_adapter`` loads them.
FAMILIES: dict[str, Capabilities] = {
    "sd1": Capabilities(True, True, _ANY_SCHEDULER, 8, modes=_ALL_MODES, controlnet=_ALL_MODES, ip_adapter=True),
    "sd2": Capabilities(True, True, _ANY_SCHEDULER, 8, modes=_ALL_MODES, controlnet=_ALL_MODES, ip_adapter=True),
    "sdxl": Capabilities(True, True, _ANY_SCHEDULER, 8, modes=_ALL_MODES, controlnet=_ALL_MODES, ip_adapter=True),
    "sd3": Capabilities(True, True, _OWN_SCHEDULER, 16, modes=_ALL_MODES, controlnet=("txt2img",)),
    "flux-schnell": Capabilities(False, False, _OWN_SCHEDULER, 16, modes=_ALL_MODES, controlnet=_ALL_MODES),
    "flux-dev": Capabilities(False, True, _OWN_SCHEDULER, 16, modes=_ALL_MODES, controlnet=_ALL_MODES),
    "flux2": Capabilities(False, True, _OWN_SCHEDULER, 16),
    "ernie-image": Capabilities(True, True, _OWN_SCHEDULER, 16, batch_invariant=False),
    # Kolors: an SDXL-style UNet (any scheduler) conditioned by ChatGLM3 (prompts padded to 256 tokens).
    "kolors": Capabilities(True, True, _ANY_SCHEDULER, 8, modes=("txt2img", "img2img")),
    # Video (infra.video): Wan 2.1/2.2 (WanPipeline; UniPC flow-matching scheduler, sizes multiple of
    # VAE 8 × patch 2), LTX-Video (LTXPipeline; sizes multiple of 32) and Wan 2.1 I2V (WanImageToVideoPipeline,
    # Wan's sizes). Their image input is the first frame (optional for LTX, required for wan-i2v; infra.video).
    "wan": Capabilities(True, True, _OWN_SCHEDULER, 16, video=True),
    "ltx": Capabilities(True, True, _OWN_SCHEDULER, 32, video=True),
    "wan-i2v": Capabilities(True, True, _OWN_SCHEDULER, 16, video=True),
}
#: Offline model name → family (the names ``pipeline.models`` builds; a test keeps them equal).
OFFLINE_FAMILIES: dict[str, str] = {
    "tiny": "sd1", "sd15-arch": "sd1", "bk-sdm-tiny-arch": "sd1", "sd-turbo-arch": "sd2", "tiny-sdxl": "sdxl",
    "sdxl-arch": "sdxl", "tiny-sd3": "sd3", "sd3-arch": "sd3", "tiny-flux": "flux-schnell",
    "flux-schnell-arch": "flux-schnell", "tiny-ernie-image": "ernie-image", "ernie-image-turbo-arch": "ernie-image",
    "tiny-taiyi": "sd1", "taiyi-sd-arch": "sd1", "tiny-kolors": "kolors", "kolors-arch": "kolors",
    "tiny-wan": "wan", "wan2.1-t2v-1.3b-arch": "wan", "tiny-ltx": "ltx", "ltx-video-arch": "ltx",
    "tiny-wan-i2v": "wan-i2v", "wan2.1-i2v-14b-arch": "wan-i2v",
}
#: Upscalers ``pipeline.upscale`` builds offline with random weights (ESRGAN's ``OFFLINE_UPSCALERS``
#: and the diffusion upscalers' ``OFFLINE_DIFFUSION_UPSCALERS``; a test keeps them equal): the
#: default of ``RENDERFARM_UPSCALERS``, the upscalers a request may name when no pool is declared.
OFFLINE_UPSCALERS: tuple[str, ...] = ("esrgan-x4-arch", "tiny-esrgan-x4", "tiny-esrgan-x2", "sd-x4-upscaler-arch",
                                      "tiny-sd-x4-upscaler", "tiny-sd-x2-latent-upscaler")
#: guidance_scale values that ask for no guidance: 0 and 1 (no CFG), and the request schema's
#: default 7.5, which a client sends when the user named none. Only other values are refused
#: by a family that ignores guidance.
NEUTRAL_GUIDANCE = (0.0, 1.0, 7.5)


def capability_errors(request: Any, family: "str | Capabilities | None",
                      max_frames: int | None = None) -> list[dict[str, Any]]:
    """What ``request`` (a ``RenderRequest``) asks of ``family`` (a name in :data:`FAMILIES`, or a
    record) that it cannot do, as error dicts (``type``, ``field``, ``msg``, ``input``); empty
    when it can, or the family is unknown. A named family's video rules are checked too
    (:func:`infra.video.video_errors`, ``max_frames``: the pool's limit, None for the family's)."""
    caps = family if isinstance(family, Capabilities) else FAMILIES.get(family) if family else None
    if caps is None:
        return []
    errors = []
    name = f"model {request.model!r}" + (f" (family {family})" if isinstance(family, str) else "")
    if request.negative_prompt and not caps.negative_prompt:
        errors.append({"type": "unsupported_negative_prompt", "field": "negative_prompt",
                       "input": request.negative_prompt, "msg": f"{name} takes no negative prompt"})
    if not caps.guidance_scale and request.guidance_scale not in NEUTRAL_GUIDANCE:
        errors.append({"type": "unsupported_guidance_scale", "field": "guidance_scale", "input": request.guidance_scale,
                       "msg": f"{name} ignores guidance_scale (guidance-distilled); send 0, 1 or none"})
    if request.scheduler not in caps.schedulers:
        errors.append({"type": "unsupported_scheduler", "field": "scheduler", "input": request.scheduler,
                       "msg": f"{name} cannot use scheduler {request.scheduler!r}; it can use "
                              f"{', '.join(caps.schedulers)}"})
    mode = getattr(request, "mode", "txt2img")
    if caps.video or getattr(request, "is_video", False):
        pass  # a video's image input is its first frame: infra.video.video_errors checks it
    elif mode not in caps.modes:
        errors.append({"type": "unsupported_mode", "field": "mask_image" if mode == "inpaint" else "init_image",
                       "input": mode, "msg": f"{name} cannot render mode {mode!r}; it can render "
                                             f"{', '.join(caps.modes)}"})
    if getattr(request, "controls", None) and mode not in caps.controlnet:
        errors.append({"type": "unsupported_controlnet", "field": "controls", "input": mode,
                       "msg": f"{name} has no ControlNet pipeline for mode {mode!r} on this farm"
                              + (f"; it takes control units in {', '.join(caps.controlnet)}" if caps.controlnet
                                 else "")})
    for side in ("width", "height"):
        value = getattr(request, side)
        if value % caps.size_multiple:
            errors.append({"type": "size_not_multiple", "field": side, "input": value,
                           "msg": f"{name} needs {side} a multiple of {caps.size_multiple}, got {value}"})
    if isinstance(family, str):
        errors.extend(video_errors(request, family, max_frames))
    return errors


@functools.lru_cache(maxsize=1024)  # once per model, not once per job of a 10,000-job batch
def pool_for_model(model: str) -> str:
    """The pool name of a model spec: a lowercase slug, e.g. ``stabilityai/sd-turbo`` → ``stabilityai--sd-turbo``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower().replace("/", "--")).strip("-.")
    return slug[:100] or "default"


class LoraSpec(BaseModel):
    """One adapter a pool allows: the ``name`` requests use, and its ``source``: a hub id, a local
    path, or ``s3://<key>`` in the farm's bucket (a safetensors file in diffusers' or kohya's key
    layout, as diffusers' ``load_lora_weights`` reads); ``weight_name`` picks a file inside a hub
    repository or directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
                      description="The name requests use (loras[].name, <lora:name:weight>).")
    source: str = Field(min_length=1, max_length=1000, description="Hub id, local path or s3://<key>.")
    weight_name: str | None = Field(None, max_length=300, description="File inside a hub repository or directory.")


def lora_errors(request: Any, allowed: Sequence[LoraSpec], where: str) -> list[dict[str, Any]]:
    """An error dict (type ``unknown_lora``, field ``loras``) for each adapter ``request`` names
    that ``allowed`` lacks; ``where`` names the declaration (a pool, or RENDERFARM_LORAS)."""
    named = getattr(request, "loras", ())
    if not named:  # most requests: no set to build
        return []
    names = {spec.name for spec in allowed}
    return [{"type": "unknown_lora", "field": "loras", "input": lora.name,
             "msg": f"{where} has no adapter {lora.name!r} (it has: {', '.join(map(repr, sorted(names))) or 'none'})"}
            for lora in named if lora.name not in names]


class PoolSpec(BaseModel):
    """One declared pool, an item of ``RENDERFARM_POOLS``.

    ``max_pixels`` is the largest ``width × height`` (pixels) the pool accepts; ``max_batch`` the
    most jobs one worker renders per batch (a worker caps its batch size to it; None: the batch
    size the worker measures from its memory). ``sizes`` (each within ``max_pixels``) and
    ``guidance_scale`` say what its workers warm up (pipeline.warm.warm_plan), and on a compiled
    worker ``control_sets`` too (pipeline.warm_controls). ``queue``, when
    given, must be ``renderfarm.<name>``: it is the queue the worker started with ``--pool name``
    consumes.

    Raises:
        pydantic.ValidationError: an invalid name, a non-positive size, a mismatched queue, or a
            control set that names no unit, more than ``max_controls`` or an undeclared ControlNet.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Pool name: 1–100 of a-z 0-9 . _ - (the chart requires a DNS label).")
    model: str = Field(min_length=1, max_length=200, description="The model spec its workers pin.")
    device_class: str = Field("cpu", min_length=1, max_length=40, description="cpu, cuda, …")
    max_pixels: int = Field(2048 * 2048, ge=64 * 64, description="Largest width × height, pixels.")
    max_batch: int | None = Field(None, ge=1, le=256, description="Most jobs per batch (None: the worker's batch "
                                  "size, measured from its device memory and capped by its recipe).")
    queue: str | None = Field(None, description="renderfarm.<name> (filled in when absent).")
    family: str | None = Field(None, description="Model family (FAMILIES); an offline model name implies it.")
    steps: int | None = Field(None, ge=1, le=150, description="The num_inference_steps the pool's jobs typically ask "
                                                          "for; the worker sizes its batch at max_pixels and these "
                                                          "(default: the family's).")
    s_per_mpx_step: float | None = Field(None, gt=0, description="Accelerator seconds per megapixel per denoising "
                                         "step on this pool's devices (quotas and fair share; default: "
                                         "RENDERFARM_DEFAULT_S_PER_MPX_STEP).")
    use_pe: bool = Field(False, description="ERNIE-Image: run the prompt enhancer (its model card's validation "
                                            "turns it off).")
    batch_invariant: bool | None = Field(None, description="Identical pixels alone and in any batch (None: the "
                                                           "recipe's default, off on every device class, where "
                                                           "it cost speed; true turns it on).")
    sizes: tuple[tuple[int, int], ...] = Field((), description="The (width, height) sizes, pixels, its jobs ask "
                                               "for: a worker compiles and warms each at every batch bucket before "
                                               "it takes jobs; others run uncompiled (default: the family's native "
                                               "square, capped by max_pixels).")
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0, description="The guidance its jobs ask for, warmed "
                                         "up with (above 1 classifier-free guidance doubles the denoiser's batch; "
                                         "default: the request default).")
    upscalers: tuple[str, ...] = Field((), description="Upscaler specs its workers load on request (offline names "
                                                       "such as esrgan-x4-arch, weight files, hub files); a request "
                                                       "for another is refused at submit.")
    loras: tuple[LoraSpec, ...] = Field((), description="Adapters its workers load on request (load_lora_weights); "
                                                        "a request naming another is refused at submit.")
    controls: tuple[ControlSpec, ...] = Field((), description="ControlNets its workers load on request "
                                              "(controls[].type names one); a request naming another is refused "
                                              "at submit.")
    broker: str | None = Field(None, description="The broker shard its Celery queue lives on, a name in "
                               "RENDERFARM_BROKERS (None: the farm's broker, RENDERFARM_REDIS_URL).")
    max_controls: int = Field(DEFAULT_MAX_CONTROLS, ge=1, le=MAX_CONTROLS, description="Most control units one "
                              "request may carry (each is one more ControlNet pass per denoising step).")
    control_sets: tuple[tuple[str, ...], ...] | None = Field(
        None, description="The ControlNet unit sets its jobs use (each a list of declared ControlNet names, one "
        "per unit, in order): a compiled worker renders each at every batch bucket x size before it takes jobs, "
        "so that their denoiser calls run compiled graphs (default: each declared ControlNet alone; [] warms "
        "none).")

    max_frames: int | None = Field(None, ge=1, le=MAX_FRAMES, description="A video pool: the most frames one job "
                                   "may ask for (default: the family's, infra.video.VIDEO_RULES); a request over "
                                   "it is refused at submit. A worker measures what its memory holds at max_pixels "
                                   "and reports it (pipeline.video.sizing).")

    @model_validator(mode="after")
    def _video(self) -> "PoolSpec":
        video = is_video_family(self.model_family)
        if self.max_frames is not None and not video:
            raise ValueError(f"pool {self.name!r}: max_frames is for video pools; family "
                             f"{self.model_family!r} renders images")
        if video and self.max_batch not in (None, 1):
            raise ValueError(f"pool {self.name!r}: a video pool renders one job per batch (max_batch 1), "
                             f"got max_batch {self.max_batch}")
        if video and self.max_batch is None:  # the dispatcher and the worker size by it: one video a batch
            object.__setattr__(self, "max_batch", 1)
        return self

    @field_validator("family")
    @classmethod
    def _family(cls, v: str | None) -> str | None:
        if v is not None and v not in FAMILIES:
            raise ValueError(f"unknown model family {v!r}; known: {', '.join(FAMILIES)}")
        return v

    @property
    def model_family(self) -> str | None:
        """The declared ``family``, else the one an offline model name implies, else None."""
        return self.family or OFFLINE_FAMILIES.get(self.model)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not POOL_NAME_RE.match(v):
            raise ValueError(f"pool name must be 1–100 of a-z, 0-9, '.', '_', '-', starting alphanumeric; got {v!r}")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "PoolSpec":
        for width, height in self.sizes:
            if width < 64 or height < 64 or width * height > self.max_pixels:
                raise ValueError(f"pool {self.name!r}: size {width}x{height} must be at least 64x64 and within "
                                 f"max_pixels {self.max_pixels}")
        return self

    @model_validator(mode="after")
    def _control_sets(self) -> "PoolSpec":
        declared = [c.name for c in self.controls if c.kind == "controlnet"]
        for units in self.control_sets or ():
            unknown = [name for name in units if name not in declared]
            if not units or unknown or len(units) > self.max_controls:
                raise ValueError(f"pool {self.name!r}: control set {list(units)} must name 1 to max_controls "
                                 f"({self.max_controls}) of its declared ControlNets {declared}; unknown: {unknown}")
        return self

    @model_validator(mode="after")
    def _queue(self) -> "PoolSpec":
        expected = keys.queue(self.name)
        if self.queue is None:
            object.__setattr__(self, "queue", expected)
        elif self.queue != expected:
            raise ValueError(f"pool {self.name!r}: queue must be {expected!r} (what its workers consume), "
                             f"got {self.queue!r}")
        return self


def check_unique(pools: Sequence[PoolSpec]) -> list[PoolSpec]:
    """``pools`` as a list, or ValueError naming a pool name declared twice."""
    seen: set[str] = set()
    for pool in pools:
        if pool.name in seen:
            raise ValueError(f"pool {pool.name!r} is declared twice")
        seen.add(pool.name)
    return list(pools)


def check_brokers(brokers: dict[str, str], pools: Sequence[PoolSpec]) -> None:
    """Check the broker shards (``RENDERFARM_BROKERS``: name → URL) against the pools naming them.

    Raises:
        ValueError: a shard name that is not a pool-style name, an empty URL, a Redis Cluster
            URL (kombu's Redis transport cannot use one), or a pool naming an undeclared shard.
    """
    for name, url in brokers.items():
        if not POOL_NAME_RE.match(name):
            raise ValueError(f"broker shard name must be 1–100 of a-z, 0-9, '.', '_', '-'; got {name!r}")
        if not url.strip() or url.partition("://")[0].lower().endswith("+cluster"):
            raise ValueError(f"broker shard {name!r} needs one Redis or a sentinel:// group, not {url!r}")
    for pool in pools:
        if pool.broker is not None and pool.broker not in brokers:
            raise ValueError(f"pool {pool.name!r} names broker shard {pool.broker!r}, which RENDERFARM_BROKERS "
                             f"does not declare (declared: {', '.join(sorted(brokers)) or 'none'})")


class PoolConfigError(ValueError):
    """A worker's ``--pool``/``--model`` contradict the declared pools."""


def worker_pool(pools: Sequence[PoolSpec], pool: str | None, model: str) -> PoolSpec | None:
    """The declared pool a worker started with ``--pool pool --model model`` serves.

    Returns None when no pools are declared (the worker serves ``pool`` or the model's own pool).
    Without ``--pool``, the one declared pool serving ``model`` is taken.

    Raises:
        PoolConfigError: ``pool`` is not declared, is declared with another model, or ``pool``
            is omitted and not exactly one declared pool serves ``model``.
    """
    if not pools:
        return None
    by_name = {p.name: p for p in pools}
    if pool is None:
        serving = [p for p in pools if p.model == model]
        if len(serving) != 1:
            names = ", ".join(p.name for p in serving) or "none"
            raise PoolConfigError(f"--pool is required: model {model!r} is served by {len(serving)} declared "
                                  f"pool(s) ({names}); declared: {', '.join(by_name)}")
        return serving[0]
    spec = by_name.get(pool)
    if spec is None:
        raise PoolConfigError(f"pool {pool!r} is not declared in RENDERFARM_POOLS (declared: {', '.join(by_name)}); "
                              f"its jobs would never be routed to this worker")
    if spec.model != model:
        raise PoolConfigError(f"pool {pool!r} is declared with model {spec.model!r}, but this worker was started "
                              f"with --model {model!r}; it would render that pool's jobs with the wrong model")
    return spec
