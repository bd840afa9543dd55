"""Instantiate offline models: on a device in a dtype, on ``meta`` to count parameters, or into the cache.

Place in the data flow: :func:`pipeline.models.load.load_pipeline` → here, once per offline model
(a disk build), or each time for full-size models that are never written to disk.

Weights are random from :data:`~pipeline.models.offline.WEIGHT_SEED`. :func:`construct_pipeline`
creates every parameter directly on ``device`` in ``dtype`` (``torch.device`` and default-dtype
context), so a 12B FLUX transformer is never materialised in float32 on the CPU first. A build on
CUDA draws from CUDA's generator, so its weights differ from a CPU build of the same seed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.models.offline import OFFLINE_MODELS, WEIGHT_SEED, OfflineModel
from pipeline.models.tokenizers import make_tokenizer, write_tokenizer

log = logging.getLogger(__name__)
_STAMP = "renderfarm_build.json"


def _model_class(kind: str, name: str):
    import diffusers
    import transformers

    if kind == "kolors":  # Kolors' ChatGLM text encoder ships inside diffusers' Kolors pipeline package
        from diffusers.pipelines.kolors import text_encoder

        return getattr(text_encoder, name)
    return getattr(diffusers if kind in ("diffusers", "scheduler") else transformers, name)


def _instantiate(kind: str, cls_name: str, config: dict):
    cls = _model_class(kind, cls_name)
    if kind in ("diffusers", "scheduler", "processor"):
        return cls(**config)
    if kind != "kolors":
        return cls(cls.config_class(**config)).eval()
    # ChatGLM skips weight initialization by default (empty_init), its RMSNorm weights are torch.empty
    # and its _init_weights does nothing: initialize the linear layers and set the norms to 1.
    model = cls(cls.config_class(**config), empty_init=False)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.fill_(1.0)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 0.02)
    return model.eval()


@contextlib.contextmanager
def _creation(device: str | torch.device, dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def construct_components(spec: OfflineModel, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, scratch: Path | None = None) -> dict:
    """Every component of ``spec`` (weights from the seed, created on ``device`` in ``dtype``).

    Tokenizers are written to and loaded from ``scratch`` (a temporary directory when None).
    On ``device="meta"`` no memory is allocated: use it to count parameters.
    """
    out: dict = dict(spec.pipeline_kwargs)
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rf-tok-")))
        if torch.device(device).type != "meta":
            stack.enter_context(torch.random.fork_rng(devices=[] if torch.device(device).type == "cpu"
                                                      else [torch.device(device)]))
            torch.manual_seed(WEIGHT_SEED)
        for name, (kind, cls_name, config) in spec.components.items():
            if kind == "tokenizer":
                out[name] = make_tokenizer({"kind": cls_name, **config}, scratch / name)
            elif kind in ("scheduler", "processor"):
                out[name] = _instantiate(kind, cls_name, config)
            else:
                with _creation(device, dtype):
                    out[name] = _instantiate(kind, cls_name, config)
    return out


def construct_pipeline(spec: OfflineModel | str, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, scratch: Path | None = None):
    """The diffusers pipeline of ``spec`` with random weights, built on ``device`` in ``dtype``.

    ``scratch``: where tokenizer files are written (a temporary directory, removed on return,
    when None). This is how full-size models are made on a GPU (``construct_pipeline("flux-schnell-arch",
    "cuda", torch.bfloat16)``): no float32 copy, nothing written to disk.
    """
    import diffusers

    spec = OFFLINE_MODELS[spec] if isinstance(spec, str) else spec
    pipe = getattr(diffusers, spec.pipeline)(**construct_components(spec, device, dtype, scratch))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parameter_counts(spec: OfflineModel | str) -> dict[str, int]:
    """Parameters per model component, counted on the ``meta`` device (no memory, seconds)."""
    spec = OFFLINE_MODELS[spec] if isinstance(spec, str) else spec
    components = construct_components(spec, "meta")
    return {name: sum(p.numel() for p in module.parameters()) for name, module in components.items()
            if isinstance(module, torch.nn.Module)}


def build_offline_model(name: str, cache_dir: Path) -> Path:
    """Build offline model ``name`` once (float32, safetensors) and return ``<cache_dir>/models/<name>/``.

    The build goes into a temporary sibling directory that is renamed into place, under an
    exclusive file lock, so concurrent processes neither corrupt nor duplicate it. A cached build
    whose fingerprint (configs, seed, torch version) no longer matches is rebuilt. Sizes on disk
    (float32): ``tiny`` 16 MB, ``bk-sdm-tiny-arch`` 2.0 GB, ``sd15-arch`` 4.0 GB, ``sd-turbo-arch``
    4.9 GB, ``sdxl-arch`` 13.9 GB; building ``sd15-arch`` takes ~20 s and ~5 GB of RAM on 2 cores.
    Full-size SD3 / FLUX / ERNIE builds (``disk=False``) are written only when this is called.

    Raises:
        ValueError: ``name`` is not in :data:`OFFLINE_MODELS`.
    """
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; known: {', '.join(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[name]
    models_dir = Path(cache_dir).expanduser() / "models"
    final = models_dir / name
    if _stamp_matches(final, spec):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then re-check
        if _stamp_matches(final, spec):
            return final
        log.warning("building offline model %r (%s) into %s", name, spec.fingerprint(), final)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=models_dir))
        try:
            # tokenizers' files stay on disk until saved (ChatGLM's copies its tokenizer.model from there)
            pipe = construct_pipeline(spec, scratch=tmp / ".tokenizers")
            pipe.save_pretrained(tmp, safe_serialization=True)
            del pipe
            shutil.rmtree(tmp / ".tokenizers", ignore_errors=True)
            for component, (kind, cls_name, config) in spec.components.items():
                if kind == "tokenizer":  # the classic files too (vocab.json/merges.txt for CLIP)
                    write_tokenizer(tmp / component, {"kind": cls_name, **config})
            (tmp / _STAMP).write_text(json.dumps({"name": name, "fingerprint": spec.fingerprint()}))
            if final.exists():  # stale build: move it aside, then swap the new one in
                os.rename(final, models_dir / f".{name}.stale-{os.getpid()}")
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for stale in models_dir.glob(f".{name}.stale-*"):
                shutil.rmtree(stale, ignore_errors=True)
        log.warning("built offline model %r in %.1f s", name, time.perf_counter() - started)
    return final


def addon_build_dir(cache_dir: Path, kind: str, pipe, name: str) -> Path:
    """Where an offline add-on ``name`` (a ControlNet, an IP-Adapter) made for ``pipe``'s model is
    kept: ``cache_dir/kind/<first 16 hex digits of the SHA-256 of the model's name>/name``."""
    model = str(getattr(pipe, "_renderfarm_model", type(pipe).__name__))
    return Path(cache_dir) / kind / hashlib.sha256(model.encode()).hexdigest()[:16] / name


def name_seed(name: str) -> int:
    """The random seed of an offline add-on build: the first 4 bytes of the SHA-256 of its
    ``name``, so that a name always builds the same weights."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")


@contextlib.contextmanager
def published_once(final: Path) -> Iterator[Path]:
    """A temporary directory beside ``final`` to write a build into. When the block ends without
    an error it is renamed to ``final`` unless another process published one meanwhile (theirs is
    kept); either way nothing of it is left behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
    try:
        yield tmp
        if not final.exists():
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stamp_matches(directory: Path, spec: OfflineModel) -> bool:
    try:
        return json.loads((directory / _STAMP).read_text())["fingerprint"] == spec.fingerprint()
    except (OSError, ValueError, KeyError):
        return False
