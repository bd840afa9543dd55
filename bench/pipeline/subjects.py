"""Subjects: one row's resident pipeline, how it was loaded, and how it renders seeds.

Place in the data flow: :mod:`bench.pipeline.specs` (a parsed ``--recipes`` entry) →
:func:`load_subject` (here) → the bench loops in :mod:`bench.pipeline.side_by_side`,
:mod:`bench.pipeline.modelcard` and :mod:`bench.pipeline.profile`, which time ``render``.

Two kinds: :class:`DiffusersSubject` calls the pipeline as a user of diffusers does (the
``reference`` row, and the ``peer`` / ``sdnq-uint4`` rows with the public recipes of
:mod:`bench.pipeline.public_recipes` applied), :class:`FarmSubject` renders through the farm's
``Renderer`` with one of its recipes (:mod:`bench.pipeline.adapter`). Both draw each image's
initial noise from its own CPU generator seeded with its seed, so equal seeds start from equal
latents in every row.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.pipeline import adapter, experiments, public_recipes
from bench.pipeline.instruments import DeviceTimer, MemoryWindow, device_kind, mib, sync, weights_bytes
from bench.pipeline.specs import BenchSpec
from pipeline.device import DeviceProfile

PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a red fox in the snow, golden hour",
    "an isometric city map, pastel colors",
    "a bowl of ramen, studio lighting",
    "portrait of an old sailor, oil on canvas",
    "a glass teapot on a wooden table",
    "a lighthouse in a storm, dramatic sky",
    "a field guide plate of botanical ferns",
)
OnStep = Callable[[int, int], None]


@dataclass(frozen=True)
class Workload:
    """What every render of a bench renders: model, size in pixels, steps, guidance scale."""

    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    cache_dir: str | None = None


def prompts_for(seeds: list[int]) -> list[str]:
    """Prompt i of a call is :data:`PROMPTS` [seed mod 8]: a seed always gets the same prompt."""
    return [PROMPTS[s % len(PROMPTS)] for s in seeds]


class Subject:
    """A loaded row. Attributes: ``spec``, ``pipe``, ``device``, ``dtype`` (name), ``resolved``
    (what the spec became), ``approximations`` (approximate knobs in force, relative to the
    reference), ``report`` (``applied``/``skipped`` steps), ``load_s``, ``load_memory``
    (:class:`MemoryWindow` of the load), ``weights_bytes``."""

    def __init__(self, spec: BenchSpec, workload: Workload, profile: DeviceProfile):
        self.spec = spec
        self.workload = workload
        self.profile = profile
        self.device = profile.torch_device
        self.pipe: Any = None  # a diffusers pipeline once loaded
        self.dtype = "float32"
        self.resolved = spec.text
        self.approximations: list[str] = []
        self.report: dict = {"applied": {}, "skipped": {}}
        self.load_s = 0.0
        self.load_memory = MemoryWindow(self.device)
        self.weights_bytes = 0
        self.threads = torch.get_num_threads()

    @property
    def exact(self) -> bool:
        return not self.approximations

    def _load(self) -> None:
        raise NotImplementedError

    def load(self) -> Subject:
        """Load and prepare the pipeline, timing it and taking its peak memory."""
        with self.load_memory, DeviceTimer("cpu") as timer:  # host clock: loading is host work
            self._load()
            if self.spec.fp8 or self.spec.first_block_cache is not None:
                report, approximations = experiments.apply_knobs(self.pipe, self.device, fp8=self.spec.fp8,
                                                           first_block_cache=self.spec.first_block_cache)
                self.report.setdefault("applied", {}).update(report["applied"])
                self.report.setdefault("skipped", {}).update(report["skipped"])
                self.approximations = [*self.approximations, *approximations]
            sync(self.device)
        self.load_s = timer.seconds
        self.weights_bytes = weights_bytes(self.pipe)
        gc.collect()  # what loading dropped (SDNQ's bf16 originals) leaves the allocator's cache
        if device_kind(self.device) == "cuda":
            torch.cuda.empty_cache()  # once, after loading; never between hot renders
        return self

    def _call(self, prompts: list[str], seeds: list[int], on_step: OnStep | None) -> list:
        raise NotImplementedError

    def summary(self) -> dict:
        """How the row was loaded, for the bench's ``reports``: what the spec resolved to, dtype,
        approximations, applied and skipped steps, load peaks (MiB) and the farm recipe in full."""
        out = {"resolved": self.resolved, "dtype": self.dtype, "approximations": self.approximations,
               "applied": self.report.get("applied", {}), "skipped": self.report.get("skipped", {}),
               "load_peak_allocated_mib": mib(self.load_memory.peak_allocated),
               "load_peak_reserved_mib": mib(self.load_memory.peak_reserved)}
        recipe = getattr(self, "recipe", None)
        if recipe is not None:
            out["recipe"] = recipe.to_dict()
        return out

    def _context(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def render_context(self):
        """The context every render of this row runs in: its pinned SDPA backend (``sdpa=…``) and
        the subject's own settings (the peer's Inductor flags)."""
        with experiments.sdpa_context(self.spec.sdpa), self._context():
            yield

    def render(self, seeds: list[int], on_step: OnStep | None = None) -> list[np.ndarray]:
        """Render one call with ``seeds`` (prompt i ↔ seed i); returns uint8 HWC arrays.
        ``on_step(done, total)`` runs after each denoising step (``total`` 0 when unknown)."""
        torch.set_num_threads(self.threads)
        with self.render_context():
            images = self._call(prompts_for(seeds), seeds, on_step)
        return [np.asarray(im.convert("RGB")) for im in images]

    def close(self) -> None:
        """Drop the pipeline and hand its memory back (between subjects, never between renders)."""
        self.pipe = None
        gc.collect()
        if device_kind(self.device) == "cuda":
            torch.cuda.empty_cache()


class DiffusersSubject(Subject):
    """``reference``, ``peer`` or ``sdnq-uint4``: the pipeline called directly, as diffusers' users do."""

    def _load(self) -> None:
        kind, opts, w = self.spec.kind, self.spec.options, self.workload
        recommended = adapter.recommended_dtype(w.model, device_kind(self.device))
        default = recommended if kind == "reference" else "bfloat16"
        self.dtype = opts.get("dtype", default)
        if self.dtype not in adapter.DTYPES:
            raise ValueError(f"{self.spec.text}: dtype {self.dtype!r}; expected one of {', '.join(adapter.DTYPES)}")
        self.pipe = adapter.load_reference(w.model, self.dtype, self.device, w.cache_dir)
        self.approximations = ["dtype"] if self.dtype != recommended else []
        if kind == "reference":
            self.resolved = f"diffusers {self.dtype}, eager, default attention (SDPA)"
        elif kind == "peer":
            compile_ = opts.get("compile", device_kind(self.device) == "cuda")
            mode, fullgraph = opts.get("compile_mode", "max-autotune"), opts.get("fullgraph", True)
            self.report = public_recipes.apply_fast_diffusion(self.pipe, compile=compile_, mode=mode,
                                                              fullgraph=fullgraph, tuning=opts.get("tuning", True))
            self.resolved = (f"diffusers {self.dtype}, fused QKV, channels_last"
                             + (f", torch.compile({mode}, fullgraph={fullgraph})" if compile_ else ", eager")
                             + ("" if opts.get("tuning", True) else ", without coordinate-descent tuning"))
        else:
            self.report = public_recipes.apply_sdnq_uint4(self.pipe, adapter.DTYPES[self.dtype],
                                                          opts.get("quantized_matmul", True))
            self.approximations.append("quantization")
            self.resolved = f"diffusers {self.dtype}, SDNQ uint4" + (
                ", quantized matmul" if opts.get("quantized_matmul", True) else "")

    def _context(self):
        if self.spec.kind != "peer":
            return contextlib.nullcontext()
        return public_recipes.inductor_flags(self.spec.options.get("tuning", True))

    def _call(self, prompts, seeds, on_step):
        w = self.workload

        def step_end(pipeline, step_index, timestep, callback_kwargs):
            if on_step is not None:
                on_step(step_index + 1, 0)
            return callback_kwargs

        kwargs = adapter.call_kwargs(
            self.pipe, prompt=prompts, width=w.width, height=w.height, num_inference_steps=w.steps,
            guidance_scale=w.guidance_scale, generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            output_type="pil", callback_on_step_end=step_end)
        return self.pipe(**kwargs).images


class FarmSubject(Subject):
    """A farm recipe (``exact``, ``fast``, a device class), rendered through ``Renderer``."""

    def _load(self) -> None:
        w, spec = self.workload, self.spec
        assert spec.recipe is not None  # a farm spec names its recipe
        self.recipe = adapter.farm_recipe(spec.recipe, spec.options, self.profile, w.model)
        self.batch_invariant = (adapter.default_batch_invariant(self.recipe)
                                if spec.batch_invariant is None else spec.batch_invariant)
        self.pipe, self.renderer, report = adapter.load_farm(w.model, self.recipe, self.device,
                                                             self.batch_invariant, w.cache_dir)
        self.report = report
        self.threads = self.recipe.num_threads or torch.get_num_threads()
        self.dtype = self.recipe.dtype
        self.approximations = self.recipe.approximations()
        self.resolved = self.recipe.name + (", batch-invariant kernels" if self.batch_invariant else "")

    def _call(self, prompts, seeds, on_step):
        w = self.workload
        return adapter.render_farm(self.renderer, prompts, seeds, w.width, w.height, w.steps, w.guidance_scale,
                                   on_step=on_step)

    def close(self) -> None:
        self.renderer = None
        super().close()


def load_subject(spec: BenchSpec, workload: Workload, profile: DeviceProfile) -> Subject:
    """Build and load the subject ``spec`` names. Raises what loading raises (ValueError for a bad
    recipe or dtype, ModuleNotFoundError for a missing optional package)."""
    cls = FarmSubject if spec.kind == "farm" else DiffusersSubject
    return cls(spec, workload, profile).load()


def timed_render(subject: Subject, seeds: list[int], on_step: OnStep | None = None):
    """Render once inside a timer and a memory window: (images, DeviceTimer, MemoryWindow)."""
    with MemoryWindow(subject.device) as memory, DeviceTimer(subject.device) as timer:
        images = subject.render(seeds, on_step)
    return images, timer, memory


def wall_clock() -> float:
    """Seconds since the epoch (for the run's total duration)."""
    return time.time()
