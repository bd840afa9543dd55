"""A rendered image → its object in the bucket, with its generation parameters.

Place in the data flow: worker (a rendered PIL image for a job) → **here**: encoded as the
request's format with the A1111 ``parameters`` infotext embedded (:mod:`infra.storage.images`),
written once under the job's key with the parameters in its user metadata
(:mod:`infra.storage.s3`) → the worker records the returned :class:`~infra.schemas.JobResult`
in the job-state store.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from infra.schemas import JobResult, RenderRequest
from infra.storage.images import encode_image, format_parameters
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
    result = JobResult(key=key, width=image.width, height=image.height, seed=request.seed or 0,
                       content_type=content_type, bytes=size, denoising_steps=denoising_steps)
    return StoredImage(result, written)
