"""``RenderClient``: the Python producer. Submits render jobs and follows them to their images.

Data flow: **client** → HTTP status API → (job-state store + pool queues) … workers … →
client polls status, then downloads images through presigned URLs (no S3 credentials needed).

Every call rides out a busy or restarting API (:class:`RetryPolicy`, with ``tenacity``): a 429
is retried after its ``Retry-After``; a request that never reached the API (connection refused
or timed out while connecting) is retried with exponential backoff; a 5xx answer or a
connection lost mid-request is retried only for requests that are safe to repeat (reads,
cancels, and batch submissions, which always carry an idempotency key, so a retry returns the
batch the first attempt created instead of a second one).
"""

from __future__ import annotations

import io
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt
from tqdm import tqdm

from infra.schemas import (
    TERMINAL_STATES,
    BatchAccepted,
    BatchStatus,
    BatchSubmission,
    JobAccepted,
    JobStatus,
    RenderRequest,
)
from infra.settings import get_settings
from producer.local_inputs import upload_local_inputs


class NotFoundError(LookupError):
    """The farm does not know this job or batch id."""


class RenderFarmError(RuntimeError):
    """The API refused a request; ``status_code`` and ``detail`` say why."""

    def __init__(self, status_code: int, detail, retry_after: float | None = None):
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code, self.detail = status_code, detail
        #: seconds to wait before trying again (a 429's ``Retry-After``), else None
        self.retry_after = retry_after


#: Answers worth another try of a request that is safe to repeat.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How a :class:`RenderClient` call rides out a busy or restarting API.

    ``attempts`` tries in all; between them, a 429's ``Retry-After`` (seconds) or else
    ``backoff_s × 2^(try − 1)``, never more than ``max_backoff_s``. ``attempts=1`` turns retries
    off. With the defaults a call gives up after about 2.5 minutes of an unreachable API.
    """

    attempts: int = 8
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def should_retry(self, exc: BaseException, idempotent: bool) -> bool:
        """Whether ``exc`` from one attempt is worth another: always a 429 or a request that never
        left (connect errors); 5xx answers and lost connections only when ``idempotent``."""
        if isinstance(exc, RenderFarmError):
            return exc.status_code == 429 or (idempotent and exc.status_code in RETRY_STATUSES)
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True
        return idempotent and isinstance(exc, httpx.TransportError)

    def wait_s(self, state: RetryCallState) -> float:
        """Seconds before the next attempt (a tenacity ``wait``)."""
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            return min(self.max_backoff_s, max(0.0, float(retry_after)))
        return min(self.max_backoff_s, self.backoff_s * 2 ** (state.attempt_number - 1))


class RenderClient:
    """A client of the renderfarm API.

    Args:
        api_url: base URL; default ``RENDERFARM_API_URL``.
        api_key: sent as ``X-API-Key``; default ``RENDERFARM_API_KEY``.
        timeout_s: per-request HTTP timeout, seconds.
        retry: how calls ride out 429s, 5xx answers and restarts (:class:`RetryPolicy`).
        sleep: how to wait between attempts (tests pass a recorder).
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, timeout_s: float = 60.0,
                 retry: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep):
        settings = get_settings()
        headers = {"X-API-Key": api_key or settings.api_key} if (api_key or settings.api_key) else {}
        self.http = httpx.Client(base_url=(api_url or settings.api_url).rstrip("/"), headers=headers,
                                 timeout=timeout_s)
        self.retry = retry or RetryPolicy()
        self._sleep = sleep

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RenderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, *, idempotent: bool | None = None, **kwargs: Any) -> Any:
        """One API call under the retry policy; ``idempotent`` defaults to True for GET and DELETE.

        Raises:
            NotFoundError: 404. RenderFarmError: another 4xx/5xx, once retries are spent.
            httpx.TransportError: the API stayed unreachable.
        """
        safe = method in ("GET", "DELETE") if idempotent is None else idempotent
        retrying = Retrying(stop=stop_after_attempt(max(1, self.retry.attempts)), wait=self.retry.wait_s,
                            retry=retry_if_exception(lambda exc: self.retry.should_retry(exc, safe)),
                            sleep=self._sleep, reraise=True)
        return retrying(self._send, method, path, **kwargs)

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code == 404:
            raise NotFoundError(response.json().get("detail", path))
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            try:
                retry_after = float(response.headers["Retry-After"])
            except (KeyError, ValueError):
                retry_after = None
            raise RenderFarmError(response.status_code, detail, retry_after)
        return response.json()

    # ---- submission -----------------------------------------------------------------------
    def submit(self, request: RenderRequest | dict) -> JobAccepted:
        """Submit one render. Raises ``pydantic.ValidationError`` before sending anything invalid."""
        request = RenderRequest.model_validate(upload_local_inputs([request], self.upload)[0])
        return JobAccepted.model_validate(self._call("POST", "/v1/jobs", content=request.model_dump_json(),
                                                     headers={"Content-Type": "application/json"}))

    def submit_video(self, prompt: str, *, num_frames: int | None = None, fps: int | None = None,
                     init_image: str | Path | None = None, **fields: Any) -> JobAccepted:
        """Submit one video (``kind: video``): ``num_frames`` frames played at ``fps`` frames per
        second (None: the video family's defaults, e.g. Wan 81 at 16 fps, LTX-Video 121 at 25;
        the family's rule applies: Wan 4k+1 frames, LTX-Video 8k+1), from text, or from
        ``init_image`` as the first frame (image-to-video: a bucket key, an https URL or a local
        file, uploaded first). ``fields`` are other :class:`~infra.schemas.RenderRequest` fields
        (``model``, ``width``, ``height``, ``seed``, …). The result is an MP4 (``result.key``
        ``{batch}/{job}.mp4``) with a poster frame and an animated WebP preview.

        Raises:
            pydantic.ValidationError: a field the schema refuses (e.g. ``mask_image`` on a
                video); nothing is sent.
            RenderFarmError: the API refused it (422 naming the field: a frame count off the
                family's rule or over the pool's ``max_frames``, a family without image-to-video).
        """
        request: dict[str, Any] = {"prompt": prompt, **fields, "kind": "video"}
        for name, value in (("num_frames", num_frames), ("fps", fps), ("init_image", init_image)):
            if value is not None:
                request[name] = value
        return self.submit(request)

    def upload(self, path: str | Path) -> str:
        """Upload one input image (``POST /v1/uploads``); returns its content-addressed key
        (``inputs/<sha256>.<ext>``) for ``init_image`` / ``mask_image`` / ``controls[].image``.

        Raises:
            OSError: the file cannot be read. RenderFarmError: 413 over the byte limit, 415 an
                unsupported format, 422 not an image or too many pixels.
        """
        data = Path(path).read_bytes()
        return self._call("POST", "/v1/uploads", idempotent=True, files={"file": (Path(path).name, data)})["key"]

    def submit_batch(self, requests: Sequence[RenderRequest | dict], *, priority: str = "normal",
                     idempotency_key: str | None = None, webhook_url: str | None = None) -> BatchAccepted:
        """Submit up to 10,000 renders as one batch, in one HTTP request. A dict request whose
        ``init_image``, ``mask_image`` or control unit ``image`` is a local file (a Path, or a path
        that exists) has it uploaded first (:meth:`upload`, once per file) and replaced by its key.

        Without an ``idempotency_key`` the client makes one, so that a retry after a lost answer
        returns the batch the first attempt created.

        Raises:
            pydantic.ValidationError: naming the job index, field and rule; nothing is sent.
            RenderFarmError: the API refused the batch.
        """
        requests = upload_local_inputs(requests, self.upload)
        body = BatchSubmission(jobs=list(requests), priority=priority,
                               idempotency_key=idempotency_key or f"client-{uuid.uuid4().hex}", webhook_url=webhook_url)
        return BatchAccepted.model_validate(self._call(
            "POST", "/v1/batches", idempotent=True, content=body.model_dump_json(exclude_none=True),
            headers={"Content-Type": "application/json"}))

    def catalog_lookup(self, keys: Sequence[str]) -> dict[str, dict | None]:
        """Per catalog key (up to 10,000), this tenant's job for it as a dict (``job_id``,
        ``batch_id``, ``state``, ``result_key``, ``error``), or None when no image exists and no
        job renders it. See ``POST /v1/catalog/lookup``."""
        return self._call("POST", "/v1/catalog/lookup", idempotent=True, json={"keys": list(keys)})["entries"]

    # ---- status ---------------------------------------------------------------------------
    def job(self, job_id: str) -> JobStatus:
        """One job's status. Raises :class:`NotFoundError` for an unknown id."""
        return JobStatus.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def batch(self, batch_id: str, offset: int = 0, limit: int = 100) -> BatchStatus:
        """A batch's counts and one page of its jobs. Raises :class:`NotFoundError` for an unknown id."""
        return BatchStatus.model_validate(self._call("GET", f"/v1/batches/{batch_id}",
                                                     params={"offset": offset, "limit": limit}))

    def status(self, id_: str) -> JobStatus | BatchStatus:
        """The status of a job or of a batch, whichever ``id_`` names."""
        try:
            return self.job(id_)
        except NotFoundError:
            return self.batch(id_)

    def batch_jobs(self, batch_id: str, page: int = 1000) -> list[JobStatus]:
        """All jobs of a batch, in submission order."""
        jobs: list[JobStatus] = []
        offset: int | None = 0
        while offset is not None:
            status = self.batch(batch_id, offset=offset, limit=page)
            jobs.extend(status.jobs)
            offset = status.next_offset
        return jobs

    def wait(self, batch_id: str, timeout: float | None = None, *, poll_interval_s: float = 0.5,
             progress: bool | None = None) -> list[JobStatus]:
        """Block until every job of the batch has ended; return them in submission order.

        Args:
            timeout: seconds; None waits for ever.
            progress: show a tqdm bar; default when stderr is a terminal.
        Raises:
            TimeoutError: the batch had not ended after ``timeout`` seconds.
            NotFoundError: unknown batch id.
        """
        show = sys.stderr.isatty() if progress is None else progress
        deadline = None if timeout is None else time.monotonic() + timeout
        status = self.batch(batch_id, limit=0)
        with tqdm(total=status.total, unit="img", desc=f"batch {batch_id[:8]}", disable=not show,
                  file=sys.stderr) as bar:
            while True:
                ended = sum(status.counts[s] for s in TERMINAL_STATES)
                bar.n = ended
                bar.set_postfix({s: status.counts[s] for s in ("running", "succeeded", "failed") if status.counts[s]})
                bar.refresh()
                if status.done:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {batch_id} not done after {timeout} s: {status.counts}")
                time.sleep(poll_interval_s)
                status = self.batch(batch_id, limit=0)
        return self.batch_jobs(batch_id)

    def cancel(self, id_: str) -> dict:
        """Cancel a job, or every unfinished job of a batch."""
        try:
            return self._call("DELETE", f"/v1/jobs/{id_}")
        except NotFoundError:
            return self._call("DELETE", f"/v1/batches/{id_}")

    # ---- images ---------------------------------------------------------------------------
    def fetch_bytes(self, job: str | JobStatus) -> bytes:
        """The encoded image of a succeeded job, through its presigned URL.

        Raises:
            RuntimeError: the job has not succeeded.
        """
        status = self.job(job) if isinstance(job, str) else job
        if status.state != "succeeded" or status.result is None or status.result.url is None:
            raise RuntimeError(f"job {status.job_id} has no image: state {status.state}"
                               + (f", {status.error.type}: {status.error.message}" if status.error else ""))
        response = httpx.get(status.result.url, timeout=60)
        response.raise_for_status()
        return response.content

    def fetch_image(self, job: str | JobStatus) -> Image.Image:
        """The image of a succeeded job as a loaded ``PIL.Image``."""
        image = Image.open(io.BytesIO(self.fetch_bytes(job)))
        image.load()
        return image

    def download(self, job: str | JobStatus, dest_dir: str | Path, *, poster: bool = False) -> Path:
        """Save a succeeded job's file into ``dest_dir`` under its object key's name (an image's
        ``<job id>.png|webp|jpg``, a video's ``<job id>.mp4``); returns its path. With ``poster``,
        a video's poster frame is saved beside it too (``<job id>.poster.<ext>``, the key's name).

        Raises:
            RuntimeError: the job has not succeeded. httpx.HTTPError: a file could not be fetched.
        """
        status = self.job(job) if isinstance(job, str) else job
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / Path(status.result.key).name if status.result else dest / status.job_id
        path.write_bytes(self.fetch_bytes(status))
        result = status.result
        if poster and result is not None and result.poster is not None and result.poster_url is not None:
            response = httpx.get(result.poster_url, timeout=60)
            response.raise_for_status()
            (dest / Path(result.poster).name).write_bytes(response.content)
        return path

    def download_all(self, jobs: Iterable[JobStatus], dest_dir: str | Path) -> list[Path]:
        """Save every succeeded job's image; returns the paths."""
        return [self.download(j, dest_dir) for j in jobs if j.state == "succeeded"]
