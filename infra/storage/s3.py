"""S3-compatible object storage for rendered images (obstore on the per-job path, boto3 beside it).

Data flow: worker → **storage** (one object per job, key ``{batch_id}/{job_id}.{ext}``) → the
status API hands out presigned GET URLs for those keys.

The calls made once per job, the worker's PUT and the API's presigned GET URL and HEAD, go
through ``obstore`` (Python bindings of the Rust ``object_store`` crate); the rest (bucket
creation, health checks, deletes, reads, listings) through boto3. ``renderfarm bench s3``
measured obstore at 0.20–0.36 of boto3's client CPU per PUT and 0.11–0.20 per HEAD, on
the same SeaweedFS (docs/benchmarks/README.md, "S3 client"). Both clients sign with the same
credentials, which come from boto3's standard chain (:class:`Boto3Credentials`).

A job's image is written once (:meth:`Storage.put_once`), with two guarantees the worker
relies on:

- **Written once.** The PUT is conditional (``If-None-Match: *``: obstore's ``mode="create"``,
  supported by AWS S3 and SeaweedFS): when a job's object already exists (a duplicate delivery,
  or an earlier attempt that uploaded and then died before recording success), the server
  refuses the second write and the existing object stands. The image is a pure function of the
  request and its seed, so the existing object is the one this attempt would have written.
- **Outages are waited out.** Connection errors, timeouts and 5xx answers are retried by
  object_store (a few tries, exponential backoff with jitter), then by :meth:`Storage.put_once`
  itself with tenacity's exponential backoff with jitter (0.5 s doubling, at most 2 s apart)
  for up to ``retry_s`` seconds in all, so S3 being down for tens of seconds delays a batch but
  fails no job.

A video's MP4 is uploaded from its file (:meth:`Storage.put_file_once`), in memory that does not
grow with the file: one conditional PUT up to :data:`MULTIPART_THRESHOLD_BYTES`, an S3 multipart
upload after a HEAD above it (write-once then has a race, described there).

Object metadata carries the generation parameters; S3 user metadata
is ASCII and (on AWS) at most 2 KB. A value of printable ASCII is stored as it is; any other
(a Chinese prompt, the infotext's line breaks) as RFC 2047 MIME encoded-words
(``=?UTF-8?B?…?=``), which is how AWS documents non-ASCII user-defined metadata ("Working with
object metadata", Amazon S3 User Guide); :func:`decode_metadata` reads both back. The infotext is
cut to fit, at encoded-word boundaries, with ``parameters-truncated: true`` said when it was.
"""

from __future__ import annotations

import logging
import re
import time
from base64 import b64encode
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from email.header import decode_header
from pathlib import Path
from typing import Any

import boto3
import obstore
from botocore.client import Config
from botocore.exceptions import ClientError, HTTPClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError
from obstore.exceptions import AlreadyExistsError, GenericError
from obstore.store import S3Store
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from infra.settings import Settings

log = logging.getLogger("renderfarm.storage")

_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500"}

_METADATA_BUDGET = 1800  # bytes of user metadata we allow ourselves under AWS's 2 KB cap


def object_key(batch_id: str, job_id: str, output_format: str) -> str:
    """The S3 key of a job's image: ``{batch_id}/{job_id}.{ext}`` (``jpeg`` → ``jpg``)."""
    ext = "jpg" if output_format == "jpeg" else output_format
    return f"{batch_id}/{job_id}.{ext}"


_WORD_BYTES = 45  # UTF-8 bytes per encoded-word: 60 base64 characters, 72 with the delimiters (RFC 2047: ≤ 75)


def _plain(value: str) -> bool:
    return all(" " <= ch <= "~" for ch in value) and "=?" not in value


def encode_metadata_words(value: str) -> list[str]:
    """``value`` as RFC 2047 encoded-words (``=?UTF-8?B?…?=``, base64 of UTF-8), each of whole
    characters and at most 75 characters long; a printable-ASCII value is one word, itself."""
    if _plain(value):
        return [value]
    words: list[str] = []
    chunk: list[str] = []
    size = 0
    for ch in value:
        n = len(ch.encode("utf-8"))
        if chunk and size + n > _WORD_BYTES:
            words.append("".join(chunk))
            chunk, size = [], 0
        chunk.append(ch)
        size += n
    if chunk:
        words.append("".join(chunk))
    return [f"=?UTF-8?B?{b64encode(w.encode('utf-8')).decode('ascii')}?=" for w in words]


def encode_metadata(value: str) -> str:
    """One S3 user-metadata value, ASCII: ``value`` itself when it is printable ASCII, else its RFC
    2047 encoded-words separated by spaces (:func:`decode_metadata` reverses it)."""
    return " ".join(encode_metadata_words(value))


def decode_metadata(value: str) -> str:
    """The text of an S3 user-metadata value as :func:`encode_metadata` (or AWS, for non-ASCII
    metadata) wrote it: RFC 2047 encoded-words decoded, plain ASCII as it is."""
    if "=?" not in value:
        return value
    return "".join(part.decode(charset or "utf-8", "replace") if isinstance(part, bytes) else part
                   for part, charset in decode_header(value))


def object_metadata(fields: dict[str, str], parameters: str) -> dict[str, str]:
    """S3 user metadata: the given ``fields`` plus the infotext, each value ASCII
    (:func:`encode_metadata`), the infotext cut to fit the budget at encoded-word boundaries."""
    meta = {k: encode_metadata(str(v)) for k, v in fields.items()}
    budget = _METADATA_BUDGET - sum(len(k) + len(v) for k, v in meta.items()) - len("parameters")
    words = encode_metadata_words(parameters)
    encoded = " ".join(words)
    if len(encoded) > budget:
        budget -= len("parameters-truncated") + 4
        if len(words) == 1:  # plain ASCII: cut anywhere
            encoded = encoded[: max(0, budget)]
        else:
            kept, used = [], 0
            for word in words:
                if used + len(word) + 1 > budget:
                    break
                kept.append(word)
                used += len(word) + 1
            encoded = " ".join(kept)
        meta["parameters"] = encoded
        meta["parameters-truncated"] = "true"
    else:
        meta["parameters"] = encoded
    return meta


_CLIENT_ERROR = re.compile(r"status code: 4\d\d")


def is_transient(exc: BaseException) -> bool:
    """Whether an S3 error may go away by itself: no connection, a timeout, or a 5xx answer
    (botocore's errors, and obstore's ``GenericError`` unless it reports a 4xx status)."""
    if isinstance(exc, (BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, GenericError):
        return not _CLIENT_ERROR.search(str(exc))
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or exc.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    return False


class Boto3Credentials:
    """An obstore ``S3CredentialProvider`` that hands over what boto3's session resolved
    (environment, ``~/.aws``, instance or pod roles), so both clients sign alike.

    Refreshable credentials (roles) are given an expiry of :attr:`recheck_s` seconds, after which
    obstore asks again and botocore refreshes them when they are near their end.

    Raises (when called):
        botocore.exceptions.NoCredentialsError: the chain found no credentials.
    """

    recheck_s = 300

    def __init__(self, session: boto3.Session):
        self.session = session

    def __call__(self) -> dict:
        credentials = self.session.get_credentials()
        if credentials is None:
            raise NoCredentialsError()
        frozen = credentials.get_frozen_credentials()
        refreshable = getattr(credentials, "refresh_needed", None) is not None
        expires = datetime.now(timezone.utc) + timedelta(seconds=self.recheck_s) if refreshable else None
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}


#: Seconds :meth:`Storage.ping` waits to connect, and then to read (``/healthz``'s S3 check).
PROBE_TIMEOUT_S = 2.0

#: :meth:`Storage.put_file_once`: files up to this size (bytes) go up in one conditional PUT, read
#: into memory whole; larger ones in a multipart upload.
MULTIPART_THRESHOLD_BYTES = 16 * 2**20
#: Bytes per part of a multipart upload. S3 takes parts of 5 MiB to 5 GiB (the last may be
#: smaller) and at most 10,000 of them (Amazon S3 User Guide, "Amazon S3 multipart upload
#: limits"): 8 MiB parts carry objects up to 78 GiB.
MULTIPART_CHUNK_BYTES = 8 * 2**20
#: Parts uploaded at once; with :data:`MULTIPART_CHUNK_BYTES` it bounds the bytes buffered,
#: whatever the file's size: ``renderfarm bench upload`` measured a flat 24 MiB peak RSS increase
#: (three parts' worth) for 20, 50 and 200 MiB files (docs/benchmarks/README.md).
MULTIPART_CONCURRENCY = 2


def _retrying(key: str, retry_s: float, sleep: Callable[[float], None]) -> Retrying:
    """tenacity's policy for a write to ``key``: transient errors (:func:`is_transient`) retried
    with exponential backoff and jitter (0.5 s doubling, at most 2 s apart) for ``retry_s`` seconds."""
    return Retrying(retry=retry_if_exception(is_transient), stop=stop_after_delay(retry_s),
                    wait=wait_exponential(multiplier=0.5, max=2.0) + wait_random(0, 0.25), sleep=sleep,
                    before_sleep=lambda state: log.warning(
                        "storage unavailable (%s); retrying %s", state.outcome and state.outcome.exception(), key),
                    reraise=True)


class Storage:
    """The farm's bucket on an S3-compatible server.

    Args:
        settings: endpoint (empty = AWS), bucket, region and presign lifetime come from here;
            credentials from boto3's standard chain (``AWS_ACCESS_KEY_ID`` …), or from the client
            settings file when the environment has none (:meth:`infra.settings.Settings.s3_credentials`).
        max_attempts: botocore's retry attempts per call. connect_timeout_s: seconds.
        max_pool_connections: the one client's HTTP connection pool (botocore ``Config``), sized
            to the threads that upload at once so none waits for a connection (boto3 clients are
            thread-safe; botocore's default pool is 10).
    """

    def __init__(self, settings: Settings, *, max_attempts: int = 8, connect_timeout_s: float = 5.0,
                 max_pool_connections: int = 10):
        self.bucket = settings.s3_bucket
        self.presign_expires_s = settings.presign_expires_s
        config = Config(
            signature_version="s3v4", s3={"addressing_style": "path"},
            retries={"mode": "adaptive", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s, read_timeout=60, max_pool_connections=max_pool_connections,
        )
        endpoint = settings.s3_endpoint_url or None
        session = boto3.Session(**settings.s3_credentials())
        self._session = session
        self._client_args = {"service_name": "s3", "endpoint_url": endpoint, "region_name": settings.s3_region}
        self.client = session.client(**self._client_args, config=config)
        # ping()'s own client: the same settings, one attempt, short timeouts (made at the first ping);
        # botocore's max_attempts counts retries after the first attempt, total_max_attempts all of them
        self._probe_config = config.merge(Config(retries={"mode": "standard", "total_max_attempts": 1},
                                                 connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S))
        self._probe_client: Any = None
        options = {"connect_timeout": f"{connect_timeout_s}s", "timeout": "60s",
                   "pool_max_idle_per_host": str(max_pool_connections)}
        if endpoint and endpoint.startswith("http://"):
            options["allow_http"] = "true"
        self.store = S3Store(
            self.bucket, endpoint=endpoint, region=settings.s3_region, virtual_hosted_style_request=False,
            credential_provider=Boto3Credentials(session), client_options=options,  # type: ignore[arg-type]
            retry_config={"max_retries": max(0, max_attempts - 1), "retry_timeout": timedelta(seconds=10)})

    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist yet (idempotent)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def put(self, key: str, body: bytes, content_type: str, metadata: dict[str, str]) -> None:
        """Upload one object. Raises botocore errors once retries are exhausted."""
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType=content_type, Metadata=metadata)

    def put_once(self, key: str, body: bytes, content_type: str, metadata: dict[str, str], *,
                 retry_s: float = 60.0, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Upload ``body`` to ``key`` unless an object is already there (see the module docstring).

        Returns:
            True when this call wrote the object, False when it already existed.
        Raises:
            the last obstore error, when storage stayed unreachable for ``retry_s`` seconds or
            refused the write for a reason that is not transient (``PermissionDeniedError``, …),
            or botocore's ``NoCredentialsError``.
        """
        attributes = {"Content-Type": content_type, **metadata}
        try:
            for attempt in _retrying(key, retry_s, sleep):
                with attempt:
                    obstore.put(self.store, key, body, mode="create", attributes=attributes)
        except AlreadyExistsError:
            log.info("object %s already exists; kept the first write", key)
            return False
        return True

    def put_file_once(self, key: str, path: Path, content_type: str, metadata: dict[str, str], *,
                      retry_s: float = 60.0, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Upload the file at ``path`` to ``key`` unless an object is already there, in memory that
        does not grow with the file: a file of up to :data:`MULTIPART_THRESHOLD_BYTES` goes up in
        one conditional PUT, as :meth:`put_once` (read whole: at most that many bytes); a larger
        one in an S3 multipart upload of :data:`MULTIPART_CHUNK_BYTES` parts,
        :data:`MULTIPART_CONCURRENCY` in flight, read from the file as they go (obstore's ``put``
        of a ``Path`` with ``use_multipart``), after a HEAD found no object at ``key``.

        **Write-once, and its race.** obstore 0.12 performs a ``mode="create"`` put as a single
        PUT (its ``put`` documentation: a mode other than overwrite means a non-multipart upload,
        the whole input in memory), and S3's conditional ``CompleteMultipartUpload``
        (``If-None-Match: *``; AWS S3's conditional writes, and SeaweedFS 4.48 answers it with 412
        when the key exists, checked) is not exposed by obstore, nor promised by every
        S3-compatible server. So the multipart path checks with HEAD first and completes
        unconditionally: two writers of the same key that both pass the HEAD before either
        completes both upload, both return True, and the last to complete stands. The farm's
        leases let one attempt hold a job at a time, so this needs a takeover during the upload;
        the object is then the other attempt's encoding of the same request. An upload that
        fails after its parts started may leave an incomplete multipart upload behind (obstore's
        ``put`` documentation warns of it): a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
        removes the rest (Amazon S3 User Guide, "Configuring a bucket lifecycle configuration to
        delete incomplete multipart uploads").

        Args:
            path: the file (read, not changed). content_type, metadata: as :meth:`put_once`.
            retry_s: how long a storage outage is ridden out, seconds (each try starts over).
        Returns:
            True when this call wrote the object, False when it already existed (kept).
        Raises:
            OSError: the file cannot be read. Otherwise as :meth:`put_once`.
        """
        size = path.stat().st_size
        if size <= MULTIPART_THRESHOLD_BYTES:
            return self.put_once(key, path.read_bytes(), content_type, metadata, retry_s=retry_s, sleep=sleep)
        attributes = {"Content-Type": content_type, **metadata}
        for attempt in _retrying(key, retry_s, sleep):
            with attempt:
                if self.exists(key):
                    log.info("object %s already exists; kept the first write", key)
                    return False
                obstore.put(self.store, key, path, attributes=attributes, use_multipart=True,
                            chunk_size=MULTIPART_CHUNK_BYTES, max_concurrency=MULTIPART_CONCURRENCY)
        return True

    def size(self, key: str) -> int:
        """The size in bytes of an existing object."""
        return int(obstore.head(self.store, key)["size"])

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it does not exist)."""
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is in the bucket."""
        try:
            obstore.head(self.store, key)
            return True
        except FileNotFoundError:  # obstore's NotFoundError
            return False

    def get(self, key: str) -> bytes:
        """The object's bytes."""
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def presigned_url(self, key: str, expires_s: int | None = None) -> str:
        """A presigned GET URL for ``key``, valid ``expires_s`` seconds (default from settings)."""
        expires = timedelta(seconds=expires_s or self.presign_expires_s)
        return obstore.sign(self.store, "GET", key, expires)

    def ping(self) -> None:
        """Raise when the bucket cannot be reached now (used by ``/healthz``).

        One ``HeadBucket`` on a client of its own: no retries, :data:`PROBE_TIMEOUT_S` seconds to
        connect and as many to read, so a probe answers within about twice that and reports what
        it sees instead of retrying through an outage (the transfer client retries
        ``max_attempts`` times, with backoff, which could hide an S3 restart from every probe
        that ran during it).

        Raises:
            botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError: S3 did not answer,
                or refused the bucket.
        """
        if self._probe_client is None:
            self._probe_client = self._session.client(**self._client_args, config=self._probe_config)
        self._probe_client.head_bucket(Bucket=self.bucket)
