"""LoRA adapters per request: loaded on first use, kept in an LRU, set per group.

Place in the data flow: worker → pipeline: before each group's call, :class:`pipeline.render.Renderer`
asks :meth:`AdapterCache.apply` for the group's adapters (they are part of the compat key, so a
group shares one set). An adapter is one its pool declares (``infra.pools.LoraSpec``: a name and a
source). On first use it is loaded with diffusers' ``load_lora_weights`` ("LoRA" in diffusers'
docs; the PEFT backend) under its name; :meth:`apply` then calls ``set_adapters`` with the group's
names and weights, or ``disable_lora`` for a group without adapters. The loaded adapters are an
LRU bounded by count and by bytes (the files' sizes): the least recently used is removed with
``delete_adapters`` before a load would pass either bound. Adapters inject layers into the
denoiser module the img2img and inpainting pipelines share (:mod:`pipeline.modes`), so they apply
in every mode.

Sources: an offline name (``tiny-lora-<anything>``: random weights in diffusers' key layout, made
with ``peft`` for the pinned pipeline's denoiser, rank 4 on the attention projections, built once
into the cache directory), a local file or directory, ``s3://<key>`` (the worker's ``fetch`` copies
the object to a local file: this package reads no bucket), or a hub id.

Hot-swap (a compiled denoiser): a new adapter set would change the layers and flags TorchDynamo
guards on, so every switch would recompile. With ``hotswap_rank`` the cache instead calls
diffusers' ``enable_lora_hotswap(target_rank=...)`` before the first load (diffusers' "Hotswapping
LoRA adapters" guide; PEFT pads every adapter to that rank and turns the scalings into tensors),
loads the first adapter into one fixed slot (:data:`SLOT`; :meth:`AdapterCache.prime` does it at
weight 0 before the worker's warm-up compiles, so no render recompiles), and from then on
replaces the slot's weights in place (``load_lora_weights(..., hotswap=True)``). A request's weight
and "no adapter" are the slot's scaling tensors filled in place (``weight × alpha/rank``, or 0), so
no switch recompiles. One slot means one adapter per group: a group naming several is refused
(several active adapters are a set TorchDynamo guards on), as is an adapter of rank above
``hotswap_rank`` (PEFT cannot pad it).

Each adapter's hash is the first 12 hex digits of its file's SHA-256 (A1111's short hash of a LoRA
file), for the ``Lora hashes`` of the images' parameters.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.memory import lru_victims

OFFLINE_PREFIX = "tiny-lora-"
WEIGHT_FILE = "pytorch_lora_weights.safetensors"
#: The adapter name of the hot-swap slot.
SLOT = "hotswap_slot"


class AdapterSource(NamedTuple):
    """Where a declared adapter loads from: ``source`` (offline name, path, ``s3://key`` or hub id)
    and ``weight_name`` (a file inside a directory or hub repository, or None)."""

    source: str
    weight_name: str | None = None


def build_offline_lora(name: str, pipe, cache_dir: Path, *, rank: int = 4) -> Path:
    """An offline random-weight LoRA for ``pipe``'s denoiser, saved once under ``cache_dir``
    (``loras/<name>/pytorch_lora_weights.safetensors``) in diffusers' key layout; returns the file.

    The weights are seeded by the name, so a name always builds the same adapter; ``lora_B`` is
    drawn (std 0.5) rather than zero so that the adapter visibly changes the images.
    """
    import copy

    import torch
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from pipeline.models.families import denoiser_of

    path = Path(cache_dir) / "loras" / name / WEIGHT_FILE
    if path.is_file():
        return path
    attr, denoiser = denoiser_of(pipe)
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big"))
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                        target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model = inject_adapter_in_model(config, copy.deepcopy(denoiser), adapter_name="default")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if "lora_B" in param_name else 0.1))
    layers = get_peft_model_state_dict(model, adapter_name="default")
    path.parent.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(str(path.parent), **{f"{attr}_lora_layers": layers}, safe_serialization=True)
    return path


def denoiser_compiled(pipe) -> bool:
    """Whether any module of ``pipe``'s denoiser is compiled in place (``Module.compile``, a
    compiled ``forward``, or diffusers' ``compile_repeated_blocks``): such a denoiser hot-swaps."""
    from pipeline.models.families import denoiser_of

    _, denoiser = denoiser_of(pipe)
    return any(getattr(m, "_compiled_call_impl", None) is not None
               or hasattr(getattr(m, "forward", None), "_torchdynamo_orig_callable") for m in denoiser.modules())


def short_hash(path: Path) -> str:
    """The first 12 hex digits of a file's SHA-256 (A1111's short hash of a LoRA file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


class AdapterCache:
    """The adapters of one pinned pipeline (see the module docstring).

    Args:
        pipe: the pinned pipeline (with diffusers' LoRA loader mixin).
        sources: adapter name → :class:`AdapterSource`: the only adapters it loads.
        max_count: most adapters loaded at once. max_bytes: most bytes of adapter files loaded at once.
        cache_dir: where offline adapters are built. fetch: ``s3://`` key → local file (the worker's).
    Attributes:
        loads, evictions: counters. last_switch_s: seconds of the last :meth:`apply` that changed
            the adapter set (loads included).
    """

    def __init__(self, pipe, sources: Mapping[str, AdapterSource], *, max_count: int = 8,
                 max_bytes: int = 1 << 30, cache_dir: Path | None = None,
                 fetch: Callable[[str], Path] | None = None, hotswap_rank: int | None = None) -> None:
        self.pipe = pipe
        self.sources = dict(sources)
        self.max_count, self.max_bytes = max_count, max_bytes
        self.cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "renderfarm"
        self.fetch = fetch
        self._loaded: OrderedDict[str, tuple[int, str]] = OrderedDict()  # name → (bytes, short hash), LRU order
        self._active: tuple[tuple[str, float], ...] = ()
        self.loads = self.evictions = 0
        self.last_switch_s = 0.0
        self.hotswap_rank = hotswap_rank
        self._slot: str | None = None  # the adapter in the hot-swap slot
        self._base_scaling: list[tuple[Any, float]] = []  # (slot scaling tensor, alpha/rank) per layer
        if hotswap_rank is not None:
            pipe.enable_lora_hotswap(target_rank=hotswap_rank, check_compiled="ignore")

    @property
    def loaded(self) -> list[str]:
        """Loaded adapter names, least recently used first."""
        return list(self._loaded)

    @property
    def loaded_bytes(self) -> int:
        """Bytes of the loaded adapters' files."""
        return sum(size for size, _ in self._loaded.values())

    def hashes(self, names: Sequence[str]) -> dict[str, str]:
        """Short hashes of the loaded adapters among ``names``."""
        return {n: self._loaded[n][1] for n in names if n in self._loaded}

    def apply(self, loras: Sequence[Any]) -> None:
        """Make ``loras`` (objects with ``name`` and ``weight``) the pipeline's active adapters;
        none: adapters off.

        Raises:
            ValueError: an adapter this cache has no source for, or one larger than ``max_bytes``.
            OSError / diffusers errors: its file cannot be read or loaded.
        """
        wanted = tuple((lora.name, float(lora.weight)) for lora in loras)
        if wanted == self._active:
            for name, _ in wanted:
                self._loaded.move_to_end(name)
            return
        started = time.perf_counter()
        if self.hotswap_rank is not None:
            self._apply_hotswap(wanted)
        elif not wanted:
            self.pipe.disable_lora()
        else:
            names = [name for name, _ in wanted]
            for name in names:
                self._ensure(name, keep=names)
            self.pipe.enable_lora()
            self.pipe.set_adapters(names, adapter_weights=[weight for _, weight in wanted])
        self._active = wanted
        self.last_switch_s = time.perf_counter() - started

    def prime(self) -> None:
        """Hot-swap only: load the first declared adapter into the slot at weight 0 now, so that the
        warm-up compiles the denoiser with the slot's layers and no render recompiles later
        (images are those without adapters until a request names one). No-op otherwise."""
        if self.hotswap_rank is not None and self._slot is None and self.sources:
            self._apply_hotswap(((sorted(self.sources)[0], 0.0),))
            self._active = ()

    def _apply_hotswap(self, wanted: tuple[tuple[str, float], ...]) -> None:
        if len(wanted) > 1:
            raise ValueError(f"this worker's denoiser is compiled and hot-swaps one adapter per render; the "
                             f"request names {len(wanted)} ({', '.join(n for n, _ in wanted)})")
        if wanted and wanted[0][0] != self._slot:
            name = wanted[0][0]
            self._loaded.clear()
            self._load(name, adapter_name=SLOT, hotswap=self._slot is not None)
            self._slot = name
            self._base_scaling = self._slot_scalings()
        weight = wanted[0][1] if wanted else 0.0
        for tensor, base in self._base_scaling:
            tensor.fill_(base * weight)

    def _slot_scalings(self) -> list[tuple[Any, float]]:
        """The slot's scaling tensors and their values as loaded (alpha/rank of the new adapter)."""
        from pipeline.models.families import denoiser_of

        _, denoiser = denoiser_of(self.pipe)
        found = []
        for module in denoiser.modules():
            scaling = getattr(module, "scaling", None)
            tensor = scaling.get(SLOT) if isinstance(scaling, dict) else None
            if tensor is not None and hasattr(tensor, "fill_"):
                found.append((tensor, float(tensor)))
        return found

    def _path(self, name: str) -> tuple[str | Path, str | None]:
        spec = self.sources.get(name)
        if spec is None:
            raise ValueError(f"adapter {name!r} is not declared for this worker (declared: "
                             f"{', '.join(sorted(self.sources)) or 'none'})")
        if spec.source.startswith(OFFLINE_PREFIX):
            return build_offline_lora(spec.source, self.pipe, self.cache_dir), None
        if spec.source.startswith("s3://"):
            if self.fetch is None:
                raise ValueError(f"adapter {name!r} is in the bucket, and this renderer cannot read it")
            return self.fetch(spec.source[len("s3://"):]), None
        return spec.source, spec.weight_name

    def _ensure(self, name: str, *, keep: Sequence[str]) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        source, weight_name = self._path(name)
        local = Path(source) if Path(source).exists() else None
        file = local / (weight_name or WEIGHT_FILE) if local is not None and local.is_dir() else local
        size = file.stat().st_size if file is not None and file.is_file() else 0
        if size > self.max_bytes:
            raise ValueError(f"adapter {name!r} is {size:,} bytes, over the cache's {self.max_bytes:,}")
        sizes = {n: nbytes for n, (nbytes, _) in self._loaded.items()}
        for victim in lru_victims(sizes, size, max_count=self.max_count, max_bytes=self.max_bytes, keep=keep):
            self.pipe.delete_adapters(victim)
            del self._loaded[victim]
            self.evictions += 1
        self._load(name, adapter_name=name)

    def _load(self, name: str, *, adapter_name: str, hotswap: bool = False) -> None:
        source, weight_name = self._path(name)
        local = Path(source) if Path(source).exists() else None
        file = local / (weight_name or WEIGHT_FILE) if local is not None and local.is_dir() else local
        size = file.stat().st_size if file is not None and file.is_file() else 0
        kwargs: dict[str, Any] = {"weight_name": weight_name} if weight_name else {}
        if hotswap:
            kwargs["hotswap"] = True
        if file is not None and file.is_file():
            kwargs["weight_name"] = file.name
            self.pipe.load_lora_weights(str(file.parent), adapter_name=adapter_name, **kwargs)
        else:
            self.pipe.load_lora_weights(str(source), adapter_name=adapter_name, **kwargs)
        self._loaded[name] = (size, short_hash(file) if file is not None and file.is_file() else "")
        self.loads += 1
