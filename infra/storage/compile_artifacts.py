"""The compile-cache artifact store, in the farm's own bucket: ``compile-cache/<key>.bin``
(Inductor's) and ``compile-cache/<key>.ir/<file>`` (converted OpenVINO UNets and VAE decoders:
``model.xml``, ``model.bin``, ``manifest.json``).

Data flow: a worker's start-up (``pipeline.ready``: restore before the warm-up, save after a
warm-up that compiled; ``pipeline.optimize.openvino_ir``: fetch a converted model at load,
store it after converting) → **here** → S3; ``renderfarm cache ls|rm`` (``worker.cache_cli``)
lists and prunes them. The blobs are opaque bytes here (their format and checks are those two
modules'); the IR files, gigabytes for SD 1.5, stream through boto3's managed transfer
(multipart, never whole in memory). A few key fields ride along as S3 user metadata so that a
listing can say what each artifact is for without downloading it.

Writes overwrite: the artifact under a key is a pure function of the key (same model, recipe,
device, versions and shapes), so two workers that race write equivalent blobs, and a corrupt
artifact is replaced by the next worker that had to compile (write-once would keep it forever).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from botocore.exceptions import ClientError

from infra.storage.s3 import Storage, decode_metadata, encode_metadata

PREFIX = "compile-cache/"
SUFFIX = ".bin"
IR_SUFFIX = ".ir/"
IR_MANIFEST = "manifest.json"  # uploaded last; its metadata describes the entry
CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class CachedArtifact:
    """One stored artifact: its key (without prefix and suffix), size in bytes (all its files),
    last-modified time (timezone-aware UTC), the metadata saved with it (``model``, ``device``,
    ``versions``, ``recipe``, ``buckets``, ``sizes``; empty strings where missing) and its
    ``kind``: ``inductor``, ``sizing`` or ``startup`` (one blob, :func:`kind_of`) or ``openvino-ir``
    (a converted UNet's or VAE decoder's files; ``meta["component"]`` says which)."""

    key: str
    bytes: int
    modified: datetime
    meta: dict
    kind: str = field(default="inductor")


def object_name(key: str) -> str:
    """The S3 key of the artifact ``key``: ``compile-cache/<key>.bin``.

    Raises:
        ValueError: ``key`` is empty or holds a ``/``.
    """
    if not key or "/" in key:
        raise ValueError(f"invalid compile-cache key {key!r}")
    return f"{PREFIX}{key}{SUFFIX}"


def ir_prefix(key: str) -> str:
    """The S3 prefix of the converted OpenVINO model ``key``: ``compile-cache/<key>.ir/``.

    Raises:
        ValueError: ``key`` is empty or holds a ``/``.
    """
    return object_name(key)[:-len(SUFFIX)] + IR_SUFFIX


def kind_of(key: str) -> str:
    """The kind of the one-blob artifact ``key``: ``sizing`` (``<key>.sizing``: a batch sizing
    record, ``pipeline.sizing``), ``startup`` (``startup-<pool>-<model>``: a pool's last start-up
    times) or ``inductor`` (compiled graphs and kernels)."""
    if key.endswith(".sizing"):
        return "sizing"
    return "startup" if key.startswith("startup-") else "inductor"


def metadata_of(fields: dict) -> dict[str, str]:
    """S3 user metadata summarising a key's fields (``pipeline.compile_cache.CacheKey.fields``):
    model, revision, device, versions, recipe name, buckets, sizes and (for a converted OpenVINO
    model) the component, each ASCII and short."""
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
        "component": str(fields.get("component", "")),  # a converted model's: unet, vae.decoder
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

    def fetch_files(self, key: str, dest: Path) -> bool:
        """Download every file of the converted model ``key`` into the directory ``dest``; False
        when none is stored (``pipeline.optimize.openvino_ir.IRStore``)."""
        prefix, found = ir_prefix(key), False
        paginator = self.storage.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.storage.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix):]
                if name and "/" not in name:
                    self.storage.client.download_file(self.storage.bucket, obj["Key"], str(Path(dest) / name))
                    found = True
        return found

    def store_files(self, key: str, src: Path, fields: dict) -> None:
        """Upload every file of the directory ``src`` under ``key``, the manifest last (an entry
        whose upload was cut short has none, and reads as incomplete)."""
        prefix, meta = ir_prefix(key), metadata_of(fields)
        for path in sorted(Path(src).iterdir(), key=lambda p: p.name == IR_MANIFEST):
            self.storage.client.upload_file(str(path), self.storage.bucket, prefix + path.name,
                                            ExtraArgs={"ContentType": CONTENT_TYPE, "Metadata": meta})

    def list(self) -> list[CachedArtifact]:
        """Every artifact, oldest first, with its size, date and metadata (one HEAD each)."""
        out: list[CachedArtifact] = []
        ir_files: dict[str, list[dict]] = {}
        paginator = self.storage.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.storage.bucket, Prefix=PREFIX):
            for obj in page.get("Contents", []):
                name = obj["Key"]
                stem, ir, file = name[len(PREFIX):].partition(IR_SUFFIX)
                if ir and file and "/" not in stem:
                    ir_files.setdefault(stem, []).append(obj)
                elif name.endswith(SUFFIX) and (meta := self._meta(name)) is not None:
                    key = name[len(PREFIX):-len(SUFFIX)]
                    out.append(CachedArtifact(key, int(obj["Size"]), obj["LastModified"], meta, kind_of(key)))
        for key, objects in ir_files.items():
            manifest = next((o for o in objects if o["Key"].endswith("/" + IR_MANIFEST)), None)
            meta = self._meta(manifest["Key"]) if manifest is not None else {"state": "incomplete"}
            out.append(CachedArtifact(key, sum(int(o["Size"]) for o in objects),
                                      max(o["LastModified"] for o in objects), meta or {}, "openvino-ir"))
        return sorted(out, key=lambda a: a.modified)

    def _meta(self, name: str) -> dict | None:
        try:
            head = self.storage.client.head_object(Bucket=self.storage.bucket, Key=name)
        except ClientError:  # deleted between the listing and the HEAD
            return None
        return {k: decode_metadata(v) for k, v in head.get("Metadata", {}).items()}

    def delete(self, key: str) -> None:
        """Remove the artifact ``key``, whichever its kind (no error when it does not exist)."""
        self.storage.delete(object_name(key))
        paginator = self.storage.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.storage.bucket, Prefix=ir_prefix(key)):
            for obj in page.get("Contents", []):
                self.storage.delete(obj["Key"])


def describe(artifact: CachedArtifact) -> str:
    """One artifact as a JSON line (key, bytes, modified as ISO 8601 UTC, metadata)."""
    return json.dumps({"key": artifact.key, "kind": artifact.kind, "bytes": artifact.bytes,
                       "modified": artifact.modified.isoformat(timespec="seconds"), **artifact.meta})


__all__ = ["CONTENT_TYPE", "PREFIX", "CachedArtifact", "CompileCacheStore", "describe", "metadata_of", "object_name"]
