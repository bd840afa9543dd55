"""Write-once uploads that ride out a storage outage.

Data flow: worker (an encoded image) → **here** → S3. Two guarantees the runner relies on:

- **Written once.** The PUT is conditional (``If-None-Match: *``, supported by AWS S3 and
  SeaweedFS): when a job's object already exists (a duplicate delivery, or an earlier attempt
  that uploaded and then died before recording success), the server refuses the second write
  with 412 and the existing object stands. The image is a pure function of the request and its
  seed, so the existing object is the one this attempt would have written.
- **Outages are waited out.** Connection errors, timeouts and 5xx answers are retried with
  exponential backoff (0.5 s doubling, at most 2 s apart) for up to ``retry_s`` seconds in all,
  on top of botocore's own few retries, so S3 being down for tens of seconds delays a batch
  but fails no job.
"""

from __future__ import annotations

import logging
import time

from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

from infra.storage import Storage

log = logging.getLogger("renderfarm.worker")

_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500"}


def is_transient(exc: BaseException) -> bool:
    """Whether an S3 error may go away by itself: no connection, a timeout, or a 5xx answer."""
    if isinstance(exc, (BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or exc.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    return False


def _precondition_failed(exc: ClientError) -> bool:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 412 or error.get("Code") in ("PreconditionFailed", "412")


def put_once(storage: Storage, key: str, body: bytes, content_type: str, metadata: dict[str, str], *,
             retry_s: float = 60.0, sleep=time.sleep) -> bool:
    """Upload ``body`` to ``key`` unless an object is already there.

    Returns:
        True when this call wrote the object, False when it already existed.
    Raises:
        the last botocore error, when storage stayed unreachable for ``retry_s`` seconds or
        refused the write for a reason that is not transient (e.g. AccessDenied).
    """
    deadline = time.monotonic() + retry_s
    delay = 0.5
    while True:
        try:
            storage.client.put_object(Bucket=storage.bucket, Key=key, Body=body, ContentType=content_type,
                                      Metadata=metadata, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if _precondition_failed(exc):
                log.info("object %s already exists; kept the first write", key)
                return False
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            error = exc
        except Exception as exc:  # connection refused, reset, timeouts
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            error = exc
        log.warning("storage unavailable (%s: %s); retrying %s in %.1fs", type(error).__name__, error, key, delay)
        sleep(delay)
        delay = min(delay * 2, 2.0)


def object_size(storage: Storage, key: str) -> int:
    """The size in bytes of an existing object (for a result whose object was written before)."""
    return int(storage.client.head_object(Bucket=storage.bucket, Key=key)["ContentLength"])
