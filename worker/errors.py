"""Whose fault is an error: the request's, a passing outage's, or this worker's infrastructure's.

Place in the data flow: the worker's render and post stages (:mod:`worker.render_stage`,
:mod:`worker.post_stage`, through :mod:`worker.attempts`) ask here what to do with an exception
raised while a job was rendered, encoded, uploaded or recorded:

- **request** (a bad prompt, a poison input, a job that alone still times out): the job fails
  for good, as before; its batch mates are unharmed (bisection).
- **transient** (storage or Redis briefly unreachable, S3 5xx, out of memory): the attempt
  fails and the job goes back to the queue until its attempts are spent. Redis unreachable is
  not this worker's fault to isolate: Redis is also the broker, so a worker that cannot reach
  it takes no work anyway; its job-state writes retry for ``redis_retry_s``, and should it stay
  away, the leases expire and the reaper requeues the jobs (a lost worker, see
  :mod:`infra.state.scripts`).
- **infrastructure** — this worker cannot do any job right, whatever the request:

  * *credentials* (S3 403 ``InvalidAccessKeyId`` / ``SignatureDoesNotMatch`` /
    ``RequestTimeTooSkewed`` / ``AccessDenied`` …, boto3's missing or partial credentials):
    the job is released to ``queued`` **without spending an attempt** (the request never
    reached anything that could be its fault, so another worker retrying it is safe);
  * *device* (``CUDA error: …``, a lost device, a broken CUDA context, ``cudaErrorLaunchFailure``…):
    the attempt is spent and the job requeued (a request may itself break a device, so its
    retries stay bounded by ``max_attempts``).

  Either way the worker's circuit breaker opens at once (:mod:`worker.breaker`): it stops
  taking work, so the pool's healthy workers take the jobs.

Sources: the S3 error codes are AWS's "Error responses" list (Amazon S3 API reference); the
CUDA messages are those ``torch`` raises from ``c10/cuda/CUDAException.h`` (``CUDA error: …``)
and the CUDA runtime's ``cudaError_t`` names.
"""

from __future__ import annotations

import re

import redis
from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

from infra.storage.s3 import is_transient
from pipeline.memory import is_oom_error

#: S3 error codes that say this worker's credentials or clock are wrong, never the request.
S3_AUTH_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken",
    "InvalidSecurity", "RequestTimeTooSkewed", "SignatureDoesNotMatch", "TokenRefreshRequired", "403", "401",
})
_DEVICE_PATTERNS = re.compile(
    r"CUDA error|CUDA driver|cudaError|CUBLAS_STATUS_(?:NOT_INITIALIZED|EXECUTION_FAILED|INTERNAL_ERROR)|"
    r"CUDNN_STATUS_(?:NOT_INITIALIZED|EXECUTION_FAILED|INTERNAL_ERROR)|device-side assert|"
    r"device (?:is )?lost|no CUDA-capable device|NVML|illegal memory access|"
    r"unspecified launch failure|ECC error", re.IGNORECASE)

REQUEST, TRANSIENT, CREDENTIALS, DEVICE = "request", "transient", "credentials", "device"


def classify(exc: BaseException) -> str:
    """Whose fault ``exc`` is: :data:`CREDENTIALS` or :data:`DEVICE` (this worker's
    infrastructure), :data:`TRANSIENT` (a passing outage, out of memory), or :data:`REQUEST`.

    Out-of-memory errors are transient, not device faults, although torch words them ``CUDA
    out of memory``: the render stage splits the group (``pipeline.memory.render_in_parts``)."""
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, PermissionDeniedError, UnauthenticatedError)):
        return CREDENTIALS  # obstore's two: a 403 or 401 answer to the job's PUT
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if error.get("Code") in S3_AUTH_CODES or status in (401, 403):
            return CREDENTIALS
    if is_oom_error(exc):
        return TRANSIENT
    if isinstance(exc, RuntimeError) and _DEVICE_PATTERNS.search(str(exc)):
        return DEVICE
    if is_transient(exc) or isinstance(exc, redis.ConnectionError):
        return TRANSIENT
    return REQUEST


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` says this worker cannot do any job right (credentials, device): its
    breaker opens at once."""
    return classify(exc) in (CREDENTIALS, DEVICE)


def is_retryable(exc: BaseException) -> bool:
    """Whether a job's error is not the request's (transient, or this worker's infrastructure):
    such an error spends at most an attempt, never the job."""
    return classify(exc) != REQUEST


def credentials_problem(storage) -> str:
    """Check this worker's S3 credentials against its bucket (one HEAD request): a description
    of the credential error (see :func:`classify`), or "" when they work — or when the storage
    is merely unreachable, which uploads ride out by retrying. ``storage`` is an
    :class:`infra.storage.s3.Storage`."""
    try:
        storage.client.head_bucket(Bucket=storage.bucket)
    except Exception as exc:
        if classify(exc) == CREDENTIALS:
            return f"S3 credentials refused for bucket {storage.bucket!r}: {type(exc).__name__}: {exc}"[:500]
    return ""
