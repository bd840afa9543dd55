"""AOTInductor packages of the frozen VAE decoder on the CPU: each input shape compiled ahead of
time into a shared library, which the next worker loads instead of compiling.

Place in the data flow: :func:`pipeline.optimize.compile.compile_pipeline` installs
:class:`AotForward` as the decoder's ``forward`` → the worker's warm-up
(:func:`pipeline.warm.warm_up`) decodes at every batch bucket × size: a shape with no package yet
is exported (``torch.export.export``), compiled with Inductor freezing into a package
(``torch._inductor.aoti_compile_and_package``, PyTorch's "AOTInductor" documentation) under the
Inductor cache directory, and loaded → :mod:`pipeline.compile_cache` carries the packages to the
next worker, whose warm-up finds each one on disk and only loads it.

Why: a frozen ``torch.compile`` graph reruns TorchDynamo's trace, AOTAutograd and the freezing
passes on every start, even when Inductor's FX graph cache serves its code, because AOTAutograd's
cache refuses frozen graphs (torch 2.13, ``autograd_cache.py``: "Cannot cache a graph with
freezing enabled"). A package skips all three. Measured on a 2-vCPU AMD EPYC (family 25 model 17,
AVX-512 + AVX512_BF16), ``renderfarm bench ready --model tiny --device cpu`` (buckets 1 and 2 at
64², 1 step), two alternating runs each: the cached warm-up took 12.5 and 12.7 s with frozen
``torch.compile`` graphs, 0.7 and 0.3 s with packages; cached ready 20.4 / 22.8 s against 8.6 /
7.6 s (docs/performance/time-to-ready.md). The cold warm-up is a few seconds longer: each package also
builds its C++ wrapper.

The package holds the frozen weights, so its name is a SHA-256 over the decoder's class, its
weights (:func:`pipeline.optimize.weights_digest.update_with_weights`), the input's shape and
dtype, the torch version and the Inductor options: another fine-tune is another package. torch's
``aoti_load_package`` first asks Inductor for the CPU's vector ISA, which compiles and runs test
programs when the cache directory is new (9.0 s measured here on a fresh ``/tmp``), only to warn
on a mismatch; the compile cache's key already pins the CPU's ISA flags, so packages load through
the same native loader (``torch._C._aoti.AOTIModelPackageLoader``) directly, and through
``aoti_load_package`` where a torch lacks it.

After the warm-up (:func:`pipeline.compile_count.hold_compiled`) a shape that got no package
then runs eagerly (even when its package is on disk: no new graph in the hot path), and under
:func:`pipeline.compile_count.eager` every call does. A failed export, compile
or load logs one warning and that shape runs eagerly from then on: it never fails a render.
Under :func:`pipeline.compile_count.fail_on_recompile` a shape without a loaded package raises
instead, as TorchDynamo does there. Every call is counted (:func:`pipeline.compile_count.count_call`):
compiled when a package ran, eager when the module's own ``forward`` did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline import compile_count
from pipeline.compile_cache import AOT_PACKAGES, inductor_cache_dir
from pipeline.optimize.weights_digest import update_with_weights

log = logging.getLogger("renderfarm.worker")

#: Inductor options of every package: freezing, as for the CPU decoder under ``torch.compile``.
INDUCTOR_OPTIONS = {"freezing": True}
ShapeKey = tuple[tuple[int, ...], torch.dtype]


class _Eager(torch.nn.Module):
    """The module's own ``forward`` (its class's, past the instance attribute), for ``torch.export``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return type(self.inner).forward(self.inner, sample)


class AotForward:
    """Installed as a module's ``forward``: one AOTInductor package per input shape.

    Call with ``sample`` (a CPU tensor; for the VAE decoder ``(batch, latent_channels, height / 8,
    width / 8)``, float32 or bfloat16); returns what the module's own ``forward`` returns. A call
    with other arguments, a tensor that needs gradients, or under ``compile_count.eager()`` runs
    the module's own ``forward``. :attr:`report` lists the shapes compiled, loaded and failed.
    Raises ``RuntimeError`` for a shape without a loaded package under
    ``compile_count.fail_on_recompile()``."""

    def __init__(self, module: torch.nn.Module, label: str):
        self.module, self.label = module, label
        self.runners: dict[ShapeKey, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.failed: dict[ShapeKey, str] = {}  # keyed as runners are: a failure at one dtype is not another's
        self._weights: str | None = None
        self._lock = threading.Lock()

    def __call__(self, sample: Any, *args: Any, **kwargs: Any) -> Any:
        if args or any(v is not None for v in kwargs.values()) or not isinstance(sample, torch.Tensor) \
                or sample.device.type != "cpu" or (sample.requires_grad and torch.is_grad_enabled()) \
                or compile_count.stance() == "force_eager":
            compile_count.count_call(compiled=False)
            return type(self.module).forward(self.module, sample, *args, **kwargs)
        key = (tuple(sample.shape), sample.dtype)
        runner = self.runners.get(key) or self._obtain(sample, key)
        compile_count.count_call(compiled=runner is not None)
        if runner is None:
            return type(self.module).forward(self.module, sample)
        return runner(sample)

    @property
    def report(self) -> dict:
        """``{"shapes": [[*shape], …], "failed": {"<shape> <dtype>": reason}}`` (JSON-able), e.g.
        ``{"2x4x8x8 float32": "RuntimeError: …"}``."""
        return {"shapes": sorted(list(shape) for shape, _ in self.runners),
                "failed": {_name(key): reason for key, reason in self.failed.items()}}

    def package_path(self, sample: torch.Tensor) -> Path:
        """Where the package for ``sample``'s shape and dtype lives:
        ``<Inductor cache directory>/aot-packages/<label>-<32 hex digits>.pt2``."""
        if self._weights is None:
            weights = hashlib.sha256()
            update_with_weights(weights, self.module)
            self._weights = weights.hexdigest()
        fields = {"class": type(self.module).__name__, "weights": self._weights, "shape": list(sample.shape),
                  "dtype": str(sample.dtype), "torch": torch.__version__, "options": INDUCTOR_OPTIONS}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
        return inductor_cache_dir() / AOT_PACKAGES / f"{self.label}-{digest}.pt2"

    def _obtain(self, sample: torch.Tensor, key: ShapeKey):
        shape = "x".join(map(str, key[0]))
        with self._lock:
            if key in self.runners or key in self.failed:
                return self.runners.get(key)
            if compile_count.stance() == "fail_on_recompile":
                raise RuntimeError(f"AOTInductor: no package loaded for {self.label} at {_name(key)}, and the stance "
                                   "is fail_on_recompile")
            if compile_count.stance() != "default":  # held after the warm-up: no new graph
                return None
            try:
                path = self.package_path(sample)
                if path.is_file():
                    self.runners[key] = _load(path)
                    compile_count.count_aot(compiled=False, path=path)
                    log.info("AOTInductor package loaded: %s %s (%s)", self.label, shape, path.name)
                else:
                    started = time.perf_counter()
                    self.runners[key] = _load(compile_package(self.module, sample, path))
                    compile_count.count_aot(compiled=True, path=path)
                    log.info("AOTInductor package compiled: %s %s in %.1fs (%s)", self.label, shape,
                             time.perf_counter() - started, path.name)
            except Exception as exc:  # export, compile or load: this shape runs eagerly from now on
                self.failed[key] = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("AOTInductor: %s at %s runs eagerly: %s", self.label, _name(key), self.failed[key])
            return self.runners.get(key)


def _name(key: ShapeKey) -> str:
    """A shape and dtype as the report and the log name them, e.g. ``2x4x8x8 float32``."""
    return f"{'x'.join(map(str, key[0]))} {str(key[1]).removeprefix('torch.')}"


def compile_package(module: torch.nn.Module, sample: torch.Tensor, path: Path) -> Path:
    """Export ``module`` at ``sample``'s shape (static) and compile it into the package ``path``
    (written under a temporary name, then renamed, so a reader never sees half a file); returns
    ``path``. Raises whatever ``torch.export`` or Inductor raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        exported = torch.export.export(_Eager(module).eval(), (sample,), strict=False)
        partial = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                 inductor_configs=dict(INDUCTOR_OPTIONS))
    os.replace(partial, path)
    return path


def _load(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable running the package at ``path`` on one tensor."""
    native = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if native is None:
        model = torch._inductor.aoti_load_package(str(path))
        return lambda sample: model(sample)
    loader = native(str(path), "model", False, 1, -1)  # model name, single-threaded, runners, device index

    def run(sample: torch.Tensor) -> torch.Tensor:
        return loader.run([sample])[0]

    return run


def install(module: torch.nn.Module, label: str) -> AotForward:
    """Make ``module.forward`` an :class:`AotForward` (an instance attribute, as ``torch.compile``
    of a forward does); returns it."""
    forward = AotForward(module, label)
    module.forward = forward
    return forward


__all__ = ["INDUCTOR_OPTIONS", "AotForward", "compile_package", "install"]
