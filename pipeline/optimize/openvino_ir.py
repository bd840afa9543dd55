"""The converted OpenVINO UNet as a shared cache entry: its key, its files and their checks.

Place in the data flow: :func:`pipeline.optimize.openvino.to_openvino` → **here** → the caller's
store (:class:`IRStore`: the worker's is the farm's bucket, ``infra.storage.compile_artifacts``; the
time-to-ready bench's and the tests' is a directory, :class:`DirectoryIRStore`). Nothing here
touches S3.

Why: on the CPU, converting the SD UNet (``openvino.convert_model`` traces the PyTorch module)
is most of a worker's load. Measured on a 2-vCPU AVX2 EPYC with sd15-arch: a 24.7 s trace, then
4.4 s of ``compile_model``, in a 45.8 s load, and every new replica paid it again (the Inductor
compile cache does not cover OpenVINO). The converted model is saved once as OpenVINO IR
(``model.xml`` + ``model.bin``, OpenVINO's "Model Preparation" guide), with its float32 weights
kept as they are (``save_model(..., compress_to_fp16=False)``; the default would round them to
float16, an approximation). The next worker reads it (``Core.read_model``) instead of tracing.

The key is content-addressed: SHA-256 over the UNet's weights (every tensor's name, shape, dtype
and its bytes' own SHA-256), its class and config,
its attention processors (fused QKV changes the traced graph), the int8 weight compression, and
the openvino, torch, diffusers (and nncf) versions. Two workers with the same key trace the same
graph, so an entry cannot be stale; a fine-tuned or LoRA-fused UNet is another key. The files
ride with a manifest holding each file's digest (SHA-256 over the SHA-256s of its 64 MiB
segments), checked on every restore: a missing manifest
(an upload cut short) or a changed file is ``corrupt`` and the worker converts again, with one
log line saying which and why. A cold worker compiles from the IR it has just saved too, so a
worker that converted and one that restored run the same graph.

Hashing runs on a thread per usable core (:mod:`pipeline.optimize.weights_digest`): on an AVX-512
Xeon without the SHA extensions (family 6 model 85) one core spent about 9 s on SD 1.5's 3.4 GB
for the key and 9 s more checking the restored files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.compile_cache import CacheOutcome, package_version
from pipeline.optimize.weights_digest import hash_threads, update_with_weights

log = logging.getLogger("renderfarm.worker")

FORMAT = 2  # 2: segmented file digests, per-tensor weight digests
FILES = ("model.xml", "model.bin")
MANIFEST = "manifest.json"  # written last: an entry without it is incomplete
_CHUNK = 1 << 24
_SEGMENT = 1 << 26  # 64 MiB: the unit of a file digest, hashed in parallel


class IRStore(Protocol):
    """Where converted models are kept, by key (a directory of files per key)."""

    def fetch_files(self, key: str, dest: Path) -> bool:
        """Copy the files stored under ``key`` into the existing directory ``dest``; False when
        nothing is stored under it. Storage errors raise."""

    def store_files(self, key: str, src: Path, fields: dict) -> None:
        """Store every file of the directory ``src`` under ``key`` (the manifest last); ``fields``
        describe the entry (model, versions) for listings. Storage errors raise."""


class DirectoryIRStore:
    """An :class:`IRStore` over a local directory: ``<root>/<key>/<file>``. ``read`` / ``write``
    False make it write-only or read-only (the time-to-ready bench's cold and cached phases)."""

    def __init__(self, root: Path, *, read: bool = True, write: bool = True):
        self.root, self.read, self.write = Path(root), read, write

    def fetch_files(self, key: str, dest: Path) -> bool:
        src = self.root / key
        if not self.read or not src.is_dir():
            return False
        for path in src.iterdir():
            shutil.copyfile(path, dest / path.name)
        return True

    def store_files(self, key: str, src: Path, fields: dict) -> None:
        """Copy the entry into a scratch directory beside it, then rename it into place, so that
        processes sharing the directory never read an entry half written (one that replaces a
        corrupt entry moves the old one aside first; of two writers at once, either wins)."""
        if not self.write:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        try:
            for path in sorted(src.iterdir(), key=lambda p: p.name == MANIFEST):
                shutil.copyfile(path, staging / path.name)
            dest = self.root / key
            if dest.exists():
                aside = Path(tempfile.mkdtemp(prefix=f".{key}.old.", dir=self.root))
                with contextlib.suppress(FileNotFoundError):  # another writer moved it first
                    os.replace(dest, aside / key)
                shutil.rmtree(aside, ignore_errors=True)
            try:
                os.replace(staging, dest)
            except OSError:  # another writer's entry got in between: the same conversion, complete
                if not (dest / MANIFEST).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def local_ir_store() -> DirectoryIRStore | None:
    """The local :class:`DirectoryIRStore` of ``RENDERFARM_OPENVINO_IR_DIR``
    (``infra.settings.Settings.openvino_ir_dir``), or None when it is unset.

    For loads that are given no store (:func:`pipeline.optimize.openvino.converted`): the benches,
    a script's ``prepare_renderer``, the tests. A process that loads weights already converted
    there reads their IR (checked against its manifest, as from any store) instead of tracing
    the module again; workers are given the farm's bucket and share through it instead.
    """
    from infra.settings import get_settings

    root = get_settings().openvino_ir_dir
    return DirectoryIRStore(root) if root else None


def ir_key(unet: torch.nn.Module, int8_weights: bool = False) -> tuple[str, dict]:
    """The cache key of ``unet``'s conversion: ``openvino-<32 hex digits>``, and the fields it was
    hashed from (without the weights), for the manifest and listings.

    Cost: one pass over the weights, SHA-256 of each tensor on a thread per usable core.
    """
    processors = getattr(unet, "attn_processors", {}) or {}
    fields: dict[str, Any] = {
        "format": FORMAT, "kind": "openvino-ir", "class": type(unet).__name__,
        "config": {k: v for k, v in dict(getattr(unet, "config", {})).items() if not k.startswith("_")},
        "attention": sorted({type(p).__name__ for p in processors.values()}),
        "int8_weights": bool(int8_weights),
        "versions": {d: package_version(d)
                     for d in ("openvino", "torch", "diffusers", *(("nncf",) if int8_weights else ()))},
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    update_with_weights(digest, unet)
    return f"openvino-{digest.hexdigest()[:32]}", fields


def file_digest(path: Path) -> str:
    """The manifest's digest of the file at ``path``: SHA-256 over its size and the SHA-256s of
    its 64 MiB segments in order, the segments hashed on a thread per usable core. Any changed,
    added or removed byte changes it. Raises OSError when the file cannot be read."""
    size = path.stat().st_size

    def segment(offset: int) -> bytes:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            f.seek(offset)
            left = min(_SEGMENT, size - offset)
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
        return digest.digest()

    top = hashlib.sha256(f"{size}:{_SEGMENT}:".encode())
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        for part in pool.map(segment, range(0, size, _SEGMENT)):
            top.update(part)
    return top.hexdigest()


def check_files(directory: Path, key: str) -> str:
    """Why the entry in ``directory`` cannot be used ("" when it can): no manifest, another key,
    a missing file or a file whose digest (:func:`file_digest`) is not the manifest's."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (an incomplete upload)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        return f"unreadable manifest: {exc}"
    if manifest.get("key") != key:
        return f"the manifest is for {manifest.get('key')!r}"
    for name, expected in (manifest.get("digests") or {}).items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if file_digest(path) != expected:
            return f"{name}: its digest differs from the manifest's"
    if set(manifest.get("digests") or {}) != set(FILES):
        return f"the manifest lists {sorted(manifest.get('digests') or {})}, not {list(FILES)}"
    return ""


def read_or_convert(unet: torch.nn.Module, convert: Callable[[], Any], store: IRStore, *,
                    int8_weights: bool = False, model: str = "", component: str = "unet") -> tuple[Any, CacheOutcome]:
    """The OpenVINO model of ``unet`` (or another module: ``component`` names it in the stored
    fields, e.g. ``vae.decoder``; the key is the module's own): read from ``store`` when an intact
    entry is there (``hit``), else ``convert()``-ed, saved as IR and stored for the next worker
    (``miss``, ``corrupt`` or ``error``, the reason in words). Both paths return the model read from the IR files in a
    scratch directory (``tempfile``: ``$TMPDIR``, else ``/tmp``). OpenVINO maps the weights file
    and the compiled model keeps the mapping, so the file, removed from the directory before this
    returns, holds its disk space (3.4 GB for SD 1.5) while the worker runs; measured on sd15-arch,
    mapping saved 3–4 s of read, compile and first inference against reading into memory, with
    the same peak RSS. When the IR cannot be written (a full or read-only scratch disk), the
    converted model is returned as it is, with the outcome ``error``.

    Returns:
        (``openvino.Model``, the outcome: key, outcome, reason, bytes of the IR, seconds of the
        restore or of the conversion and save; ``saved`` as ``{"bytes", "seconds"}`` or
        ``{"error"}`` after a store). Never raises for storage: a failed fetch converts, a failed
        store is logged and recorded.
    Raises:
        whatever ``convert()`` raises.
    """
    import openvino as ov

    started = time.perf_counter()
    key, fields = ir_key(unet, int8_weights)
    fields = {**fields, "model": model, "component": component}
    with tempfile.TemporaryDirectory(prefix="renderfarm-openvino-") as tmp:
        directory = Path(tmp)
        outcome = _fetch(store, key, directory)
        if outcome.outcome == "hit":
            converted = None
        else:
            for path in directory.iterdir():
                path.unlink()
            converted = convert()
            try:
                _write(converted, directory, key, fields)
            except Exception as exc:
                outcome = CacheOutcome(key, "error", f"could not write the IR: {type(exc).__name__}: {exc}",
                                       seconds=time.perf_counter() - started)
                _log(outcome)
                return converted, outcome
        outcome.bytes = sum((directory / n).stat().st_size for n in FILES)
        outcome.seconds = time.perf_counter() - started
        _log(outcome)
        if converted is not None:
            saving = time.perf_counter()
            try:
                store.store_files(key, directory, fields)
                outcome.saved = {"bytes": outcome.bytes, "seconds": round(time.perf_counter() - saving, 3)}
            except Exception as exc:
                outcome.saved = {"error": f"{type(exc).__name__}: {exc}"}
                log.warning("openvino IR cache: could not save %s: %s: %s", key, type(exc).__name__, exc)
        return ov.Core().read_model(directory / FILES[0]), outcome


def _fetch(store: IRStore, key: str, directory: Path) -> CacheOutcome:
    try:
        found = store.fetch_files(key, directory)
    except Exception as exc:
        return CacheOutcome(key, "error", f"fetch failed: {type(exc).__name__}: {exc}")
    if not found:
        return CacheOutcome(key, "miss", "no converted model stored under this key")
    problem = check_files(directory, key)
    return CacheOutcome(key, "corrupt", problem) if problem else \
        CacheOutcome(key, "hit", "read the converted model instead of tracing it")


def _write(model: Any, directory: Path, key: str, fields: dict) -> None:
    """``model`` as IR in ``directory`` (float32 weights kept), then its manifest."""
    import openvino as ov

    ov.save_model(model, directory / FILES[0], compress_to_fp16=False)
    manifest = {"key": key, "fields": fields, "digests": {n: file_digest(directory / n) for n in FILES}}
    (directory / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, default=str))


def _log(outcome: CacheOutcome) -> None:
    if outcome.outcome == "hit":
        log.info("openvino IR cache hit: %s (%d bytes, %.2fs)", outcome.key, outcome.bytes, outcome.seconds)
    else:
        log.warning("openvino IR cache %s: %s: %s; converted instead (%.2fs)", outcome.outcome, outcome.key,
                    outcome.reason, outcome.seconds)


__all__ = ["FILES", "FORMAT", "MANIFEST", "DirectoryIRStore", "IRStore", "check_files", "ir_key", "read_or_convert"]
