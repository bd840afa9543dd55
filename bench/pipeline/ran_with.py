"""What a bench row actually ran with, read back from the loaded objects, never from constants.

Place in the data flow: :mod:`bench.pipeline.side_by_side` calls :func:`observe` once per row after its
settle call (every graph compiled, CUDA graphs recorded) and stores the answer under the row's
report, ``observed``. A reviewer then reads the scheduler, the attention processors, the SDPA
backends, each compiled region with the Inductor options its backend carries, the Inductor
settings in force while the row rendered (the peer's tutorial flags, or their absence) and
whether CUDA graphs were recorded, from the JSON.

How each fact is read:

* ``scheduler``: the class of ``pipe.scheduler`` (the farm's precomputed twins are their own
  classes, :mod:`pipeline.scheduling`).
* ``attention``: the classes of the denoiser's ``attn_processors`` and, for diffusers' attention
  dispatcher, each processor's ``_attention_backend``; ``sdpa_enabled`` (CUDA): the
  ``torch.backends.cuda.*_sdp_enabled()`` flags read inside the row's render context, so a pinned
  backend (``sdpa=cudnn``) shows as the only one on.
* ``compiled``: every ``torch.compile`` region found on the pipeline's modules (a wrapped module,
  a module compiled in place, a compiled ``forward`` or method, a repeated block), grouped by
  where it is and the options of its Inductor backend (``torch._TorchCompileInductorWrapper.config``:
  a mode is a set of options, e.g. ``reduce-overhead`` = ``triton.cudagraphs``); AOTInductor
  packages and OpenVINO-compiled modules by their runtime.
* ``inductor``: the Inductor settings that change generated code, read from
  ``torch._inductor.config`` inside the row's render context.
* ``cuda_graphs``: graphs recorded by CUDAGraph Trees on the row's device (root and child nodes of
  the tree manager) and Inductor's ``cudagraph_skips`` counter; None off CUDA.

Every reader is guarded: a private attribute that moved in another PyTorch release gives
``{"unreadable": reason}`` for that fact, never an exception.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from typing import Any

import torch

#: Inductor settings recorded per row: the tutorial's four flags, the mode options, the GEMM
#: backends autotuned (``ATEN`` alone: one cuBLAS/cuBLASLt choice, nothing benchmarked) and freezing.
INDUCTOR_KEYS = ("conv_1x1_as_mm", "coordinate_descent_tuning", "epilogue_fusion",
                 "coordinate_descent_check_all_directions", "max_autotune", "max_autotune_gemm",
                 "max_autotune_gemm_backends", "freezing", "triton.cudagraphs")


def _guarded(read) -> Any:
    try:
        return read()
    except Exception as e:  # a private attribute of another torch release: say so, keep the row
        return {"unreadable": f"{type(e).__name__}: {e}"}


def _config_value(config, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def inductor_settings() -> dict[str, Any]:
    """The values of :data:`INDUCTOR_KEYS` in ``torch._inductor.config`` now (keys this torch lacks
    are left out)."""
    import torch._inductor.config as inductor

    out = {}
    for key in INDUCTOR_KEYS:
        with contextlib.suppress(AttributeError):
            out[key] = _config_value(inductor, key)
    return out


def _backend_of(obj) -> dict[str, Any] | None:
    """The compile settings of a ``torch.compile`` result (an ``OptimizedModule`` or a compiled
    function), or None when ``obj`` is not one."""
    from torch._dynamo.eval_frame import OptimizeContext, innermost_backend

    ctx = getattr(obj, "dynamo_ctx", None)
    if ctx is None and getattr(obj, "_is_torch_compile", False):
        ctx = next((c.cell_contents for c in (obj.__closure__ or ())
                    if isinstance(c.cell_contents, OptimizeContext)), None)
    if ctx is None:
        return None
    backend = innermost_backend(ctx.callback)
    options = dict(getattr(backend, "config", None) or {})
    return {"backend": getattr(backend, "compiler_name", type(backend).__name__), "mode": mode_of(options),
            "options": options, "dynamic": getattr(backend, "dynamic", None),
            "fullgraph": getattr(ctx, "fullgraph", None)}


def mode_of(options: dict[str, Any]) -> str:
    """The ``torch.compile`` mode whose options ``options`` contain (``default`` when none is), by
    ``torch._inductor.list_mode_options``; extra options are named with a ``+``."""
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    best = max((m for m, opts in modes.items() if m != "lite" and opts.items() <= options.items()),
               key=lambda m: len(modes[m]), default="default")
    extra = sorted(set(options) - set(modes[best]))
    return best + "".join(f"+{k}={options[k]}" for k in extra)


def _regions(name: str, module: torch.nn.Module) -> list[tuple[str, str, dict | None]]:
    """(where, how, backend) of each compiled region under ``module``."""
    found = []
    wrapped = {id(m._orig_mod) for m in module.modules() if hasattr(m, "_orig_mod")}
    for path, m in module.named_modules():
        where = f"{name}.{path}" if path else name
        attrs = vars(m)
        if hasattr(m, "_orig_mod") and hasattr(m, "dynamo_ctx"):
            found.append((where, "torch.compile(module)", _backend_of(m)))
        compiled_call = attrs.get("_compiled_call_impl")
        if compiled_call is not None and id(m) not in wrapped:
            found.append((where, "module.compile()", _backend_of(compiled_call)))
        for attr in ("forward", "decode", "encode") if not hasattr(m, "_orig_mod") else ():
            fn = attrs.get(attr)  # (an OptimizedModule's own forward is its compiled call: counted above)
            if fn is None:
                continue
            if getattr(fn, "_is_torch_compile", False):
                found.append((f"{where}.{attr}", "torch.compile(method)", _backend_of(fn)))
            elif type(fn).__name__ == "AotForward":
                found.append((f"{where}.{attr}", "AOTInductor package", None))
        runtime = getattr(m, "runtime", None)
        if runtime:  # a component (the OpenVINO UNet) or a part of one (its VAE decoder)
            found.append((where, f"runtime {runtime}", None))
    return found


def compiled_regions(pipe) -> list[dict[str, Any]]:
    """Every compiled region of ``pipe``'s modules, grouped: ``{"where", "how", "count", "backend"}``
    (repeated blocks are one group: ``where`` has ``*`` for the block index, ``count`` their number)."""
    groups: dict[tuple, dict] = {}
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        for where, how, backend in _regions(name, module):
            pattern = re.sub(r"\.\d+(?=\.|$)", ".*", where)
            group = groups.setdefault((pattern, how, repr(backend)),
                                      {"where": pattern, "how": how, "count": 0, "backend": backend})
            group["count"] += 1
    return list(groups.values())


def attention(pipe) -> dict[str, Any]:
    """The denoiser's attention processor classes (count of each) and dispatcher backends."""
    from bench.pipeline.render_probes import denoiser_attr, inner_module

    denoiser = inner_module(getattr(pipe, denoiser_attr(pipe)))
    processors = getattr(denoiser, "attn_processors", None) or {}
    classes = Counter(type(p).__name__ for p in processors.values())
    backends = Counter(str(getattr(p, "_attention_backend", None)) for p in processors.values()
                       if getattr(p, "_attention_backend", None) is not None)
    return {"processors": dict(classes), **({"dispatch_backends": dict(backends)} if backends else {})}


def sdpa_enabled(device: str) -> dict[str, bool] | None:
    """Which PyTorch SDPA backends may run now (CUDA; None elsewhere)."""
    if not device.startswith("cuda"):
        return None
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def cudagraph_skips() -> int:
    """Inductor's ``cudagraph_skips`` counter (graphs it declined to record, process-wide)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def cuda_graphs_recorded(device: str) -> int | None:
    """CUDA graphs CUDAGraph Trees recorded on ``device`` so far (tree nodes); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch._inductor import cudagraph_trees

    index = torch.device(device).index
    manager = cudagraph_trees.get_manager(torch.cuda.current_device() if index is None else index,
                                          create_if_none_exists=False)
    if manager is None:
        return 0
    count, stack = 0, list(manager.get_roots())
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(child for children in node.children.values() for child in children)
    return count


def observe(pipe, device: str, render_context=contextlib.nullcontext, skips_before: int | None = None) -> dict:
    """What ``pipe`` runs with on ``device`` (see the module docstring). ``render_context``: a
    callable giving the context the row renders in (its SDPA pin, the peer's Inductor flags);
    ``skips_before``: :func:`cudagraph_skips` before the row's first render, for the row's own skips."""
    with render_context():
        inductor = _guarded(inductor_settings)
        sdpa = _guarded(lambda: sdpa_enabled(device))
    skips = _guarded(cudagraph_skips)
    return {
        "scheduler": type(pipe.scheduler).__name__,
        "attention": _guarded(lambda: attention(pipe)),
        "sdpa_enabled": sdpa,
        "compiled": _guarded(lambda: compiled_regions(pipe)),
        "inductor": inductor,
        "cuda_graphs": None if not device.startswith("cuda") else {
            "recorded": _guarded(lambda: cuda_graphs_recorded(device)),
            "skips": skips - skips_before if isinstance(skips, int) and skips_before is not None else skips},
    }
