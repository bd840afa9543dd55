"""Batched rendering: one group of compatible requests → one pipeline call → one image each.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. The worker
groups the jobs it pulled by :func:`compat_key` and hands each group to :meth:`Renderer.render`;
the images go on to storage.

Every image has its own seeded generator (CPU generators, so a seed draws the same starting noise
on every device). Batch invariance (an image's pixels do not depend on its batch-mates) is the
``batch_invariant`` option: on the CPU the invariant kernels of :mod:`pipeline.invariance`
(verified in float32); on accelerators per-sample calls of the text encoders and the denoiser and a
sliced VAE decode (guaranteed by construction, at the cost of batching). The pipeline is called
only with arguments its ``__call__`` takes (:mod:`pipeline.capabilities`); the scheduler loop runs
without host-device synchronization on CUDA (:mod:`pipeline.sync_free`); a VAE decode that runs out
of memory is redone one image at a time (:func:`pipeline.memory.guard_vae_decode`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import PIL.Image
import torch

from infra.schemas import RenderRequest
from pipeline import compile_count
from pipeline.buckets import split
from pipeline.capabilities import call_arguments, derive_capabilities
from pipeline.compat import CompatKey as CompatKey
from pipeline.compat import compat_key as compat_key
from pipeline.controlnet import attach_maps, control_arguments, controlnet_pipeline
from pipeline.controlnet_models import control_encodes_by_mode
from pipeline.invariance import PER_SAMPLE, make_batch_invariant, make_per_sample
from pipeline.ip_adapter import applied_for_call, call_settings, is_ip_adapter
from pipeline.memory import guard_vae_decode
from pipeline.models.families import denoiser_of, detect_family
from pipeline.modes import InputLoader, ModePipelines, mode_arguments
from pipeline.schedulers import scheduler_for, scheduler_name
from pipeline.sync_free import install_pinned_noise, install_timestep_hook, make_sync_free

if TYPE_CHECKING:
    import subprocess

    from pipeline.controlnet import ControlNets
    from pipeline.ip_adapter import IPAdapters
    from pipeline.lora import AdapterCache
    from pipeline.memory import BatchLimits
    from pipeline.pool_options import PoolOptions

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class Renderer:
    """One warm pipeline that renders groups of compatible requests.

    ``device`` is where the pipeline lives (it is not moved here). ``batch_invariant``: identical
    pixels alone and in any batch (see the module docstring); None = on for the CPU, off on
    accelerators. ``use_pe``: ERNIE-Image's prompt enhancer (a pool setting; off as in its model
    card's validation). ``upscale``: the upscaling stage (:class:`pipeline.upscale.UpscaleStage`) for
    requests that ask for ``upscale`` (None: one is made on first use, on ``device``, allowing any
    upscaler). The invariance actually in force is :attr:`invariance` (``"cpu-kernels"``,
    ``"per-sample"`` or ``"none"`` with the reason in :attr:`invariance_note`).

    Static batch buckets (:mod:`pipeline.buckets`): with :attr:`buckets` set (by
    :func:`pipeline.warm.warm_up`), a group is rendered as one pipeline call per bucket, largest
    first. Once warmed up (:attr:`graphs_warmed` set), every pipeline call is counted by the code
    it was seen to run (:func:`pipeline.compile_count.observed`): in :attr:`compiled_renders` when
    compiled code served it alone (TorchDynamo graphs, AOTInductor packages, OpenVINO models), in
    :attr:`eager_renders` when a compiled module ran its Python instead (no graph for the call's
    shapes, e.g. a size the pool did not declare or a bucket the warm-up missed), or when the
    warm-up compiled graphs and the call ran none of them.
    """

    buckets: tuple[int, ...] | None = None  # None: one call per group, whatever its size
    #: Set by the warm-up when it ends: whether it compiled graphs (torch.compile, AOTInductor)
    #: that every later call should run. None: not warmed up; no call is counted.
    graphs_warmed: bool | None = None
    compiled_renders = 0  # pipeline calls since the warm-up served by compiled code alone
    eager_renders = 0  # pipeline calls since the warm-up in which a compiled module ran eagerly

    # set by pipeline.warm.prepare_renderer after construction
    recipe: dict[str, Any]
    max_batch_size: int
    limits: BatchLimits
    pool: PoolOptions
    #: The compiler warm-up child (:func:`pipeline.optimize.compile.start_compiler_warm_up`), or None.
    compiler_warm_up: subprocess.Popen | None = None
    #: Reads an input image by its object key (set by the worker; None: txt2img only).
    input_loader: InputLoader | None = None
    #: The adapters requests may name (:class:`pipeline.lora.AdapterCache`, set by the worker; None: none).
    adapters: AdapterCache | None = None
    #: The ControlNets and IP-Adapters control units may name (:class:`pipeline.controlnet.ControlNets`,
    #: :class:`pipeline.ip_adapter.IPAdapters`; set by the worker; None: none).
    controlnets: ControlNets | None = None
    ip_adapters: IPAdapters | None = None

    def __init__(self, pipe, *, device: str = "cpu", model: str, generator_device: str = "cpu",
                 batch_invariant: bool | None = None, use_pe: bool = False, upscale=None) -> None:
        self.pipe = pipe
        self.upscale = upscale
        self.device = device
        self.model = model
        self.generator_device = generator_device
        self.use_pe = use_pe
        self.family = detect_family(pipe)
        self.capabilities = derive_capabilities(pipe)
        self.denoiser_name, _ = denoiser_of(pipe)
        self.host_timesteps = self.family == "ernie-image"  # its loop reads t.item() every step
        on_cpu = device.partition(":")[0] == "cpu"
        self.batch_invariant = on_cpu if batch_invariant is None else batch_invariant
        self.invariance, self.invariance_note = "none", ""
        if self.batch_invariant and not self.capabilities.batch_invariant:
            self.invariance_note = (f"{self.family}: the pipeline pads text to the batch's longest prompt; "
                                    "batch invariance cannot be guaranteed")
            self.batch_invariant = False
        elif self.batch_invariant:
            self.invariance = "cpu-kernels" if on_cpu else "per-sample"
        self.modes = ModePipelines(pipe)
        install_pinned_noise()
        self._prepare()

    def _prepare(self) -> None:
        # Cheap and idempotent: also catches modules swapped in after construction (fused QKV, tiny VAE).
        pipe = self.pipe
        install_timestep_hook(getattr(pipe, self.denoiser_name))
        if getattr(pipe, "vae", None) is not None:
            guard_vae_decode(pipe.vae)
        if self.invariance == "cpu-kernels":
            for name, component in pipe.components.items():
                if not isinstance(component, torch.nn.Module):
                    continue
                if name in TEXT_ENCODERS:  # one call per prompt: a lone prompt's shapes, any layout
                    make_per_sample(component)
                else:
                    make_batch_invariant(component)
            denoiser = getattr(pipe, self.denoiser_name)
            if getattr(denoiser, PER_SAMPLE, False):  # e.g. the OpenVINO UNet
                make_per_sample(denoiser)
        elif self.invariance == "per-sample":
            for name in (*TEXT_ENCODERS, self.denoiser_name):
                module = getattr(pipe, name, None)
                if isinstance(module, torch.nn.Module):
                    make_per_sample(module)
            if hasattr(pipe.vae, "enable_slicing"):
                pipe.vae.enable_slicing()

    def describe(self) -> dict:
        """Family, capabilities and batch invariance in force, for the worker's report."""
        return {"family": self.family, "denoiser": self.denoiser_name, "capabilities": self.capabilities._asdict(),
                "batch_invariant": self.invariance, "batch_invariant_note": self.invariance_note,
                "use_pe": self.use_pe}

    def scheduler_name(self, requested: str) -> str:
        """The farm name of the scheduler a request asking for ``requested`` renders with:
        ``requested`` itself, or for ``default`` the name of the pipeline's own scheduler (its
        class and config, :func:`pipeline.schedulers.scheduler_name`), for the image's infotext."""
        if requested != "default":
            return requested
        return scheduler_name(scheduler_for(self.pipe, "default"))

    def warmup(self, *, width: int = 64, height: int = 64, num_inference_steps: int = 1) -> float:
        """Render one small image to load kernels and allocators; returns the wall time in seconds."""
        multiple = self.capabilities.size_multiple
        width, height = (max(multiple, (v // multiple) * multiple) for v in (width, height))
        started = time.perf_counter()
        self.render([RenderRequest(prompt="warmup", model=self.model, seed=0, width=width, height=height,
                                   num_inference_steps=num_inference_steps)])
        return time.perf_counter() - started

    def render(
        self, requests: Sequence[RenderRequest], on_step: Callable[[int, int], None] | None = None
    ) -> list[PIL.Image.Image]:
        """Render ``requests`` in one pipeline call per bucket (one call without :attr:`buckets`);
        returns RGB PIL images (width × height) in order,
        or ``upscale`` times that for requests that ask for upscaling (one batched upscale call after
        the decode, on the same device: :mod:`pipeline.upscale.stage`).

        ``on_step(done, total)`` is called after each denoising iteration, ``done`` = 1 … ``total``
        (``total`` = ``num_inference_steps`` for single-stage schedulers, times the number of bucket
        calls the group is split into).

        Raises:
            ValueError: the requests have different :func:`compat_key`, a seed is missing, a
                request names another model than this renderer's, or asks for what the pipeline
                cannot do (a negative prompt, a scheduler, a size; :mod:`pipeline.capabilities`).
        """
        if not requests:
            return []
        keys = {compat_key(r) for r in requests}
        if len(keys) > 1:
            raise ValueError(f"requests in one render call must share a compat key, got {sorted(keys, key=str)}")
        if any(r.seed is None for r in requests):
            raise ValueError("every request needs a seed (the producer assigns one)")
        first = requests[0]
        if first.model not in (None, self.model):
            raise ValueError(f"request for model {first.model!r} sent to a renderer of {self.model!r}")

        if self._zeros_for_empty_negative() and len({bool(r.negative_prompt) for r in requests}) > 1:
            return self._render_apart(requests, on_step, lambda r: bool(r.negative_prompt))
        if first.controls and len({call_settings(r, self.ip_adapters) for r in requests}) > 1:
            return self._render_apart(requests, on_step, lambda r: call_settings(r, self.ip_adapters))
        chunks = split(requests, self.buckets) if self.buckets else [list(requests)]
        images: list[PIL.Image.Image] = []
        for i, chunk in enumerate(chunks):
            progress = on_step if len(chunks) == 1 else _group_progress(on_step, i, len(chunks))
            images += self._render_call(chunk, progress)
        return images

    def _count(self, calls: compile_count.CallCounts) -> None:
        """Count one pipeline call after the warm-up by the compiled code ``calls`` saw it run."""
        if self.graphs_warmed is None:
            return
        if calls.eager or (self.graphs_warmed and not calls.compiled):
            self.eager_renders += 1
        elif calls.compiled:
            self.compiled_renders += 1

    def _render_call(self, requests: Sequence[RenderRequest],
                     on_step: Callable[[int, int], None] | None) -> list[PIL.Image.Image]:
        """One pipeline call for ``requests`` (checked by :meth:`render`)."""
        first = requests[0]
        self._prepare()
        pipe = self.modes.for_mode(first.mode)
        units = [i for i, u in enumerate(first.controls) if not is_ip_adapter(self.ip_adapters, u.type)]
        pipe = controlnet_pipeline(self.controlnets, pipe, first.mode, [first.controls[i].type for i in units])
        if self.adapters is not None:
            self.adapters.apply(first.loras)
        elif first.loras:
            raise ValueError(f"this worker declares no adapters; the request names {[a.name for a in first.loras]}")
        pipe.scheduler = make_sync_free(scheduler_for(pipe, first.scheduler), host_timesteps=self.host_timesteps)
        # seeds were checked above
        generators = [torch.Generator(self.generator_device).manual_seed(cast(int, r.seed)) for r in requests]

        def step_end(pipeline, step_index, timestep, callback_kwargs):
            if on_step is not None:
                on_step(step_index + 1, pipeline.num_timesteps if hasattr(pipeline, "num_timesteps")
                        else first.num_inference_steps)
            return callback_kwargs

        kwargs = call_arguments(self.pipe, requests, generators=generators, step_end=step_end, use_pe=self.use_pe)
        load = read_once(self.input_loader)  # an IP-Adapter's reference is also its unit's stored map
        kwargs = mode_arguments(pipe, requests, load, base=kwargs)
        maps: tuple[list, list[float]] | None = None
        if first.controls:
            kwargs, control_maps, seconds = control_arguments(pipe, requests, load, kwargs, units)
            maps = (control_maps, seconds)
        with (applied_for_call(self.ip_adapters, first.controls, pipe, kwargs, load),
              control_encodes_by_mode(pipe), torch.inference_mode(), compile_count.observed() as calls):
            result = pipe(**kwargs)
        self._count(calls)
        images = list(result.images)
        if first.upscale is not None:
            images = self.upscale_stage().upscale(images, first.upscaler, first.upscale,
                                                  prompts=[r.prompt for r in requests],
                                                  negative_prompts=[r.negative_prompt for r in requests],
                                                  seeds=[cast(int, r.seed) for r in requests])
        if maps is not None:
            attach_maps(images, *maps)
        return images

    def lora_hashes(self, request: RenderRequest) -> dict[str, str]:
        """Short hashes of the adapters ``request`` names (for the ``Lora hashes`` infotext field)."""
        if self.adapters is None or not request.loras:
            return {}
        return self.adapters.hashes([a.name for a in request.loras])

    def upscale_stage(self):
        """The upscaling stage (made on first use on this renderer's device when none was given)."""
        if self.upscale is None:
            from pipeline.upscale import UpscaleStage

            dtype = torch.float32 if self.device.partition(":")[0] in ("cpu", "mps") else torch.float16
            self.upscale = UpscaleStage(device=self.device, dtype=dtype)
        return self.upscale

    def _zeros_for_empty_negative(self) -> bool:
        """SDXL encodes "no negative prompt" as zero embeddings, but only when the whole call has none."""
        return bool(getattr(self.pipe.config, "force_zeros_for_empty_prompt", False))

    def _render_apart(self, requests: Sequence[RenderRequest], on_step,
                      part_of: Callable[[RenderRequest], Any]) -> list[PIL.Image.Image]:
        """Requests in separate calls by ``part_of(request)``, results in order: with and without a
        negative prompt (each image is then what it would be alone: zero embeddings for an empty
        one, whatever its batch-mates ask), or by control units' weights and guidance ranges
        (diffusers applies them to a whole call, :func:`pipeline.controlnet.control_settings`)."""
        parts: dict[Any, list[int]] = {}
        for i, r in enumerate(requests):
            parts.setdefault(part_of(r), []).append(i)
        images: dict[int, PIL.Image.Image] = {}
        for idx in parts.values():
            images.update(zip(idx, self.render([requests[i] for i in idx], on_step)))
        return [images[i] for i in range(len(requests))]

    def prepare_controlnet(self, model) -> None:
        """What the batch invariance in force does to the denoiser, done to a ControlNet once loaded:
        the CPU's invariant kernels, or per-sample calls (the denoiser's per-sample calls split the
        ControlNet residuals it is given, :mod:`pipeline.invariance`)."""
        if self.invariance == "cpu-kernels":
            make_batch_invariant(model)
        elif self.invariance == "per-sample":
            make_per_sample(model)


def read_once(load: InputLoader | None) -> InputLoader | None:
    """``load`` reading each input key at most once (one pipeline call's: an image a call names twice,
    such as an IP-Adapter's reference, which is also its unit's stored map, is fetched and decoded
    once). The images it returns are shared: callers make new images from them, never change them."""
    if load is None:
        return None
    read: dict[str, PIL.Image.Image] = {}

    def once(key: str) -> PIL.Image.Image:
        if key not in read:
            read[key] = load(key)
        return read[key]

    return once


def _group_progress(on_step: Callable[[int, int], None] | None, index: int,
                    count: int) -> Callable[[int, int], None] | None:
    """``on_step`` for the ``index``-th of ``count`` bucket calls of one group: steps counted over
    the whole group (``index × total + done`` of ``count × total``)."""
    if on_step is None:
        return None
    return lambda done, total: on_step(index * total + done, count * total)
