"""Compile-cache artifacts in the farm's own bucket: ``compile-cache/<key>.bin``.

Data flow: a worker's start-up (``pipeline.ready``: restore before the warm-up, save after a
warm-up that compiled) → **here** → S3; ``renderfarm cache ls|rm`` (``worker.cache_cli``) lists
and prunes them. The blobs are opaque bytes here (their format and checks are
``pipeline.compile_cache``'s); a few key fields ride along as S3 user metadata so that a
listing can say what each artifact is for without downloading it.

Writes overwrite: the artifact under a key is a pure function of the key (same model, recipe,
device, versions and shapes), so two workers that race write equivalent blobs, and a corrupt
artifact is replaced by the next worker that had to compile (write-once would keep it forever).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from botocore.exceptions import ClientError

from infra.storage.s3 import Storage, decode_metadata, encode_metadata

PREFIX = "compile-cache/"
SUFFIX = ".bin"
CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class CachedArtifact:
    """One stored artifact: its key (without prefix and suffix), size in bytes, last-modified time
    (timezone-aware UTC) and the metadata saved with it (``model``, ``device``, ``versions``,
    ``recipe``, ``buckets``, ``sizes``; empty strings where missing)."""

    key: str
    bytes: int
    modified: datetime
    meta: dict


def object_name(key: str) -> str:
    """The S3 key of the artifact ``key``: ``compile-cache/<key>.bin``.

    Raises:
        ValueError: ``key`` is empty or holds a ``/``.
    """
    if not key or "/" in key:
        raise ValueError(f"invalid compile-cache key {key!r}")
    return f"{PREFIX}{key}{SUFFIX}"


def metadata_of(fields: dict) -> dict[str, str]:
    """S3 user metadata summarising a key's fields (``pipeline.compile_cache.CacheKey.fields``):
    model, revision, device, versions, recipe name, buckets and sizes, each ASCII and short."""
    device = fields.get("device") or {}
    capability = device.get("compute_capability")
    versions = fields.get("versions") or {}
    summary = {
        "model": str(fields.get("model", "")),
        "revision": str(fields.get("revision", "")),
        "device": " ".join(str(device.get(k)) for k in ("kind", "name") if device.get(k))
                  + (f" sm{''.join(map(str, capability))}" if capability else ""),
        "versions": " ".join(f"{k}={v}" for k, v in versions.items()),
        "recipe": str((fields.get("recipe") or {}).get("name", "")),
        "buckets": ",".join(map(str, fields.get("buckets") or ())),
        "sizes": ",".join(f"{w}x{h}" for w, h in fields.get("sizes") or ()),
    }
    return {k: encode_metadata(v[:200]) for k, v in summary.items()}


class CompileCacheStore:
    """Get, put, list and delete compile-cache artifacts in the farm's bucket (``storage.bucket``).

    Errors of S3 (unreachable, access denied) are raised as botocore exceptions: a worker turns
    them into the outcome ``error`` and compiles; the CLI reports them.
    """

    def __init__(self, storage: Storage):
        self.storage = storage

    def get(self, key: str) -> bytes | None:
        """The artifact's bytes, or None when none is stored under ``key``."""
        try:
            return self.storage.get(object_name(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def put(self, key: str, blob: bytes, fields: dict | None = None) -> None:
        """Store ``blob`` under ``key``, replacing any artifact there (see the module docstring)."""
        self.storage.put(object_name(key), blob, CONTENT_TYPE, metadata_of(fields or {}))

    def list(self) -> list[CachedArtifact]:
        """Every artifact, oldest first, with its size, date and metadata (one HEAD each)."""
        out = []
        paginator = self.storage.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.storage.bucket, Prefix=PREFIX):
            for obj in page.get("Contents", []):
                name = obj["Key"]
                if not name.endswith(SUFFIX):
                    continue
                try:
                    head = self.storage.client.head_object(Bucket=self.storage.bucket, Key=name)
                    meta = {k: decode_metadata(v) for k, v in head.get("Metadata", {}).items()}
                except ClientError:  # deleted between the listing and the HEAD
                    continue
                out.append(CachedArtifact(name[len(PREFIX):-len(SUFFIX)], int(obj["Size"]), obj["LastModified"], meta))
        return sorted(out, key=lambda a: a.modified)

    def delete(self, key: str) -> None:
        """Remove the artifact ``key`` (no error when it does not exist)."""
        self.storage.delete(object_name(key))


def describe(artifact: CachedArtifact) -> str:
    """One artifact as a JSON line (key, bytes, modified as ISO 8601 UTC, metadata)."""
    return json.dumps({"key": artifact.key, "bytes": artifact.bytes,
                       "modified": artifact.modified.isoformat(timespec="seconds"), **artifact.meta})


__all__ = ["CONTENT_TYPE", "PREFIX", "CachedArtifact", "CompileCacheStore", "describe", "metadata_of", "object_name"]
