"""Probes around one render: count denoiser calls, count their FLOPs, mark steps for the profiler.

Place in the data flow: :mod:`bench.pipeline.side_by_side` and :mod:`bench.pipeline.profile` wrap a
subject's render in these context managers; nothing here changes what the pipeline computes.

The denoiser (``pipe.unet`` or ``pipe.transformer``) is wrapped from the outside: for the one
render, the pipeline's attribute points at a :class:`_Proxy` that calls the real module (plain,
in-place compiled or ``torch.compile``-wrapped alike) between two callbacks. The module itself
is never touched, so no ``torch.compile`` guard sees a change and nothing recompiles.
``scheduler.step`` and ``scheduler.scale_model_input`` are wrapped as instance attributes of the
same scheduler object and removed afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DENOISERS = ("unet", "transformer")


def denoiser_attr(pipe) -> str:
    """The pipeline attribute that holds the denoiser: ``"unet"`` or ``"transformer"``.

    Raises:
        ValueError: the pipeline has neither.
    """
    for name in DENOISERS:
        if getattr(pipe, name, None) is not None:
            return name
    raise ValueError(f"{type(pipe).__name__} has no unet or transformer")


def inner_module(module):
    """The module under a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``), else itself."""
    return getattr(module, "_orig_mod", module)


class _Proxy:
    """Stands in for a pipeline attribute: calls go to ``inner`` inside ``around()``; every other
    attribute (``config``, ``dtype``, …) is read from ``inner``."""

    def __init__(self, inner, around: Callable[[], contextlib.AbstractContextManager]):
        self.__dict__["_inner"] = inner
        self.__dict__["_around"] = around

    def __call__(self, *args, **kwargs):
        with self._around():
            return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)


@contextlib.contextmanager
def wrap_call(obj, name: str, around: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """For the ``with`` block, calls of ``obj.<name>(…)`` run inside ``around()``.

    A pipeline component is swapped with ``object.__setattr__`` (diffusers' own ``__setattr__``
    would re-register it); a method (``scheduler.step``) is shadowed by an instance attribute.
    """
    original = getattr(obj, name)
    shadowed = name in vars(obj)
    object.__setattr__(obj, name, _Proxy(original, around))
    try:
        yield
    finally:
        if shadowed:
            object.__setattr__(obj, name, original)
        else:
            object.__delattr__(obj, name)


@dataclass
class RenderCount:
    """What one render did: FLOPs in total and by top-level module class, the denoiser's FLOPs
    and how many times it was called (one call per step with classifier-free guidance batched)."""

    flops: float = 0.0
    by_module: dict[str, float] = field(default_factory=dict)
    denoiser_flops: float = 0.0
    denoiser_calls: int = 0


def flop_mapping() -> dict:
    """FLOP formulas for ops that ``torch.utils.flop_counter`` does not count: the CPU's oneDNN
    convolution (the batch-invariant path of :mod:`pipeline.invariance`) and SDPA kernel, and
    ``aten._int_mm`` (int8 matmul, SDNQ's quantized matmul): 2·M·N·K."""
    from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

    def mkldnn_conv(x_shape, w_shape, *args, out_shape=None, **kwargs):
        return conv_flop_count(x_shape, w_shape, out_shape, transposed=False)

    def sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def int_mm(a_shape, b_shape, *args, out_shape=None, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    aten = torch.ops.aten
    mapping: dict[Any, Callable[..., Any]] = {aten.mkldnn_convolution: mkldnn_conv, aten._int_mm: int_mm}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_cpu
    return mapping


def _eager():
    """Run ``torch.compile``d code eagerly (no compile, no recompile): FLOP counting needs the ops."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def count_render(pipe, render: Callable[[], object], flops: bool = True) -> RenderCount:
    """Run ``render()`` once, eagerly; count the denoiser's calls and, with ``flops``, the FLOPs
    of the whole render and of the denoiser.

    Source of the counter: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions
    and attention kernels; elementwise ops count 0), extended by :func:`flop_mapping`.
    """
    from torch.utils.flop_counter import FlopCounterMode

    count = RenderCount()

    def counter(depth: int):
        if not flops:
            return contextlib.nullcontext()
        return FlopCounterMode(display=False, depth=depth, custom_mapping=flop_mapping())

    @contextlib.contextmanager
    def in_denoiser():  # a fresh counter per call: FlopCounterMode clears its counts on entry
        count.denoiser_calls += 1
        with counter(0) as call:
            yield
        if call is not None:
            count.denoiser_flops += float(call.get_total_flops())

    with _eager(), counter(1) as total, wrap_call(pipe, denoiser_attr(pipe), in_denoiser):
        render()
    if total is not None:
        count.flops = float(total.get_total_flops())
        count.by_module = {k: float(sum(v.values())) for k, v in total.get_flop_counts().items()
                           if k != "Global" and "." not in k}
    return count


def module_class(module) -> str:
    """The class name of a pipeline module: under a ``torch.compile`` wrapper, the compiled
    module's; for a module compiled to another runtime (OpenVINO), the class it was made from."""
    return getattr(module, "source_class", None) or type(inner_module(module)).__name__


def architecture(pipe) -> tuple[str, ...]:
    """The classes of the pipeline's modules (see :func:`module_class`) and which runtime runs
    them: two subjects with equal architectures do the same FLOPs per render."""
    return tuple(sorted(f"{name}={module_class(m)}{'@' + str(m.runtime) if getattr(m, 'runtime', None) else ''}"
                        for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)))


def denoiser_class(pipe) -> str:
    """The class of the pipeline's denoiser (``unet`` or ``transformer``; see :func:`module_class`)."""
    return module_class(getattr(pipe, denoiser_attr(pipe)))


class StepMarks:
    """Profiler ranges around each denoising step, each denoiser call and each ``scheduler.step``.

    A step's range opens at its first ``scheduler.scale_model_input`` or denoiser call and closes
    at the pipeline's ``callback_on_step_end`` for that step (:meth:`on_step`); the latents'
    concatenation for classifier-free guidance just before it falls outside (one small kernel).
    Range names: :data:`STEP`, :data:`DENOISER`, :data:`SCHEDULER_STEP`. ``phase`` says where the
    render is now (``"denoiser"``, ``"scheduler.step"``, ``"step"`` or ``"outside"``).
    """

    STEP, DENOISER, SCHEDULER_STEP = "renderfarm/step", "renderfarm/denoiser", "renderfarm/scheduler.step"

    def __init__(self) -> None:
        self.phase = "outside"
        self.steps = 0
        self._open: torch.profiler.record_function | None = None

    def _ensure_step(self) -> None:
        if self._open is None:
            self._open = torch.profiler.record_function(self.STEP)
            self._open.__enter__()
            self.phase = "step"

    def on_step(self, *_args) -> None:
        """The pipeline finished a step: close its range."""
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
            self.steps += 1
        self.phase = "outside"

    @contextlib.contextmanager
    def _range(self, name: str, phase: str, opens_step: bool = True):
        if opens_step:
            self._ensure_step()
        outer, self.phase = self.phase, phase
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            self.phase = outer

    @contextlib.contextmanager
    def installed(self, pipe) -> Iterator[StepMarks]:
        """Wrap ``pipe``'s denoiser and scheduler for the ``with`` block; closes a dangling step."""
        scheduler = pipe.scheduler
        with contextlib.ExitStack() as stack:
            stack.enter_context(wrap_call(pipe, denoiser_attr(pipe),
                                          lambda: self._range(self.DENOISER, "denoiser")))
            stack.enter_context(wrap_call(scheduler, "step",
                                          lambda: self._range(self.SCHEDULER_STEP, "scheduler.step")))
            if hasattr(scheduler, "scale_model_input"):
                stack.enter_context(wrap_call(scheduler, "scale_model_input",
                                              lambda: self._range("renderfarm/scale_model_input", "step")))
            try:
                yield self
            finally:
                self.on_step()
