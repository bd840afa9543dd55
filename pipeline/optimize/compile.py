"""torch.compile of the denoiser (whole, or its repeated blocks) and the VAE decoder.

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`compile_pipeline` (here),
last, after placement. Compilation is lazy: it happens at the worker's warm-up renders.

Regional compilation (diffusers' ``compile_repeated_blocks``: FLUX's double and single blocks,
SD3's and ERNIE-Image's transformer blocks) compiles one block graph and reuses it for every
block: seconds instead of minutes of Inductor work, about the same speed. Shapes: static
(``dynamic=False``) unless ``compile_dynamic``: one graph per batch bucket × declared image size,
each compiled at the worker's warm-up (:func:`pipeline.warm.warm_up`), after which a shape no graph
matches runs eagerly instead of recompiling (:func:`pipeline.compile_count.hold_compiled`). On one
H100, ``dynamic=True`` had not finished compiling the SD 1.5 UNet after six minutes where a static
compile took 77–82 s (docs/performance/gpu.md, "One NVIDIA H100 80GB, 2026-11-23"). ``compile_dynamic`` stays a knob.

CUDA graphs (``compile_mode`` ``reduce-overhead`` or ``max-autotune`` on CUDA): a replay overwrites
the previous replay's outputs, while schedulers keep earlier noise predictions between steps
(DPM-Solver++ and UniPC keep ``model_outputs``) and a sliced VAE decode keeps each slice until the
concatenation. So the module's ``forward`` is compiled (not its whole call), and hooks outside the
compiled region mark a new step before every call (``torch.compiler.cudagraph_mark_step_begin()``)
and clone the outputs after it: the two remedies PyTorch's CUDAGraph Trees documentation gives.
Regional compilation runs without CUDA graphs (:func:`regional_mode`): one block graph replayed for
every block overwrites the block before it while the next block still reads it (seen on an H200:
FLUX's ``hidden_states + ff_output`` "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"); the VAE decoder keeps them.

Freezing on the CPU (Inductor's ``freezing``, the setting PyTorch's "Inductor CPU backend" tutorial
recommends for inference): the VAE decoder's weights become constants, so its oneDNN convolutions
get prepacked weights. Measured on a 2-vCPU AVX2-only AMD EPYC, sd15-arch decoder at 32×32 latents,
float32, medians of 3 (s per call, batch 1 / 4): eager 6.36 / 25.5, Inductor 6.47 / 22.7, Inductor
with freezing 5.77 / 21.7 (1.10× / 1.18× eager; max difference 5.7e-5). A frozen graph reads the
module's weights when it is built, from the module and not from the FX graph cache (a cache hit
after changing a bias gave the changed output), so the compile cache still serves it. Only the
decoder is frozen: a LoRA hot-swap rewrites the denoiser's weights in place, which a frozen graph
would not see. With static shapes the frozen decoder is compiled ahead of time instead (the
recipe's ``compile_aot``, on by default): one AOTInductor package per shape, which a worker that
restored the compile cache loads without TorchDynamo's trace, AOTAutograd or the freezing passes
(:mod:`pipeline.optimize.aot`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from pipeline.optimize.aot import install as install_aot
from pipeline.optimize.quantize import Skip

CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


#: What the child process of :func:`start_compiler_warm_up` runs: one tiny pointwise kernel,
#: compiled and run, which makes Inductor check the CPU's vector ISAs and build its precompiled
#: C++ header with the same flags as every CPU kernel of this process.
_WARM_COMPILER = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "torch.compile(lambda x: x * 2.0 + 1.0, dynamic=False)(torch.ones(64))\n"
)


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler for Inductor's CPU kernels is on PATH (``$CXX``, g++, c++ or clang++)."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))


def start_compiler_warm_up() -> subprocess.Popen:
    """Start a child process that readies Inductor's C++ toolchain for this worker; returns it.

    Before its first CPU kernel, Inductor checks each vector ISA the CPU reports by compiling and
    loading a test program, and builds a precompiled header of its C++ prelude (about 156 MB,
    under the default temporary directory), even when every kernel is already compiled (the
    compile cache restores the kernels, not these; after a hit the warm-up skips the header:
    :func:`without_precompiled_headers`). On a new replica, with an empty ``/tmp``, that
    was most of a cached warm-up (tiny, two buckets, 2-vCPU AMD EPYC: 24.9 s cached start with
    it, 16.0 s without precompiled headers). The child compiles one tiny kernel with the same
    Inductor settings, so it builds the same test programs and header into the same directories
    (``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` are inherited; Inductor file-locks both), while
    this process loads the pipeline. The compiler runs outside this process and its GIL. Nothing
    waits for the child: if it fails or is late, Inductor does the same work at its first
    compile, as it would without it. A daemon thread reaps the child when it exits; the caller
    may also ``wait()`` for it, or stop it when nothing will compile
    (:func:`stop_compiler_warm_up`, after a compile-cache hit). The child leads a process group
    of its own, so that stopping it reaches the ``g++`` it runs; it is also stopped when this
    process exits normally, while still running.
    """
    child = subprocess.Popen([sys.executable, "-c", _WARM_COMPILER], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    threading.Thread(target=child.wait, name="compiler-warm-up-reaper", daemon=True).start()
    atexit.register(stop_compiler_warm_up, child)
    return child


def stop_compiler_warm_up(child: subprocess.Popen | None) -> str:
    """Stop the child of :func:`start_compiler_warm_up` and every compiler it runs; returns
    ``"stopped"``, ``"finished"`` (it had already exited) or ``"none"`` (``child`` is None).

    After a compile-cache hit no kernel compiles, so the header the child builds (one ``g++``
    call of 10 to 40 s on a 2-vCPU machine) would only take a core from the warm-up and the first
    batches (``tiny``'s cached start on a 2-vCPU AMD EPYC: 10.9 s of machine CPU with the stop,
    24.4 s without; docs/performance/time-to-ready.md). SIGTERM goes
    to the child's whole process group: the ``g++`` driver deletes the output it has not finished
    on that signal, so no half-written precompiled header is left for Inductor, which builds the
    header only when its file is missing (torch 2.13's ``torch/_inductor/codecache.py``,
    ``_precompile_header``). Never SIGKILL, which would leave that partial file. Never raises.
    """
    if child is None:
        return "none"
    if child.poll() is not None:
        return "finished"
    try:
        os.killpg(child.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):  # exited (and reaped) since the poll above
        return "finished"
    return "stopped"


def _no_precompiled_header(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def without_precompiled_headers() -> Iterator[bool]:
    """Inside: Inductor attaches no precompiled C++ header to its CPU kernels; yields whether it
    could turn them off (False with a torch that has no such step: nothing changes).

    For a warm-up after a compile-cache hit (:func:`pipeline.ready.get_ready`). Every kernel's
    ``.so`` is then restored, yet before Inductor checks that a kernel's binary exists it
    preprocesses its C++ prelude and builds (or waits for) a precompiled header of it: about
    156 MB of ``g++`` output that no compile will use (read from torch 2.13's
    ``torch/_inductor/codecache.py``, ``CppCodeCache.load_async`` and ``_precompile_header``). The
    kernel's cache key is computed before the header is attached, so the same binaries load, and
    Inductor's config, part of the FX graph cache key, is untouched. A kernel that still has to
    compile in here compiles without the header: slower, same result. Measured on a 2-vCPU AMD
    EPYC (family 26, AVX-512 + AVX512_BF16), ``tiny``, buckets 1 and 2 at 64², cached phase of
    ``bench ready`` (unfrozen decoder), two rounds each: warm-up 7.1 s → 3.2 s, ready 12.3 s → 8.4 s.
    """
    from torch._inductor import codecache

    original = getattr(codecache, "_precompile_header", None)
    if original is None:
        yield False
        return
    setattr(codecache, "_precompile_header", _no_precompiled_header)  # noqa: B010  # a private function
    try:
        yield True
    finally:
        setattr(codecache, "_precompile_header", original)  # noqa: B010


#: Inductor options that keep GEMM lowering to ATen's kernels (cuBLAS / cuBLASLt), benchmarking
#: nothing: the fp8 ``_scaled_mm`` lowering tries Triton templates even outside max-autotune
#: (``use_triton_template(..., check_max_autotune=False)`` in ``torch/_inductor/kernel/mm.py``).
ATEN_GEMMS = {"max_autotune_gemm_backends": "ATEN"}


def compile_kwargs(mode: str, dynamic: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``torch.compile`` keyword arguments for ``mode`` plus the Inductor options ``extra``.
    ``torch.compile`` takes a mode or options, not both; a mode is a set of options
    (``torch._inductor.list_mode_options``: ``reduce-overhead`` is ``triton.cudagraphs``), so
    with ``extra`` the mode is spelled as its options."""
    if not extra:
        return {"mode": mode, "dynamic": dynamic}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode, dynamic), **extra}, "dynamic": dynamic}


def compile_pipeline(pipe, denoiser_name: str, *, denoiser: bool, vae: bool, regional: bool, dynamic: bool,
                     mode: str, device: str | None, freeze: bool = True, aot: bool = True,
                     gemm_autotune: bool = True):
    """Compile as asked; returns ``{"mode", "dynamic", "modules"}`` or a :class:`Skip`.

    ``freeze``: Inductor freezing for the VAE decoder where it applies (the CPU, ``default`` mode;
    the recipe's ``compile_freeze``); the report's ``frozen`` lists the frozen modules. ``aot``
    (the recipe's ``compile_aot``): a frozen decoder with static shapes is compiled ahead of time,
    one AOTInductor package per shape (:mod:`pipeline.optimize.aot`), which a later worker loads
    without tracing; the report's ``aot`` lists those modules. ``gemm_autotune`` false (the
    recipe's ``compile_gemm_autotune``): GEMMs lower to ATen's kernels without benchmarking
    (:data:`ATEN_GEMMS`), the report's ``inductor`` says so."""
    kind = (device or str(getattr(pipe, "device", "cpu"))).partition(":")[0]
    if kind == "cpu" and not has_cpp_compiler():
        return Skip("torch.compile on the CPU needs a C++ compiler (g++/clang++); none on PATH")
    if kind in ("cuda", "xpu") and importlib.util.find_spec("triton") is None:
        return Skip(f"torch.compile on {kind} needs triton; not installed")
    extra = None if gemm_autotune else ATEN_GEMMS
    # dynamic False: static shapes, never automatic dynamism
    options: dict[str, Any] = compile_kwargs(mode, bool(dynamic), extra)
    done, failed = [], {}
    graphs = kind == "cuda" and mode in CUDAGRAPH_MODES

    freeze = freeze and kind == "cpu" and mode == "default"
    aot = aot and freeze and not dynamic

    def whole(module, frozen: bool = False) -> None:
        if graphs:  # compile forward only, so that the step mark and the clone run outside the graph
            module.forward = torch.compile(module.forward, **options)
            cudagraph_safe(module)
        elif frozen and aot:
            install_aot(module, "vae-decoder")
        elif frozen:  # freezing happens in "default" mode only, which has no options of its own
            module.compile(dynamic=options["dynamic"], options={"freezing": True, **(extra or {})})
        else:
            module.compile(**options)

    def attempt(label: str, fn) -> None:  # one module failing to compile must not take the other with it
        try:
            fn()
            done.append(label)
        except Exception as exc:
            failed[label] = f"{type(exc).__name__}: {exc}"

    notes: dict[str, Any] = {}
    if denoiser:
        model = getattr(pipe, denoiser_name)
        if regional and getattr(model, "_repeated_blocks", None):
            block_mode, why = regional_mode(mode, graphs)
            if why:
                notes["regional_mode"] = f"{block_mode}: {why}"
            attempt(f"{denoiser_name} (regional: {', '.join(model._repeated_blocks)})",
                    lambda: model.compile_repeated_blocks(**compile_kwargs(block_mode, bool(dynamic), extra)))
        else:
            attempt(denoiser_name, lambda: whole(model))
            canonical_call(model)
    if vae and hasattr(getattr(pipe, "vae", None), "decoder"):
        attempt("vae.decoder", lambda: whole(pipe.vae.decoder, frozen=freeze))
        if freeze and "vae.decoder" in done:
            notes["frozen"] = ["vae.decoder"]
            if aot:
                notes["aot"] = ["vae.decoder"]
    if not done:
        return Skip("; ".join(f"{k}: {v}" for k, v in failed.items()) or "nothing to compile")
    if extra:
        notes["inductor"] = extra
    return {"mode": mode, "dynamic": dynamic, "modules": done, "cuda_graphs": graphs, **notes,
            **({"failed": failed} if failed else {})}


def canonical_call(module) -> None:
    """Call ``module`` (a ``torch.nn.Module``: the wholly compiled denoiser) the same way for the
    same inputs, whichever pipeline calls it: a forward pre-hook, which runs before the compiled
    frame (idempotent), hands it every tensor argument (and each tensor of a list or tuple
    argument, such as ControlNet residuals) in PyTorch's contiguous layout, that of the drawn noise
    every warm-up render starts from, and drops the keyword arguments passed as None whose default
    in ``forward`` is None (passing them or not is the same call).

    TorchDynamo's guards check both, and both differ between diffusers' pipelines where the inputs
    do not: img2img's latents come out of the VAE encoder in channels-last strides on the CPU (a
    2×4×8×8 batch of the tiny model had strides (256, 1, 32, 4), the drawn noise (256, 64, 8, 1)),
    and so do the residuals a ControlNet computes from them; ``StableDiffusionControlNetImg2ImgPipeline``
    passes no ``timestep_cond`` where the txt2img ControlNet pipeline passes ``timestep_cond=None``.
    Without this, every img2img call, with ControlNet units or without, matched no warm-up graph and
    ran the UNet's Python once the graphs were held. Costs one copy of each tensor that is not
    contiguous, per call; none otherwise."""
    if getattr(module, "_renderfarm_canonical_call", False):
        return
    import inspect

    none_by_default = {name for name, p in inspect.signature(module.forward).parameters.items() if p.default is None}

    @torch.compiler.disable  # the compiled module's frame starts after it: never a graph of its own
    def hook(_module, args: tuple, kwargs: dict):
        kwargs = {k: _contiguous(v) for k, v in kwargs.items() if v is not None or k not in none_by_default}
        return tuple(_contiguous(a) for a in args), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
    module._renderfarm_canonical_call = True


def _contiguous(value: Any) -> Any:
    """``value`` with a tensor, or each tensor of a list or tuple, made contiguous (the same object
    where it already is)."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(v.contiguous() if isinstance(v, torch.Tensor) else v for v in value)
    return value


REGIONAL_VS_CUDA_GRAPHS = (
    "CUDA graphs off for the repeated blocks: one block graph replayed for every block overwrites the "
    "output the next block reads")


def regional_mode(mode: str, cuda_graphs: bool) -> tuple[str, str | None]:
    """The ``torch.compile`` mode for regionally compiled blocks, and why it differs from ``mode``.

    With CUDA graphs (``cuda_graphs`` true: ``mode`` in :data:`CUDAGRAPH_MODES` on CUDA) the blocks
    compile in ``default`` mode (or ``max-autotune-no-cudagraphs`` for ``max-autotune``): CUDAGraph
    Trees give every replay of one graph the same output buffers, and the blocks of a transformer
    are one graph called in a row, so a block's output would be overwritten by the next block's
    replay before the block after it reads it. Returns ``(mode, None)`` when nothing changes."""
    if not cuda_graphs:
        return mode, None
    return ("max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"), REGIONAL_VS_CUDA_GRAPHS


def cudagraph_safe(module: torch.nn.Module) -> torch.nn.Module:
    """Hooks on ``module`` (outside its compiled ``forward``) for CUDA-graph replays: before each
    call ``torch.compiler.cudagraph_mark_step_begin()``; after it, every output tensor cloned (a
    tensor, a tuple or list of them, or a diffusers ``BaseOutput`` such as ``sample``), so that a
    later replay cannot overwrite what the scheduler kept. Returns ``module``."""
    def begin(_module, _args) -> None:
        torch.compiler.cudagraph_mark_step_begin()

    def clone(_module, _args, output: Any) -> Any:
        return _cloned(output)

    module.register_forward_pre_hook(begin)
    module.register_forward_hook(clone)
    return module


def _cloned(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, (tuple, list)):
        return type(output)(_cloned(o) for o in output)
    if hasattr(output, "keys") and hasattr(output, "__setitem__"):  # diffusers BaseOutput (an OrderedDict)
        for key in list(output.keys()):
            output[key] = _cloned(output[key])
        return output
    return output
