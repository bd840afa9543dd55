"""The compile cache's pipeline side: the artifact key, and Inductor's artifacts as one checked blob.

Place in the data flow: ``renderfarm worker`` start-up → load the pipeline → **here**: the key
of what this worker will compile (:func:`cache_key`); the worker fetches the blob stored under it
(``infra.storage.compile_artifacts``) and :func:`import_artifacts` hot-loads it into torch's local
caches before the warm-up compiles anything; after a warm-up that compiled (a miss),
:func:`export_artifacts` serializes what was compiled for the next worker. Nothing here touches
S3: blobs go in and out as bytes.

The artifacts are PyTorch's portable "mega-cache" (PyTorch recipe "Compile Time Caching in
``torch.compile``": ``torch.compiler.save_cache_artifacts()`` / ``load_cache_artifacts()``):
Inductor's FX graph cache, AOTAutograd's cache and the kernel autotuning results, loaded into
the local cache directory (``TORCHINDUCTOR_CACHE_DIR``, by default under ``/tmp``), so that
dynamo still traces but Inductor finds every graph already compiled. On the CPU that is not
enough: a graph found in the FX graph cache still builds its C++ kernels with the C++ compiler
(measured here: 125 kernels rebuilt, the whole cold warm-up's time again), because the
mega-cache carries the kernels' source, not the shared objects built from it. So the payload
also carries the compiled kernels (``*.so`` under the cache directory; Inductor's
``CppCodeCache`` loads a kernel whose object already sits at its content-hashed path instead
of compiling it). The local cache directory is only a scratch space here: nothing needs it to
outlive the process.

A blob is ``MAGIC`` (4 bytes), the header's length (4 bytes, big-endian), the header (UTF-8
JSON: ``format``, the key's ``fields``, the payload's ``sha256`` and ``bytes``), then the
payload: an uncompressed tar of ``megacache.bin`` (the bytes of ``save_cache_artifacts()``;
empty when only AOTInductor packages compiled) and ``kernels/<path under the cache directory>``:
the kernels' ``*.so`` and the AOTInductor packages (``aot-packages/*.pt2``,
:mod:`pipeline.optimize.aot`, the frozen CPU VAE decoder, one per shape; each holds its frozen
weights, about 200 MB for SD 1.5's decoder). The key names everything that changes the
compiled code: the model and its revision, the recipe's knobs, the device (name, compute
capability; on the CPU the model name and ISA flags), the torch/triton/diffusers versions, and
the warm-up's batch buckets, sizes and whether guidance doubles the batch.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import struct
import tarfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

log = logging.getLogger("renderfarm.worker")

FORMAT = 1
MAGIC = b"RFCC"
#: The folder, under the Inductor cache directory, of the AOTInductor packages (``*.pt2``,
#: :mod:`pipeline.optimize.aot`); the payload carries them as it carries the kernels.
AOT_PACKAGES = "aot-packages"
OUTCOMES = ("hit", "miss", "corrupt", "mismatch", "error")
# Recipe fields that do not change what Inductor compiles (the batch and memory bounds are
# covered by the buckets; the name is kept so that a person reading the key sees it).
_NOT_COMPILED = ("max_batch_size", "memory_fraction", "cpu_offload", "overridden", "approximations", "report",
                 "capabilities", "invariance", "family_checked")
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni")


@dataclass(frozen=True)
class CacheKey:
    """What the compiled artifacts depend on. ``fields`` is JSON-able; :attr:`name` is the storage
    key, ``<model slug>-<first 24 hex digits of the SHA-256 of fields>``."""

    fields: dict

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of :attr:`fields`."""
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        """``<model slug>-<digest[:24]>``: safe in an S3 key and in a file name."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(self.fields.get("model", "model")))[-48:].strip("_.") or "model"
        return f"{slug}-{self.digest[:24]}"


@dataclass
class CacheOutcome:
    """One restore or save: ``outcome`` is one of :data:`OUTCOMES` (``hit``: the artifact was
    loaded; ``miss``: none stored; ``corrupt``: bad magic, header or checksum; ``mismatch``: the
    header's key fields differ from this worker's; ``error``: storage or torch failed), ``reason``
    says why in words, ``bytes`` the blob's size and ``seconds`` the wall time it took."""

    key: str
    outcome: str
    reason: str = ""
    bytes: int = 0
    seconds: float = 0.0
    saved: dict | None = field(default=None)  # after a save: {"bytes", "seconds"} or {"error"}

    def to_dict(self) -> dict:
        """JSON-able form, for the heartbeat (``GET /v1/workers``: ``compile_cache``)."""
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        return d


class CorruptArtifact(ValueError):
    """The blob is not a well-formed artifact: bad magic, header, length or checksum."""


class MismatchedArtifact(ValueError):
    """The blob is well formed but was made for another key (other versions, device, recipe …)."""


def model_revision(model: str) -> str:
    """The revision that pins ``model``'s weights and configs.

    An offline build: ``offline:<name>:<fingerprint>`` (the hash of its component configs,
    :meth:`pipeline.models.offline.OfflineModel.fingerprint`). A local directory: ``sha256:``
    of its ``model_index.json`` and every component's ``config.json`` / ``scheduler_config.json``.
    A single file: ``sha256:`` of its size and modification time (hashing gigabytes would cost
    more than the compile). A hub id: the commit hash of the snapshot in the local hub cache
    (``huggingface_hub.snapshot_download(local_files_only=True)``), else ``unknown``.
    """
    from pipeline.models.offline import OFFLINE_MODELS

    if model in OFFLINE_MODELS:
        return f"offline:{model}:{OFFLINE_MODELS[model].fingerprint()}"
    path = Path(model).expanduser()
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(path.glob("model_index.json")) + sorted(path.glob("*/*config.json")):
            digest.update(str(f.relative_to(path)).encode())
            digest.update(f.read_bytes())
        return f"sha256:{digest.hexdigest()[:32]}"
    if path.is_file():
        stat = path.stat()
        return f"sha256:{hashlib.sha256(f'{stat.st_size}:{stat.st_mtime_ns}'.encode()).hexdigest()[:32]}"
    try:
        from huggingface_hub import snapshot_download

        return "hub:" + Path(snapshot_download(model, local_files_only=True)).name
    except Exception:
        return "unknown"


def package_version(package: str) -> str:
    """The installed version of the distribution ``package``, or ``"none"`` when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def device_fields(profile: dict) -> dict:
    """The device part of the key, from a device profile (:meth:`pipeline.device.DeviceProfile.to_dict`):
    kind, name and compute capability; on the CPU also the ISA flags Inductor's C++ kernels use."""
    from pipeline.device import cpu_flags

    out = {"kind": profile.get("kind"), "name": profile.get("name"),
           "compute_capability": profile.get("compute_capability")}
    if profile.get("kind") == "cpu":
        out["isa"] = sorted(f for f in cpu_flags() if f.startswith(_ISA_PREFIXES))
    return out


def cache_key(model: str, recipe: dict, profile: dict, plan) -> CacheKey:
    """The key of the artifacts a warm-up of ``plan`` compiles for ``model`` under ``recipe`` on
    the device ``profile`` describes.

    Args:
        model: the model as the worker loaded it (offline name, hub id, path).
        recipe: the recipe in force (``renderer.recipe``: :meth:`pipeline.recipes.Recipe.to_dict` and reports).
        profile: the device profile as a dict.
        plan: the warm-up plan (``pipeline.warm.WarmPlan``): ``buckets`` (batch sizes), ``sizes``
            ((width, height) pixels), ``guidance_scale`` (above 1 the denoiser's batch doubles) and
            ``control_sets`` (ControlNet unit sets, :mod:`pipeline.warm_controls`; in the key only when any).
    """
    knobs = {k: v for k, v in sorted(recipe.items()) if k not in _NOT_COMPILED and not isinstance(v, dict)}
    return key_of({**base_fields(model, profile), "recipe": knobs,
                   "buckets": [int(b) for b in plan.buckets],
                   "sizes": [[int(w), int(h)] for w, h in plan.sizes],
                   "guidance": float(plan.guidance_scale) > 1.0,
                   # the graphs with ControlNet residuals (absent without unit sets: the keys stored before stand)
                   **({"control_sets": [list(c) for c in plan.control_sets]} if getattr(plan, "control_sets", ())
                      else {})})


def base_fields(model: str, profile: dict) -> dict:
    """The fields every key built here shares: the format, the model and its revision, the device
    (:func:`device_fields`) and the torch, triton and diffusers versions."""
    import torch

    return {"format": FORMAT, "model": model, "revision": model_revision(model), "device": device_fields(profile),
            "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                         "diffusers": package_version("diffusers")}}


def key_of(fields: dict) -> CacheKey:
    """A :class:`CacheKey` of ``fields`` made plain JSON (tuples become lists)."""
    return CacheKey(json.loads(json.dumps(fields)))


def pack(key: CacheKey, payload: bytes) -> bytes:
    """A blob: magic, header length, header (format, key fields, SHA-256 and size of ``payload``), payload."""
    header = json.dumps({"format": FORMAT, "key": key.name, "fields": key.fields, "bytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode()
    return MAGIC + struct.pack(">I", len(header)) + header + payload


def read_header(blob: bytes) -> dict:
    """The header of ``blob``. Raises :class:`CorruptArtifact` when it is not one."""
    if len(blob) < 8 or blob[:4] != MAGIC:
        raise CorruptArtifact("not a compile-cache artifact (bad magic)")
    (size,) = struct.unpack(">I", blob[4:8])
    try:
        header = json.loads(blob[8:8 + size].decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptArtifact(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptArtifact("unreadable header: not an object")
    return {**header, "_offset": 8 + size}


def unpack(blob: bytes, key: CacheKey) -> bytes:
    """The payload of ``blob`` once it is checked against ``key``.

    Raises:
        CorruptArtifact: bad magic, header, length or SHA-256.
        MismatchedArtifact: another format, or key fields that differ (the message names them).
    """
    header = read_header(blob)
    if header.get("format") != FORMAT:
        raise MismatchedArtifact(f"format {header.get('format')!r}, this worker reads {FORMAT}")
    payload = blob[header["_offset"]:]
    if len(payload) != header.get("bytes"):
        raise CorruptArtifact(f"payload is {len(payload)} bytes, header says {header.get('bytes')}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptArtifact("payload SHA-256 does not match the header's")
    theirs = header.get("fields") or {}
    differ = sorted(k for k in set(theirs) | set(key.fields) if theirs.get(k) != key.fields.get(k))
    if differ:
        raise MismatchedArtifact("key fields differ: " + ", ".join(
            f"{k} ({json.dumps(theirs.get(k))[:80]} ≠ {json.dumps(key.fields.get(k))[:80]})" for k in differ))
    return payload


def inductor_cache_dir() -> Path:
    """Inductor's local cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_<user>``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def export_artifacts(key: CacheKey) -> bytes | None:
    """Everything this process compiled so far, as a blob for ``key``; None when there is nothing
    (no compile ran). ``torch.compiler.save_cache_artifacts()`` collects the artifacts since the
    process started (or since the last ``torch.compiler.reset()``); the compiled C++ kernels are
    every ``*.so`` under :func:`inductor_cache_dir`, and the AOTInductor packages the ones this
    process compiled or loaded (in its :data:`AOT_PACKAGES` folder). An AOTInductor build leaves
    its model library (``*.wrapper.so``, the frozen weights included) beside the kernels as well;
    that copy stays out, since the package carries it."""
    import torch

    from pipeline.compile_count import aot_package_paths

    saved = torch.compiler.save_cache_artifacts()
    root = inductor_cache_dir()
    packages = [p for p in aot_package_paths() if p.parent == root / AOT_PACKAGES]
    megacache = saved[0] if saved is not None and saved[0] else b""
    if not megacache and not packages:
        return None
    files = sorted(p for p in root.rglob("*.so") if not p.name.endswith(".wrapper.so")) if root.is_dir() else []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        _add(tar, "megacache.bin", megacache)
        for path in files + packages:
            if path.is_file() and not path.is_symlink():
                _add(tar, f"kernels/{path.relative_to(root).as_posix()}", path.read_bytes())
    return pack(key, buffer.getvalue())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _restore_payload(payload: bytes) -> tuple[bytes, int]:
    """Write the payload's kernels under the cache directory (only plain files at relative paths
    below ``kernels/``; an existing file is kept) and return (the mega-cache bytes, kernels written).
    Raises :class:`CorruptArtifact` on a payload that is not such a tar."""
    root = inductor_cache_dir()
    megacache, written = None, 0
    try:
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r:") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not member.isfile() or member.name.startswith("/") or ".." in parts:
                    raise CorruptArtifact(f"unexpected member {member.name!r} in the payload")
                data = tar.extractfile(member).read()  # type: ignore[union-attr]  # isfile() above
                if member.name == "megacache.bin":
                    megacache = data
                elif parts[0] == "kernels" and len(parts) > 1:
                    target = root.joinpath(*parts[1:])
                    if not target.exists():
                        target.parent.mkdir(parents=True, exist_ok=True)
                        tmp = target.with_name(f".{target.name}.{os.getpid()}")
                        tmp.write_bytes(data)
                        os.replace(tmp, target)
                        written += 1
    except tarfile.TarError as exc:
        raise CorruptArtifact(f"payload is not a tar: {exc}") from None
    if megacache is None:
        raise CorruptArtifact("payload has no megacache.bin")
    return megacache, written


def import_artifacts(blob: bytes | None, key: CacheKey, *, seconds: float = 0.0) -> CacheOutcome:
    """Check ``blob`` against ``key``, write its compiled kernels under the cache directory and
    hot-load its mega-cache (``torch.compiler.load_cache_artifacts``). ``None`` is a miss. Never
    raises: a corrupt, mismatched or unloadable blob returns its outcome and reason, and the
    warm-up then compiles. ``seconds`` (the fetch time) is added to the outcome's."""
    import torch

    if blob is None:
        return CacheOutcome(key.name, "miss", "no artifact stored under this key", 0, seconds)
    started = time.perf_counter()
    try:
        megacache, kernels = _restore_payload(unpack(blob, key))
        # an artifact of AOTInductor packages alone has an empty mega-cache: nothing to load
        info = torch.compiler.load_cache_artifacts(megacache) if megacache else None
    except CorruptArtifact as exc:
        return CacheOutcome(key.name, "corrupt", str(exc), len(blob), seconds + time.perf_counter() - started)
    except MismatchedArtifact as exc:
        return CacheOutcome(key.name, "mismatch", str(exc), len(blob), seconds + time.perf_counter() - started)
    except Exception as exc:  # torch could not deserialize it: as good as corrupt, but say what torch said
        return CacheOutcome(key.name, "error", f"load_cache_artifacts failed: {type(exc).__name__}: {exc}",
                            len(blob), seconds + time.perf_counter() - started)
    if info is None and megacache:  # torch logs why and returns None (its own checksum, a format of another version)
        return CacheOutcome(key.name, "error", "load_cache_artifacts rejected the mega-cache (see torch's warning)",
                            len(blob), seconds + time.perf_counter() - started)
    entries = sum(len(v) for v in getattr(info, "artifacts", {}).values())
    return CacheOutcome(key.name, "hit", f"loaded {entries} cache entries and {kernels} compiled files",
                        len(blob), seconds + time.perf_counter() - started)


def compile_counters() -> dict:
    """Inductor's cache counters so far in this process (``torch._dynamo.utils.counters["inductor"]``):
    ``fxgraph_cache_hit``, ``fxgraph_cache_miss`` (a graph compiled by Inductor), AOTAutograd's
    ``autograd_cache_hit`` / ``autograd_cache_miss`` when present, and the AOTInductor packages
    ``aot_compiled`` / ``aot_loaded`` (:func:`pipeline.compile_count.aot_packages`). A warm-up that
    compiled nothing new has ``fxgraph_cache_miss == 0`` and ``aot_compiled == 0``."""
    from torch._dynamo.utils import counters

    from pipeline.compile_count import aot_packages

    inductor = counters["inductor"]
    aot = counters["aot_autograd"]
    return {"fxgraph_cache_hit": int(inductor["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(inductor["fxgraph_cache_miss"]),
            "autograd_cache_hit": int(aot["autograd_cache_hit"]),
            "autograd_cache_miss": int(aot["autograd_cache_miss"]),
            **{f"aot_{k}": v for k, v in aot_packages().items()}}


def compiled_anew(counters: dict) -> int:
    """Graphs compiled, not served by a cache, in :func:`compile_counters`' ``counters``: Inductor
    FX graph cache misses plus AOTInductor packages compiled (0: a warm-up that compiled nothing)."""
    return int(counters["fxgraph_cache_miss"]) + int(counters.get("aot_compiled", 0))


def log_outcome(outcome: CacheOutcome) -> None:
    """The one log line of a restore: which outcome and why (a non-hit falls back to compiling)."""
    if outcome.outcome == "hit":
        log.info("compile cache hit: %s (%d bytes, %.2fs): %s", outcome.key, outcome.bytes, outcome.seconds,
                 outcome.reason)
    else:
        log.warning("compile cache %s: %s: %s; compiling instead", outcome.outcome, outcome.key, outcome.reason)


__all__ = ["AOT_PACKAGES", "FORMAT", "MAGIC", "OUTCOMES", "CacheKey", "CacheOutcome", "CorruptArtifact",
           "MismatchedArtifact", "cache_key", "compile_counters", "compiled_anew", "device_fields", "export_artifacts",
           "import_artifacts", "inductor_cache_dir", "log_outcome", "model_revision", "pack", "package_version",
           "read_header", "unpack"]
