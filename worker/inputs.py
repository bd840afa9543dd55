"""What a worker's renderer reads besides its model: declared LoRA adapters and ControlNets, and
(in worker.main) input images, all from the farm's bucket only.

Place in the data flow: worker start-up → **here**: the pool's declared adapters (or, without a
declared pool, ``RENDERFARM_LORAS``) become the renderer's :class:`pipeline.lora.AdapterCache`,
whose ``s3://<key>`` sources are copied from the bucket into ``<cache_dir>/loras/s3/`` once (by
the key's SHA-256, so two keys never share a file); its declared ControlNets (``RENDERFARM_CONTROLS``
without a declared pool) become the renderer's :class:`pipeline.controlnet.ControlNets`, whose
``s3://<key>`` checkpoints are copied likewise into ``<cache_dir>/controlnets/s3/``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from infra.controls import ControlSpec
from infra.pools import LoraSpec
from infra.settings import Settings
from infra.storage.s3 import Storage

#: Most adapters and bytes of adapter files a worker keeps loaded (the LRU's bounds).
MAX_ADAPTERS = 8
MAX_ADAPTER_BYTES = 1 << 30
#: Most ControlNets and bytes of their parameters a worker keeps loaded (the LRU's bounds).
MAX_CONTROLNETS = 4
MAX_CONTROLNET_BYTES = 4 << 30
#: The highest adapter rank a compiled denoiser's hot-swap slot takes (PEFT pads smaller ones to it).
HOTSWAP_RANK = 64


def make_adapters(renderer, specs: Sequence[LoraSpec], storage: Storage, settings: Settings):
    """An :class:`pipeline.lora.AdapterCache` for ``renderer``'s pipeline with ``specs``, or None
    when none is declared (a request naming an adapter then fails: the API refuses it first).
    A compiled denoiser hot-swaps its adapters into one slot (:mod:`pipeline.lora`)."""
    if not specs or getattr(renderer, "pipe", None) is None:
        return None
    from pipeline.lora import AdapterCache, AdapterSource, denoiser_compiled

    sources = {s.name: AdapterSource(s.source, s.weight_name) for s in specs}
    fetch = _fetcher(storage, Path(settings.cache_dir) / "loras" / "s3", "pytorch_lora_weights.safetensors")
    cache = AdapterCache(renderer.pipe, sources, max_count=MAX_ADAPTERS, max_bytes=MAX_ADAPTER_BYTES,
                         cache_dir=Path(settings.cache_dir), fetch=fetch,
                         hotswap_rank=HOTSWAP_RANK if denoiser_compiled(renderer.pipe) else None)
    cache.prime()  # before the warm-up: the compiled graphs then include the hot-swap slot
    return cache


def make_controlnets(renderer, specs: Sequence[ControlSpec], storage: Storage, settings: Settings):
    """A :class:`pipeline.controlnet.ControlNets` for ``renderer``'s pipeline with ``specs`` (loaded
    on first use, LRU-bounded by :data:`MAX_CONTROLNETS` and :data:`MAX_CONTROLNET_BYTES`), or None
    when none is declared (a request with control units then fails: the API refuses it first)."""
    specs = [s for s in specs if s.kind == "controlnet"]
    if not specs or getattr(renderer, "pipe", None) is None:
        return None
    from pipeline.controlnet import ControlNets

    fetch = _fetcher(storage, Path(settings.cache_dir) / "controlnets" / "s3", "controlnet.safetensors")
    return ControlNets(renderer.pipe, {s.name: s.source for s in specs}, max_count=MAX_CONTROLNETS,
                       max_bytes=MAX_CONTROLNET_BYTES, cache_dir=Path(settings.cache_dir), fetch=fetch,
                       prepare=getattr(renderer, "prepare_controlnet", None))


def make_ip_adapters(renderer, specs: Sequence[ControlSpec], settings: Settings):
    """A :class:`pipeline.ip_adapter.IPAdapters` for ``renderer``'s pipeline with the IP-Adapters
    among ``specs`` (each read on first use and kept), or None when none is declared."""
    specs = [s for s in specs if s.kind == "ip-adapter"]
    if not specs or getattr(renderer, "pipe", None) is None:
        return None
    from pipeline.ip_adapter import OFFLINE_PREFIX, WEIGHT_NAME, IPAdapters, IPAdapterSource

    sources = {s.name: s.source if s.source.startswith(OFFLINE_PREFIX) else
               IPAdapterSource(s.source, s.subfolder, s.weight_name or WEIGHT_NAME, s.image_encoder_folder)
               for s in specs}
    return IPAdapters(renderer.pipe, sources, cache_dir=Path(settings.cache_dir))


def _fetcher(storage: Storage, folder: Path, file_name: str):
    """``key → local file``: the bucket's object ``key`` copied once to ``folder/<sha256 of key>/file_name``."""

    def fetch(key: str) -> Path:
        path = folder / hashlib.sha256(key.encode()).hexdigest() / file_name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".part")
            tmp.write_bytes(storage.get(key))
            tmp.replace(path)
        return path

    return fetch
