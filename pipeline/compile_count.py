"""Counting torch.compile's compilations, and keeping them out of the hot path.

Place in the data flow: worker start-up → :func:`pipeline.warm.warm_up` compiles every declared
shape → :func:`hold_compiled` (here) → every later render reuses those graphs or runs eagerly.
The counts go into the worker's heartbeat (``GET /v1/workers``) and from there to the API's
``/metrics`` (``renderfarm_recompiles_total``).

A compilation is counted when TorchDynamo starts one (``torch._dynamo.callback_handler``'s start
callbacks, the hook behind ``torch._dynamo.callback.on_compile_start``; one call per outermost
compilation of a frame). Inductor's FX-graph cache hits and misses come from
``torch._dynamo.utils.counters["inductor"]`` (PyTorch's "Compile time caching in torch.compile"
recipe names them), so a caller can tell a compile served from the cache from a cold one.
AOTInductor packages (:mod:`pipeline.optimize.aot`, which TorchDynamo never sees) count here
themselves, compiled or loaded (:func:`aot_packages` tells them apart), and follow the stance set
here, as TorchDynamo's graphs do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

_lock = threading.Lock()
_state = {"compiles": 0, "aot_compiled": 0, "aot_loaded": 0}
#: The stance last set here: "default" (compile what is new), "eager_on_recompile" (held) or
#: "force_eager". Modules compiled ahead of time (:mod:`pipeline.optimize.aot`) follow it too.
_stance = ["default"]
_aot_paths: set[Path] = set()


def install() -> None:
    """Register the compile-start callback (idempotent; cheap without compile).

    Registered again whenever it is missing from TorchDynamo's handler: ``torch._dynamo.reset()``
    clears every callback, so a flag alone would leave the counter silently at zero afterwards.
    """
    with _lock:
        from torch._dynamo import callback_handler

        if _on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_start)


def _on_start(_args) -> None:
    with _lock:
        _state["compiles"] += 1


def compiles() -> int:
    """Compilations started in this process: TorchDynamo's since :func:`install` (served by
    Inductor's cache or not), plus the ahead-of-time packages compiled or loaded (:func:`count_aot`)
    (an int ≥ 0)."""
    with _lock:
        return _state["compiles"]


def count_aot(compiled: bool, path: Path) -> None:
    """Count one ahead-of-time package at ``path`` (:mod:`pipeline.optimize.aot`), compiled or
    loaded from the local cache directory. Either is one of :func:`compiles`, as TorchDynamo counts
    a compilation whose code Inductor's cache serves; :func:`aot_packages` tells them apart. The
    path joins :func:`aot_package_paths`."""
    with _lock:
        _state["compiles"] += 1
        _state["aot_compiled" if compiled else "aot_loaded"] += 1
        _aot_paths.add(Path(path))


def aot_package_paths() -> list[Path]:
    """Every ahead-of-time package this process compiled or loaded (what the compile cache saves)."""
    with _lock:
        return sorted(_aot_paths)


def aot_packages() -> dict[str, int]:
    """Ahead-of-time packages in this process so far: ``{"compiled": int, "loaded": int}``."""
    with _lock:
        return {"compiled": _state["aot_compiled"], "loaded": _state["aot_loaded"]}


def stance() -> str:
    """The stance last set by :func:`hold_compiled`, :func:`eager` or :func:`release_compiled`:
    ``"default"``, ``"eager_on_recompile"`` or ``"force_eager"``."""
    return _stance[0]


def fx_graph_cache() -> dict[str, int]:
    """Inductor's FX-graph cache ``{"hits": int, "misses": int}`` in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"])}


def allow_graphs(n: int) -> None:
    """Let TorchDynamo keep at least ``n`` compiled graphs per function (one per static shape):
    its ``recompile_limit`` (8 by default) would otherwise fall back to eager past the 8th bucket × size."""
    import torch._dynamo.config as config

    config.recompile_limit = max(int(config.recompile_limit), n)


def hold_compiled() -> None:
    """From now on, a call whose shapes no compiled graph matches runs eagerly instead of compiling:
    ``torch.compiler.set_stance("eager_on_recompile")`` (PyTorch ≥ 2.6; process-wide). Graphs
    compiled before still run. Without ``set_stance`` (older PyTorch) nothing changes."""
    import torch

    _stance[0] = "eager_on_recompile"
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        set_stance("eager_on_recompile")


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Inside: compiled modules run eagerly and nothing compiles (``set_stance("force_eager")``),
    e.g. the memory measurement that sizes the batch before warm-up, whose shapes need no graph."""
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    before, _stance[0] = _stance[0], "force_eager"
    try:
        if set_stance is None:
            yield
            return
        with set_stance("force_eager"):
            yield
    finally:
        _stance[0] = before


def release_compiled() -> None:
    """Back to TorchDynamo's default stance (compile what is new); for tests and benchmarks."""
    import torch

    _stance[0] = "default"
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        set_stance("default")
