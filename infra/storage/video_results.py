"""A rendered video → its three objects in the bucket: the MP4, the poster frame, the preview.

Place in the data flow: worker (the poster image of a rendered video, carrying its frames,
:func:`infra.video.frames_of`) → **here**: the MP4 encoded to a temporary file and uploaded from it
(:meth:`infra.storage.s3.Storage.put_file_once`: memory does not grow with the file), the poster
and the animated WebP preview written once beside it (:mod:`infra.storage.video`), each with the
generation parameters in its user metadata → the worker records the returned
:class:`~infra.schemas.JobResult` (``content_type`` ``video/mp4``, the video fields filled).

The temporary file lives in Python's temporary directory (``TMPDIR``, else ``/tmp``): on a host
whose ``/tmp`` is a tmpfs it occupies memory after all, so point ``TMPDIR`` at a disk there.

Keys: ``{batch_id}/{job_id}.mp4``, ``{batch_id}/{job_id}.poster.<ext>`` (the request's
``output_format``; ``jpeg`` → ``jpg``) and ``{batch_id}/{job_id}.preview.webp``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from PIL import Image

from infra.schemas import JobResult, RenderRequest
from infra.storage.results import StoredImage
from infra.storage.s3 import Storage, object_key, object_metadata
from infra.storage.video import encode_mp4, encode_poster, encode_preview, video_parameters
from infra.video import frames_of

MP4_CONTENT_TYPE = "video/mp4"
WEBP_CONTENT_TYPE = "image/webp"


def video_keys(batch_id: str, job_id: str, output_format: str) -> tuple[str, str, str]:
    """The S3 keys of a video job's objects: (MP4, poster, preview), see the module docstring."""
    poster = object_key(batch_id, f"{job_id}.poster", output_format)
    return f"{batch_id}/{job_id}.mp4", poster, f"{batch_id}/{job_id}.preview.webp"


def store_video(storage: Storage, image: Image.Image, *, job_id: str, batch_id: str, request: RenderRequest,
                model: str, retry_s: float = 60.0, scheduler: str | None = None,
                denoising_steps: int | None = None) -> StoredImage:
    """Encode the video that ``image`` carries and write its MP4, poster and preview once.

    Args:
        storage: the bucket.
        image: the poster (the first frame, RGB) with the frames attached
            (:func:`infra.video.attach_frames`: uint8 ``(num_frames, height, width, 3)``, fps).
        request: the job's request (``seed`` set); its ``output_format`` is the poster's format.
        model: the model that rendered it, as the infotext and metadata name it.
        retry_s: how long each upload rides out a storage outage, seconds.
        scheduler: the farm name of the scheduler it was rendered with (default ``request.scheduler``).
        denoising_steps: the denoising steps the worker counted for the job's group, or None.
    Returns:
        the result to record (``bytes``: the MP4's size, also when an earlier write was kept;
        ``width`` × ``height``: the MP4's frame size, odd sides padded to even) and whether this
        call wrote the MP4.
    Raises:
        ValueError: ``image`` carries no frames, or frames of the wrong shape or dtype.
        av.FFmpegError: encoding failed. obstore's errors: as :meth:`~infra.storage.s3.Storage.put_once`.
    """
    carried = frames_of(image)
    if carried is None:
        raise ValueError("the image carries no video frames (infra.video.attach_frames)")
    frames, fps = carried
    num_frames = int(frames.shape[0])
    parameters = video_parameters(request, model=model, job_id=job_id, scheduler=scheduler,
                                  num_frames=num_frames, fps=fps)
    mp4_key, poster_key, preview_key = video_keys(batch_id, job_id, request.output_format)
    fields = {"job-id": job_id, "batch-id": batch_id, "seed": str(request.seed), "model": model,
              "steps": str(request.num_inference_steps), "size": f"{request.width}x{request.height}",
              "frames": str(num_frames), "fps": str(fps)}
    metadata = object_metadata(fields, parameters)
    with tempfile.TemporaryDirectory(prefix="renderfarm-video-") as tmp:
        video = encode_mp4(frames, fps, Path(tmp) / "video.mp4", parameters=parameters, title=request.prompt)
        written = storage.put_file_once(mp4_key, video.path, MP4_CONTENT_TYPE, metadata, retry_s=retry_s)
    size = video.bytes if written else storage.size(mp4_key)
    poster, poster_type = encode_poster(image, request.output_format, parameters)
    storage.put_once(poster_key, poster, poster_type, metadata, retry_s=retry_s)
    storage.put_once(preview_key, encode_preview(frames, fps), WEBP_CONTENT_TYPE, metadata, retry_s=retry_s)
    result = JobResult(key=mp4_key, width=video.width, height=video.height, seed=request.seed or 0,
                       content_type=MP4_CONTENT_TYPE, bytes=size, denoising_steps=denoising_steps,
                       num_frames=num_frames, fps=fps, duration_s=video.duration_s,
                       poster=poster_key, preview=preview_key)
    return StoredImage(result, written)
