"""ControlNet per request: ControlNets loaded on first use, kept in an LRU, and the ControlNet
pipelines made from the pinned one.

Place in the data flow: worker → pipeline: for a group whose requests carry control units
(``RenderRequest.controls``; the unit set is part of the compat key, :mod:`pipeline.compat`),
:class:`pipeline.render.Renderer` asks :meth:`ControlNets.pipeline` for the mode's ControlNet
pipeline with the units' ControlNets and :func:`control_arguments` for the call's control maps
and scales, then stores the maps beside the images (:data:`infra.controls.CONTROL_MAPS_INFO`).

ControlNets (Zhang, Rao and Agrawala, "Adding Conditional Control to Text-to-Image Diffusion
Models", ICCV 2023) are the ones the pool declares (``infra.controls.ControlSpec``: name →
source), of the class that fits the pinned denoiser (:mod:`pipeline.controlnet_models`:
``ControlNetModel`` for a UNet, ``SD3ControlNetModel`` for SD3, ``FluxControlNetModel`` for FLUX.1).
On first use one is loaded in the denoiser's dtype and device: a hub id or local directory with
``from_pretrained``, a single checkpoint file (also ``s3://<key>``: the worker's ``fetch`` copies it
to a local file, this package reads no bucket) with ``from_single_file`` (the classes that have it),
or an offline build (``tiny-controlnet…``: :func:`~pipeline.controlnet_models.build_offline_controlnet`).
The loaded ControlNets are an LRU bounded by count and by bytes (their parameters'): the least
recently used is dropped before a load would pass either.

The pipelines are diffusers' ``AutoPipelineForText2Image`` / ``AutoPipelineForImage2Image`` /
``AutoPipelineForInpainting`` ``from_pipe(pinned, controlnet=...)`` ("Load pipelines: from_pipe" and
"ControlNet" in diffusers' docs). diffusers 0.42 has, per family and mode: SD 1/2 and SDXL
``…ControlNetPipeline``, ``…ControlNetImg2ImgPipeline`` and ``…ControlNetInpaintPipeline``;
FLUX.1 ``FluxControlNetPipeline``, ``FluxControlNetImg2ImgPipeline`` and
``FluxControlNetInpaintPipeline``; SD3 ``StableDiffusion3ControlNetPipeline`` only (no img2img one;
its ``StableDiffusion3ControlNetInpaintingPipeline`` is alimama's mask-conditioned ControlNet, with no
init image or strength, which ``from_pipe`` does not reach either): any other combination is a
ValueError. They reuse the pinned pipeline's modules, so there is no second copy of the base weights
and the recipe's work on those modules (attention processors, compiled or quantized denoiser, tiny
VAE) stays in force. The units' ControlNets go in as one multi-ControlNet (``MultiControlNetModel``,
``SD3MultiControlNetModel``, ``FluxMultiControlNetModel``: one or more units, one code path), made
once per unit set and mode.

Scales: diffusers' ``controlnet_conditioning_scale`` and ``control_guidance_start/end`` are per
ControlNet, not per image, so the renderer calls the pipeline once per distinct setting within a
group (:func:`control_settings`). A unit with ``guidance_start == guidance_end`` conditions no step
(diffusers refuses that range): it is passed as weight 0 over 0…1, which renders the same.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import PIL.Image

from infra.controls import CONTROL_MAPS_INFO, PREPROCESS_S_INFO
from pipeline.capabilities import call_parameters
from pipeline.controlnet_models import build_offline_controlnet, controlnet_class, controlnet_kind
from pipeline.memory import lru_victims
from pipeline.preprocess import control_map

#: Offline ControlNet sources start with this: random weights, the pinned denoiser's layout.
OFFLINE_PREFIX = "tiny-controlnet"
#: Render modes → diffusers' AutoPipeline whose ``from_pipe(pinned, controlnet=...)`` makes the mode's
#: ControlNet pipeline.
_AUTO = {"txt2img": "AutoPipelineForText2Image", "img2img": "AutoPipelineForImage2Image",
         "inpaint": "AutoPipelineForInpainting"}


def control_settings(request) -> tuple[tuple[float, float, float], ...]:
    """``(weight, guidance_start, guidance_end)`` per unit of ``request``: what one pipeline call's
    requests must share (diffusers applies them per ControlNet, to the whole batch)."""
    return tuple((u.weight, u.guidance_start, u.guidance_end) for u in request.controls)


class ControlNets:
    """The ControlNets of one pinned pipeline and its ControlNet pipelines (see the module docstring).

    Args:
        pipe: the pinned pipeline (SD 1/2, SDXL, SD3 or FLUX.1: :func:`~pipeline.controlnet_models.controlnet_kind`).
        sources: ControlNet name → source (offline name, path, ``s3://key`` or hub id): the only
            ones it loads.
        max_count: most ControlNets loaded at once. max_bytes: most bytes of their parameters.
        cache_dir: where offline ControlNets are built. fetch: ``s3://`` key → local file (the worker's).
        prepare: called with each ControlNet once loaded (the renderer's batch-invariant kernels).
    Attributes:
        loads, evictions: counters.
    """

    def __init__(self, pipe, sources: Mapping[str, str], *, max_count: int = 4, max_bytes: int = 4 << 30,
                 cache_dir: Path | None = None, fetch: Callable[[str], Path] | None = None,
                 prepare: Callable[[Any], object] | None = None) -> None:
        self.pipe = pipe
        self.sources = dict(sources)
        self.max_count, self.max_bytes = max_count, max_bytes
        self.cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "renderfarm"
        self.fetch = fetch
        self.prepare = prepare
        self._loaded: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # name → (model, bytes), LRU order
        self._pipes: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.loads = self.evictions = 0

    @property
    def loaded(self) -> list[str]:
        """Loaded ControlNet names, least recently used first."""
        return list(self._loaded)

    @property
    def loaded_bytes(self) -> int:
        """Bytes of the loaded ControlNets' parameters."""
        return sum(size for _, size in self._loaded.values())

    def models(self) -> list[Any]:
        """The loaded ControlNet modules."""
        return [model for model, _ in self._loaded.values()]

    def pipeline(self, mode: str, names: Sequence[str]):
        """The ControlNet pipeline of ``mode`` (``txt2img``, ``img2img`` or ``inpaint``) with the
        ControlNets ``names`` (one per unit, in order, in the kind's multi-ControlNet wrapper), made
        from the pinned pipeline on first use.

        Raises:
            ValueError: a name this worker does not declare, a ControlNet larger than ``max_bytes``,
                or a mode or pipeline class diffusers has no ControlNet pipeline for.
            OSError / diffusers errors: a ControlNet's files cannot be read or loaded.
        """
        names = tuple(names)
        for name in names:
            self._ensure(name, keep=names)
        key = (mode, names)
        if key not in self._pipes:
            import diffusers

            if mode not in _AUTO:
                raise ValueError(f"ControlNet units cannot be used in mode {mode!r} ({', '.join(_AUTO)} can)")
            multi = controlnet_class(controlnet_kind(self.pipe), multi=True)
            nets = multi([self._loaded[name][0] for name in names])
            try:
                made = getattr(diffusers, _AUTO[mode]).from_pipe(self.pipe, controlnet=nets)
            except ValueError as exc:
                raise ValueError(f"{type(self.pipe).__name__} has no {mode} ControlNet pipeline in diffusers: "
                                 f"{exc}") from None
            made.set_progress_bar_config(disable=True)
            self._pipes[key] = made
        return self._pipes[key]

    def shares_base_weights(self, mode: str, names: Sequence[str]) -> bool:
        """Whether the ControlNet pipeline of ``mode`` and ``names`` holds the very module objects of
        the pinned pipeline (no copy of the base weights)."""
        made = self.pipeline(mode, names)
        return all(getattr(made, name, None) is module for name, module in self.pipe.components.items()
                   if hasattr(module, "parameters"))

    def _ensure(self, name: str, *, keep: Sequence[str]) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        model = self._load(name)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if size > self.max_bytes:
            raise ValueError(f"ControlNet {name!r} is {size:,} bytes, over the cache's {self.max_bytes:,}")
        sizes = {n: nbytes for n, (_, nbytes) in self._loaded.items()}
        for victim in lru_victims(sizes, size, max_count=self.max_count, max_bytes=self.max_bytes, keep=keep):
            del self._loaded[victim]
            self._pipes = {k: p for k, p in self._pipes.items() if victim not in k[1]}
            self.evictions += 1
        if self.prepare is not None:
            self.prepare(model)
        self._loaded[name] = (model, size)
        self.loads += 1

    def _load(self, name: str):
        from pipeline.models.families import denoiser_of

        source = self.sources.get(name)
        if source is None:
            raise ValueError(f"ControlNet {name!r} is not declared for this worker (declared: "
                             f"{', '.join(sorted(self.sources)) or 'none'})")
        _, denoiser = denoiser_of(self.pipe)
        dtype, device = denoiser.dtype, denoiser.device
        cls = controlnet_class(controlnet_kind(self.pipe))
        single = source.startswith("s3://") or Path(source).expanduser().is_file()
        if single and not hasattr(cls, "from_single_file"):
            raise ValueError(f"ControlNet {name!r}: a {cls.__name__} loads from a diffusers directory or hub id, "
                             f"not a single checkpoint file ({source})")
        if source.startswith(OFFLINE_PREFIX):
            model = cls.from_pretrained(build_offline_controlnet(source, self.pipe, self.cache_dir), torch_dtype=dtype)
        elif source.startswith("s3://"):
            if self.fetch is None:
                raise ValueError(f"ControlNet {name!r} is in the bucket, and this renderer cannot read it")
            model = cls.from_single_file(str(self.fetch(source[len("s3://"):])), torch_dtype=dtype)
        elif single:
            model = cls.from_single_file(str(Path(source).expanduser()), torch_dtype=dtype)
        else:
            local = Path(source).expanduser()
            model = cls.from_pretrained(str(local) if local.exists() else source, torch_dtype=dtype)
        return model.to(device).eval()


def controlnet_pipeline(controlnets: "ControlNets | None", pipe, mode: str, types: Sequence[str]):
    """The pipeline for one call: ``pipe`` (the mode's) without ControlNet units, else the mode's
    ControlNet pipeline with the ControlNets ``types`` name.

    Raises:
        ValueError: units but no ``controlnets`` declared on this worker.
    """
    if not types:
        return pipe
    if controlnets is None:
        raise ValueError(f"this worker declares no ControlNets; the request names {list(types)}")
    return controlnets.pipeline(mode, list(types))


def control_arguments(pipe, requests: Sequence, load: Callable[[str], PIL.Image.Image] | None,
                      kwargs: dict[str, Any], controlnet_units: Sequence[int] | None = None,
                      ) -> tuple[dict[str, Any], list[list[PIL.Image.Image]], list[float]]:
    """``kwargs`` (one call of the ControlNet pipeline ``pipe`` for a group sharing its units and
    their settings) with the control maps and the units' scales added, the maps (per request, one
    RGB width × height image per unit) and the seconds each request's maps took to read and make.

    ``controlnet_units``: the indexes of the units that are ControlNets (None: all); only they go
    into the call. The others (IP-Adapter units, :mod:`pipeline.ip_adapter`) still get their map,
    their reference image fitted to the render's size, so that map N is unit N's image.

    The maps go in as ``control_image`` where the pipeline takes one (img2img and inpaint, whose
    ``image`` is the init image; SD3's and FLUX's txt2img), else as ``image`` (SD 1/2 and SDXL
    txt2img): one float tensor per unit, (requests, 3, height, width) in 0…1, as diffusers'
    multi-ControlNet pipelines take a batch per ControlNet (their img2img pipelines refuse nested
    lists of images; SD3's and FLUX's encode it with the VAE, :mod:`pipeline.controlnet_models`);
    ``controlnet_conditioning_scale`` and ``control_guidance_start/end`` are lists, one entry per
    unit; FLUX's ``control_mode`` one None per unit.

    Raises:
        ValueError: no input loader, or an image that does not decode (from the loader).
    """
    if load is None:
        raise ValueError("control units need their images, and this renderer has no input loader")
    maps: list[list[PIL.Image.Image]] = []
    seconds: list[float] = []
    for request in requests:
        started = time.perf_counter()
        maps.append([control_map(unit, load(unit.image), request.width, request.height)
                     for unit in request.controls])
        seconds.append(time.perf_counter() - started)
    import numpy as np
    import torch

    units = requests[0].controls
    indexes = range(len(units)) if controlnet_units is None else controlnet_units
    if not indexes:
        return kwargs, maps, seconds
    units = [units[n] for n in indexes]
    field = "control_image" if "control_image" in call_parameters(pipe) else "image"
    # one (batch, 3, height, width) tensor in 0…1 per unit: what the pipelines' control image processor
    # makes of PIL images (pixels / 255), in the one layout every mode's ControlNet pipeline takes
    per_unit = [torch.from_numpy(np.stack([np.asarray(m[n], dtype=np.float32) / 255.0 for m in maps]))
                .permute(0, 3, 1, 2) for n in indexes]
    ranges = [(u.guidance_start, u.guidance_end) if u.guidance_start < u.guidance_end else (0.0, 1.0) for u in units]
    out = {**kwargs, field: per_unit,
           "controlnet_conditioning_scale": [u.weight if u.guidance_start < u.guidance_end else 0.0 for u in units],
           "control_guidance_start": [start for start, _ in ranges],
           "control_guidance_end": [end for _, end in ranges]}
    if "control_mode" in call_parameters(pipe):
        # FLUX's: a union ControlNet's mode. diffusers 0.42's FLUX ControlNet img2img and inpaint
        # pipelines turn the default None into an empty tensor, over which FluxMultiControlNetModel runs
        # no ControlNet at all (UnboundLocalError): one None per unit (-1, which a plain ControlNet ignores).
        out["control_mode"] = [None] * len(units)
    return out, maps, seconds


def attach_maps(images: Sequence[PIL.Image.Image], maps: Sequence[Sequence[PIL.Image.Image]],
                seconds: Sequence[float]) -> None:
    """Hand each image's control maps and preprocessing seconds to storage in its ``info``
    (:data:`~infra.controls.CONTROL_MAPS_INFO`, :data:`~infra.controls.PREPROCESS_S_INFO`)."""
    for image, image_maps, spent in zip(images, maps, seconds, strict=True):
        image.info[CONTROL_MAPS_INFO] = list(image_maps)
        image.info[PREPROCESS_S_INFO] = spent
