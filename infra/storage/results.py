"""A rendered image → its object in the bucket, with its generation parameters.

Place in the data flow: worker (a rendered PIL image for a job) → **here**: encoded as the
request's format with the A1111 ``parameters`` infotext embedded (:mod:`infra.storage.images`),
written once under the job's key with the parameters in its user metadata
(:mod:`infra.storage.s3`), and its control maps beside it (``{job_id}.control-N.png``, one per
ControlNet unit, as the renderer made them) → the worker records the returned
:class:`~infra.schemas.JobResult` in the job-state store.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from infra.controls import CONTROL_MAPS_INFO, PREPROCESS_S_INFO
from infra.schemas import JobResult, RenderRequest
from infra.storage.images import control_unit_text, encode_image, encode_png, format_parameters
from infra.storage.s3 import Storage, object_key, object_metadata


@dataclass(frozen=True)
class StoredImage:
    """What :func:`store_image` did: the job's ``result``, and whether this call ``written`` the
    object (False: an earlier attempt's object was already there and was kept)."""

    result: JobResult
    written: bool


def store_image(storage: Storage, image: Image.Image, *, job_id: str, batch_id: str, request: RenderRequest,
                model: str, retry_s: float = 60.0, scheduler: str | None = None,
                lora_hashes: dict[str, str] | None = None, denoising_steps: int | None = None) -> StoredImage:
    """Encode ``image`` (RGB, ``request.width`` × ``request.height`` pixels, times ``request.upscale``
    when set) and write it once to
    ``{batch_id}/{job_id}.{ext}``.

    Args:
        storage: the bucket.
        request: the job's request (``seed`` set); its ``output_format`` picks the encoding.
        model: the model that rendered it, as the infotext and metadata name it.
        scheduler: the farm name of the scheduler that rendered it, as the infotext names it
            (default ``request.scheduler``; the worker names the model's own for ``default``).
        retry_s: how long the upload rides out a storage outage, seconds.
        lora_hashes: adapter name → short hash, for the infotext's ``Lora hashes``.
        denoising_steps: the denoising steps the worker counted for the image's group (recorded in
            the result as :attr:`~infra.schemas.JobResult.denoising_steps`), or None.
    Returns:
        the result to record (its ``bytes`` is the stored object's size, also when an earlier
        write was kept).
    Raises:
        obstore's errors: storage refused the write, or stayed unreachable for ``retry_s``.
    """
    parameters = format_parameters(request, model=model, job_id=job_id, scheduler=scheduler, lora_hashes=lora_hashes)
    body, content_type = encode_image(image, request.output_format, parameters)
    key = object_key(batch_id, job_id, request.output_format)
    metadata = object_metadata({"job-id": job_id, "batch-id": batch_id, "seed": str(request.seed),
                                "model": model, "steps": str(request.num_inference_steps),
                                "cfg-scale": f"{request.guidance_scale:g}",
                                "size": f"{request.width}x{request.height}",
                                **({"upscaler": request.upscaler or "", "upscale": str(request.upscale),
                                    "output-size": f"{image.width}x{image.height}"} if request.upscale else {})},
                                parameters)
    written = storage.put_once(key, body, content_type, metadata, retry_s=retry_s)
    size = len(body) if written else storage.size(key)
    maps = store_control_maps(storage, image, batch_id=batch_id, job_id=job_id, request=request, retry_s=retry_s)
    spent = image.info.get(PREPROCESS_S_INFO)
    result = JobResult(key=key, width=image.width, height=image.height, seed=request.seed or 0,
                       content_type=content_type, bytes=size, denoising_steps=denoising_steps,
                       control_maps=maps or None, preprocess_s=round(spent, 6) if spent is not None else None)
    return StoredImage(result, written)


def control_map_key(batch_id: str, job_id: str, n: int) -> str:
    """The S3 key of control unit ``n``'s map: ``{batch_id}/{job_id}.control-{n}.png``, beside the image."""
    return f"{batch_id}/{job_id}.control-{n}.png"


def store_control_maps(storage: Storage, image: Image.Image, *, batch_id: str, job_id: str,
                       request: RenderRequest, retry_s: float = 60.0) -> list[str]:
    """Write once, as PNG, the control maps the renderer handed on in ``image.info``
    (:data:`~infra.controls.CONTROL_MAPS_INFO`: one RGB image per control unit of ``request``), each
    with its unit's infotext (:func:`~infra.storage.images.control_unit_text`); returns their keys
    (:func:`control_map_key`) in unit order, empty when there are none.

    Raises:
        obstore's errors: as :meth:`infra.storage.s3.Storage.put_once`.
    """
    keys = []
    for n, (unit, control) in enumerate(zip(request.controls, image.info.get(CONTROL_MAPS_INFO) or ())):
        key = control_map_key(batch_id, job_id, n)
        text = f"ControlNet {n}: {control_unit_text(unit)}\nJob id: {job_id}"
        storage.put_once(key, encode_png(control, text), "image/png",
                         object_metadata({"job-id": job_id, "batch-id": batch_id, "control-unit": str(n)}, text),
                         retry_s=retry_s)
        keys.append(key)
    return keys
