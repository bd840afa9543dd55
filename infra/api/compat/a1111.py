"""``/sdapi/v1``: the AUTOMATIC1111 web UI's API, so that its many clients (``webuiapi`` on PyPI,
the tools built on the stable-diffusion-webui API) render on the farm unchanged: txt2img, and
img2img with inpainting (:mod:`infra.api.compat.a1111_img2img`), with sd-webui-controlnet's units
(:mod:`infra.api.compat.a1111_controlnet`, which also answers ``/controlnet/model_list`` and
``/controlnet/module_list``).

Place in the data flow: an A1111 client → **``POST /sdapi/v1/txt2img`` here** → the body's
mapping onto render requests (:mod:`infra.api.compat.a1111_models`) → the farm's submission path, then
waiting for the batch (:mod:`infra.api.compat.sync`: synchronous over the queue, as the webui is, with
``RENDERFARM_SYNC_TIMEOUT_S``) → the stored PNGs, base64, with their infotext. The GETs answer
from the farm's own state: models (:meth:`infra.api.deps.Farm.known_models`), samplers and
schedule types (:mod:`infra.storage.samplers`), and the tenant's progress.

Errors keep the webui's shapes: a body it would refuse is a 422 ``{"detail": [{"loc", "msg",
"type"}]}`` naming the A1111 field; other failures ``{"error", "detail", "body", "errors"}``
(its API exception handler's shape) with 500 (a job failed), 504 (timeout) or 429 (rate limit,
``Retry-After``). Every route acts for the request's tenant (``X-API-Key``, or a farm key as the
password of the webui clients' HTTP Basic auth).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import cast

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from infra.api.compat import sync
from infra.api.compat.a1111_controlnet import control_units
from infra.api.compat.a1111_img2img import Img2ImgRequest, decode_base64_image
from infra.api.compat.a1111_models import (
    LoraItem,
    Progress,
    ProgressState,
    SamplerItem,
    SchedulerItem,
    SdModel,
    Txt2ImgRequest,
    Txt2ImgResponse,
    a1111_errors,
)
from infra.api.deps import FarmDep, Tenant
from infra.storage import samplers
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.input_images import InputRefused, store_input

router = APIRouter(prefix="/sdapi/v1", tags=["a1111"])

SCHEDULE_LABELS = {"automatic": "Automatic", "uniform": "Uniform", "karras": "Karras"}


def _error(status: int, exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    """The webui's API exception shape."""
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc), "body": "", "errors": str(exc)},
                        status_code=status, headers=headers)


def _invalid(field: str, message: str, value: object = None) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message, "input": value}])


@router.post("/txt2img", response_model=Txt2ImgResponse)
async def txt2img(body: Txt2ImgRequest, request: Request, farm: FarmDep, tenant: Tenant):
    """Render ``batch_size`` × ``n_iter`` images and answer once they are all done (base64 PNGs
    whose ``parameters`` chunk names the real sampler), as the webui does. 422 names the field
    of a body the farm cannot render; 504 after ``RENDERFARM_SYNC_TIMEOUT_S`` (the jobs are
    then canceled); 500 when a job fails."""
    model = await _checked_model(body, farm)
    try:
        controls = await _controls(body, farm, init_key=None)
    except InputRefused as exc:
        return _error(exc.status, ValueError(f"alwayson_scripts: {exc.reason}"))
    first_seed = body.first_seed()
    requests = _requests(body, lambda: body.render_requests(first_seed, model, controls))
    return await _render_and_answer(body, requests, first_seed, request, farm, tenant)


async def _controls(body: Txt2ImgRequest, farm, *, init_key: str | None) -> list[dict]:
    """The body's ControlNet units (:mod:`infra.api.compat.a1111_controlnet`), their images checked
    and stored like uploads; in img2img a unit without an image takes the init image (``init_key``)."""
    async def store(data: bytes) -> str:
        stored = await run_in_threadpool(store_input, farm.storage, data, max_bytes=farm.settings.input_max_bytes,
                                         max_pixels=farm.settings.input_max_pixels)
        return stored.key

    return await control_units(body.alwayson_scripts, width=body.width, height=body.height, init_key=init_key,
                               store=store, decode=decode_base64_image)


async def _checked_model(body: Txt2ImgRequest, farm) -> str | None:
    """The body's checkpoint (None: the default model), after the checks both routes share: a
    field the farm would render differently, or a checkpoint it does not serve, is a 422 naming it."""
    problems = body.unsupported()
    if problems:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": msg, "input": None}
                                      for field, msg in problems])
    model = body.checkpoint
    if model is not None and model not in await run_in_threadpool(farm.known_models):
        raise _invalid("override_settings", f"sd_model_checkpoint {model!r} is not served by this farm", model)
    return model


def _requests(body: Txt2ImgRequest, build: Callable[[], list]) -> list:
    """``build()``'s RenderRequests, its errors as the webui's 422s: an unknown sampler names its
    field, a bad value its A1111 field, a malformed ``<lora:…>`` tag the prompt."""
    try:
        return build()
    except samplers.SamplerError as exc:
        raise _invalid(exc.field, str(exc), getattr(body, exc.field)) from None
    except ValidationError as exc:
        raise RequestValidationError(a1111_errors(exc.errors())) from None
    except ValueError as exc:  # a <lora:…> tag
        raise _invalid("prompt", str(exc), body.prompt) from None


async def _render_and_answer(body: Txt2ImgRequest, requests: list, first_seed: int, request: Request, farm,
                             tenant: str):
    """Render ``requests`` over the queue and answer as the webui does (images, parameters, info)."""
    started = datetime.now(timezone.utc)
    try:
        jobs = await sync.render(farm, requests, tenant=tenant, timeout_s=farm.settings.sync_timeout_s,
                                 disconnected=request.is_disconnected)
    except sync.SyncTimeout as exc:
        return _error(504, exc)
    except sync.RenderFailed as exc:
        return _error(500, exc)
    except sync.ClientGone as exc:
        return _error(499, exc)
    except RequestValidationError as exc:  # no pool serves the model or the size
        raise RequestValidationError(a1111_errors(list(exc.errors()))) from None
    images = await sync.image_bytes(farm, jobs)
    infotexts = [read_parameters(data) or "" for data in images]
    first = requests[0]
    sampler = parse_parameters(infotexts[0]).get("Sampler", samplers.label(first.scheduler)) if infotexts else ""
    info = {
        "prompt": first.prompt, "all_prompts": [r.prompt for r in requests],
        "negative_prompt": first.negative_prompt, "all_negative_prompts": [r.negative_prompt for r in requests],
        "seed": first_seed, "all_seeds": [r.seed for r in requests], "subseed": -1,
        "all_subseeds": [-1] * len(requests), "subseed_strength": 0, "width": first.width, "height": first.height,
        "sampler_name": sampler, "scheduler": body.scheduler or "automatic", "cfg_scale": first.guidance_scale,
        "steps": first.num_inference_steps, "batch_size": body.batch_size, "n_iter": body.n_iter,
        "restore_faces": False, "sd_model_name": jobs[0].request.model if jobs[0].request else first.model,
        "sd_model_hash": None, "index_of_first_image": 0, "infotexts": infotexts, "styles": [],
        "job_timestamp": started.strftime("%Y%m%d%H%M%S"), "clip_skip": 1, "version": "renderfarm",
        "batch_id": jobs[0].batch_id, "job_ids": [j.job_id for j in jobs],
    }
    encoded = [sync.b64(data) for data in images] if body.send_images else []
    keep_inputs = getattr(body, "include_init_images", True)  # the webui answers without them by default
    parameters = body.model_dump(mode="json", exclude=None if keep_inputs else {"init_images", "mask"})
    return Txt2ImgResponse(images=encoded, parameters=parameters, info=json.dumps(info))


@router.post("/img2img", response_model=Txt2ImgResponse)
async def img2img(body: Img2ImgRequest, request: Request, farm: FarmDep, tenant: Tenant):
    """Render ``batch_size`` × ``n_iter`` images from ``init_images[0]`` (and ``mask``:
    inpainting) at ``denoising_strength``, answered as txt2img is. The images are checked and
    stored like uploads (413 over ``RENDERFARM_INPUT_MAX_BYTES``, 415 a format other than PNG,
    JPEG or WebP, 422 not an image or too many pixels, naming ``init_images`` or ``mask``); a
    field the farm renders differently is a 422 naming it (:mod:`infra.api.compat.a1111_img2img`)."""
    model = await _checked_model(body, farm)
    keys: dict[str, str | None] = {"init_images": None, "mask": None}
    for field in keys:
        try:
            data = body.init_bytes() if field == "init_images" else body.mask_bytes()
            if data is not None:
                stored = await run_in_threadpool(store_input, farm.storage, data,
                                                 max_bytes=farm.settings.input_max_bytes,
                                                 max_pixels=farm.settings.input_max_pixels)
                keys[field] = stored.key
        except InputRefused as exc:
            if exc.status != 422:
                return _error(exc.status, ValueError(f"{field}: {exc.reason}"))
            raise _invalid(field, exc.reason) from None
        except ValueError as exc:
            raise _invalid(field, str(exc)) from None
    try:
        controls = await _controls(body, farm, init_key=keys["init_images"])
    except InputRefused as exc:
        return _error(exc.status, ValueError(f"alwayson_scripts: {exc.reason}"))
    first_seed = body.first_seed()
    requests = _requests(body, lambda: body.image_requests(first_seed, model, cast(str, keys["init_images"]),
                                                           keys["mask"], controls))
    return await _render_and_answer(body, requests, first_seed, request, farm, tenant)


@router.get("/loras", response_model=list[LoraItem])
def loras(farm: FarmDep, tenant: Tenant) -> list[LoraItem]:
    """The adapters requests may name (``<lora:name:weight>``): ``RENDERFARM_LORAS`` and every
    declared pool's, once per name (the first declaration's source)."""
    seen: dict[str, LoraItem] = {}
    for spec in (*farm.settings.loras, *(lora for pool in farm.settings.pools for lora in pool.loras)):
        seen.setdefault(spec.name, LoraItem(name=spec.name, alias=spec.name, path=spec.source))
    return list(seen.values())


@router.get("/sd-models", response_model=list[SdModel])
def sd_models(farm: FarmDep, tenant: Tenant) -> list[SdModel]:
    """The models the farm serves: the default, the declared pools' and the live workers'."""
    return [SdModel(title=m, model_name=m, filename=m) for m in farm.known_models()]


@router.get("/samplers", response_model=list[SamplerItem])
def sampler_list(tenant: Tenant) -> list[SamplerItem]:
    """The samplers the farm renders, with their aliases; ``options.scheduler`` is the schedule
    ``automatic`` picks (Karras for the DPM++ 2M family, as in A1111 ≥ 1.9)."""
    return [SamplerItem(name=s.name, aliases=list(s.aliases), options=s.options()) for s in samplers.SAMPLERS]


@router.get("/schedulers", response_model=list[SchedulerItem])
def scheduler_list(tenant: Tenant) -> list[SchedulerItem]:
    """The schedule types the farm renders (A1111 ≥ 1.9's ``scheduler`` field)."""
    return [SchedulerItem(name=n, label=SCHEDULE_LABELS[n], default_rho=7.0 if n == "karras" else -1)
            for n in samplers.SCHEDULES]


@router.get("/options")
def options(farm: FarmDep, tenant: Tenant) -> dict:
    """The few webui options a client reads: the default model and the sample format."""
    return {"sd_model_checkpoint": farm.settings.default_model, "samples_format": "png"}


@router.get("/scripts")
def scripts(tenant: Tenant) -> dict:
    """No webui scripts or extensions run here."""
    return {"txt2img": [], "img2img": []}


@router.get("/progress", response_model=Progress)
def progress(farm: FarmDep, tenant: Tenant, skip_current_image: bool = False) -> Progress:
    """Progress of this tenant's unfinished batches (among its 20 newest): done fraction over
    their images, and the seconds left at the rate since the oldest of them was submitted."""
    running = [b for b in farm.store.recent_batches(tenant, limit=20) if not b.done]
    if not running:
        return Progress()
    total = sum(b.total for b in running)
    fraction = sum(b.progress * b.total for b in running) / total
    elapsed = time.time() - min(b.created_at.timestamp() for b in running)
    eta = elapsed * (1 - fraction) / fraction if fraction > 0 else 0.0
    ended = sum(b.counts.get(s, 0) for b in running for s in ("succeeded", "failed", "canceled"))
    state = ProgressState(job=running[0].batch_id, job_count=total, job_no=ended,
                          job_timestamp=running[-1].created_at.strftime("%Y%m%d%H%M%S"))
    return Progress(progress=round(fraction, 4), eta_relative=round(eta, 2), state=state)
