"""Write-once uploads from a file (:meth:`infra.storage.s3.Storage.put_file_once`) on the session's
real SeaweedFS S3: a small file in one conditional PUT, a large one in a multipart upload (its ETag
says how many parts); a second upload of the key returns False and the first object stands."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

from infra.settings import Settings
from infra.storage.s3 import MULTIPART_CHUNK_BYTES, MULTIPART_THRESHOLD_BYTES, Storage

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def storage(farm_env) -> Storage:
    return Storage(Settings())


def _random_file(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        for start in range(0, size, 2**20):
            f.write(os.urandom(min(2**20, size - start)))
    return path


@pytest.mark.parametrize("size", [200_000, MULTIPART_THRESHOLD_BYTES + 2 * MULTIPART_CHUNK_BYTES + 12_345])
def test_put_file_once_writes_once_and_keeps_the_first(storage, tmp_path, size):
    key = f"video-test/{uuid.uuid4().hex}.bin"
    first, second = _random_file(tmp_path / "a", size), _random_file(tmp_path / "b", size)
    assert storage.put_file_once(key, first, "video/mp4", {"job-id": "one"}, retry_s=5) is True
    assert storage.put_file_once(key, second, "video/mp4", {"job-id": "two"}, retry_s=5) is False
    head = storage.client.head_object(Bucket=storage.bucket, Key=key)
    assert head["ContentLength"] == size and head["ContentType"] == "video/mp4" and head["Metadata"]["job-id"] == "one"
    assert hashlib.sha256(storage.get(key)).digest() == hashlib.sha256(first.read_bytes()).digest()
    parts = -(-size // MULTIPART_CHUNK_BYTES)
    # S3's ETag of a multipart object is "<md5 of the parts' md5s>-<parts>"; a single PUT's has no suffix
    assert head["ETag"].strip('"').endswith(f"-{parts}") == (size > MULTIPART_THRESHOLD_BYTES), head["ETag"]


