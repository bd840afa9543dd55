"""Load any diffusers text-to-image pipeline: offline name, hub id, local directory or single file.

Place in the data flow: a worker calls :func:`load_pipeline` once at start with its pool's model
and keeps the pipeline resident (:mod:`pipeline.warm`).

The dtype is given at load time (``torch_dtype``), never float32 first and a cast after: a FLUX
transformer in float32 alone needs about 48 GB. ``variant`` (``"fp16"``) and ``revision`` pass
through to diffusers. Hub ids and directories go through ``AutoPipelineForText2Image`` and fall
back to ``DiffusionPipeline`` (which reads the class from ``model_index.json``): the auto
pipeline has no mapping for, e.g., ``ErnieImagePipeline``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.models.build import build_offline_model, construct_pipeline
from pipeline.models.families import FAMILY_SPECS
from pipeline.models.offline import OFFLINE_MODELS

log = logging.getLogger(__name__)
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".bin", ".sft")
#: diffusers' single-file model types (``infer_diffusers_model_type``) → family, by prefix.
_SINGLE_FILE_TYPES = (("xl", "sdxl"), ("sd3", "sd3"), ("flux-dev", "flux-dev"), ("flux-schnell", "flux-schnell"),
                      ("v2", "sd2"), ("v1", "sd1"))


def load_pipeline(spec: str, *, device: str = "cpu", torch_dtype: torch.dtype = torch.float32,
                  cache_dir: Path | None = None, variant: str | None = None, revision: str | None = None,
                  family: str | None = None, use_pe: bool = False, **components):
    """Load a text-to-image pipeline for ``spec`` on ``device`` in ``torch_dtype``, progress bars off.

    ``spec`` is an offline name (:data:`OFFLINE_MODELS`: built on first use into ``cache_dir``,
    default ``Settings.cache_dir``, or for the full-size SD3 / FLUX / ERNIE ones constructed
    directly on ``device`` in ``torch_dtype``), a local directory in diffusers layout, a single
    checkpoint file (``family`` names its pipeline, else it is inferred from the checkpoint's
    keys), or a Hugging Face hub id. ``components`` override pipeline components (e.g.
    ``safety_checker=None``). ERNIE-Image's prompt enhancer (``pe``, a 3B language model) is not
    loaded unless ``use_pe`` (the pool setting; its model card's validation runs without it).

    Raises:
        FileNotFoundError: ``spec`` looks like a local path (absolute, ``./``, ``~``) that does not exist.
        ValueError: ``spec`` could not be loaded (unknown hub id, no network, not a pipeline);
            the message names ``spec`` and the cause.
    """
    if spec in OFFLINE_MODELS:
        pipe = _load_offline(spec, device, torch_dtype, cache_dir, components)
    else:
        local = Path(spec).expanduser()
        if spec.startswith(("/", "./", "../", "~")) and not local.exists():
            raise FileNotFoundError(f"model path {spec!r} does not exist")
        source = str(local) if local.exists() else spec
        kwargs = {"dtype": torch_dtype, **({"variant": variant} if variant else {}),
                  **({"revision": revision} if revision else {}), **components}
        try:
            if local.is_file() and local.suffix in SINGLE_FILE_SUFFIXES:
                pipe = _single_file(source, family, kwargs)
            else:
                pipe = _pretrained(source, kwargs, use_pe)
        except Exception as exc:  # diffusers/hub raise many types (OSError, HTTPError, ValueError...)
            raise ValueError(f"cannot load model {spec!r} (offline names: {', '.join(OFFLINE_MODELS)}): "
                             f"{type(exc).__name__}: {exc}") from exc
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe._renderfarm_offline = spec in OFFLINE_MODELS  # the tiny-VAE step picks offline builds for these
    pipe._renderfarm_model = spec  # the name the user gave (cache listings name it)
    return pipe


def _load_offline(name: str, device: str, dtype: torch.dtype, cache_dir: Path | None, components: dict):
    import diffusers

    spec = OFFLINE_MODELS[name]
    if not spec.disk or torch.device(device).type != "cpu":
        # tens of GB, or an accelerator: made on the target device in the target dtype (seconds,
        # no float32 copy on the host, nothing written), never saved here
        log.warning("constructing %s on %s in %s (random weights, not cached)", name, device, dtype)
        return construct_pipeline(spec, device, dtype)
    if cache_dir is None:
        from infra.settings import get_settings

        cache_dir = get_settings().cache_dir
    path = build_offline_model(name, cache_dir)
    return getattr(diffusers, spec.pipeline).from_pretrained(
        path, dtype=dtype, local_files_only=True, **{**spec.pipeline_kwargs, **components})


def _pretrained(source: str, kwargs: dict, use_pe: bool):
    from diffusers import AutoPipelineForText2Image, DiffusionPipeline

    try:
        return AutoPipelineForText2Image.from_pretrained(source, **kwargs)
    except ValueError as exc:  # "AutoPipeline can't find a pipeline linked to ErnieImagePipeline ..."
        log.info("AutoPipelineForText2Image cannot load %s (%s); using DiffusionPipeline", source, exc)
    index = _model_index(source, kwargs.get("revision"))
    if index.get("_class_name") == FAMILY_SPECS["ernie-image"].pipeline and not use_pe:
        kwargs = {"pe": None, "pe_tokenizer": None, **kwargs}  # skip the 3B prompt enhancer
    return DiffusionPipeline.from_pretrained(source, **kwargs)


def _model_index(source: str, revision: str | None) -> dict:
    import json

    from diffusers import DiffusionPipeline

    try:
        local = Path(source) / "model_index.json"
        if local.is_file():
            return json.loads(local.read_text())
        return dict(DiffusionPipeline.load_config(source, revision=revision))
    except Exception:  # an index we cannot read: let from_pretrained report the real error
        return {}


def _single_file(path: str, family: str | None, kwargs: dict):
    import diffusers

    if family is None:
        from diffusers.loaders.single_file_utils import infer_diffusers_model_type, load_single_file_checkpoint

        kind = infer_diffusers_model_type(load_single_file_checkpoint(path))
        family = next((f for prefix, f in _SINGLE_FILE_TYPES if kind.startswith(prefix)), None)
        if family is None:
            raise ValueError(f"single file of model type {kind!r}: name its family to load it")
    cls = getattr(diffusers, FAMILY_SPECS[family].pipeline)
    return cls.from_single_file(path, **kwargs)
