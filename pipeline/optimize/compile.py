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
compile took 77–82 s (README, "What the lent H100 measured"). ``compile_dynamic`` stays a knob.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from pipeline.optimize.quantize import Skip


def compile_pipeline(pipe, denoiser_name: str, *, denoiser: bool, vae: bool, regional: bool, dynamic: bool,
                     mode: str, device: str | None):
    """Compile as asked; returns ``{"mode", "dynamic", "modules"}`` or a :class:`Skip`."""
    kind = (device or str(getattr(pipe, "device", "cpu"))).partition(":")[0]
    if kind == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
        return Skip("torch.compile on the CPU needs a C++ compiler (g++/clang++); none on PATH")
    if kind in ("cuda", "xpu") and importlib.util.find_spec("triton") is None:
        return Skip(f"torch.compile on {kind} needs triton; not installed")
    options = {"mode": mode, "dynamic": bool(dynamic)}  # False: static shapes, never automatic dynamism
    done, failed = [], {}

    def attempt(label: str, fn) -> None:  # one module failing to compile must not take the other with it
        try:
            fn()
            done.append(label)
        except Exception as exc:
            failed[label] = f"{type(exc).__name__}: {exc}"

    if denoiser:
        model = getattr(pipe, denoiser_name)
        if regional and getattr(model, "_repeated_blocks", None):
            attempt(f"{denoiser_name} (regional: {', '.join(model._repeated_blocks)})",
                    lambda: model.compile_repeated_blocks(**options))
        else:
            attempt(denoiser_name, lambda: model.compile(**options))
    if vae and hasattr(getattr(pipe, "vae", None), "decoder"):
        attempt("vae.decoder", lambda: pipe.vae.decoder.compile(**options))
    if not done:
        return Skip("; ".join(f"{k}: {v}" for k, v in failed.items()) or "nothing to compile")
    return {"mode": mode, "dynamic": dynamic, "modules": done, **({"failed": failed} if failed else {})}
