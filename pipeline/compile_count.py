"""Counting torch.compile's compilations, keeping them out of the hot path, and seeing which
calls ran compiled code.

Place in the data flow: worker start-up → :func:`pipeline.warm.warm_up` compiles every declared
shape → :func:`hold_compiled` (here) → every later render reuses those graphs or runs eagerly,
and :func:`observed` tells which (:class:`pipeline.render.Renderer` counts its renders by it).
The counts go into the worker's heartbeat (``GET /v1/workers``) and from there to the API's
``/metrics`` (``renderfarm_recompiles_total``, ``renderfarm_compiled_renders_total``,
``renderfarm_eager_renders_total``).

A compilation is counted when TorchDynamo starts one (``torch._dynamo.callback_handler``'s start
callbacks, the hook behind ``torch._dynamo.callback.on_compile_start``; one call per outermost
compilation of a frame). Inductor's FX-graph cache hits and misses come from
``torch._dynamo.utils.counters["inductor"]`` (PyTorch's "Compile time caching in torch.compile"
recipe names them), so a caller can tell a compile served from the cache from a cold one.
AOTInductor packages (:mod:`pipeline.optimize.aot`, which TorchDynamo never sees) count here
themselves, compiled or loaded (:func:`aot_packages` tells them apart), and follow the stance set
here, as TorchDynamo's graphs do.

Which code a call ran is observed, not inferred from the shapes warmed. TorchDynamo checks a
frame's guards against its compiled graphs before every call of a frame that has any, and hands
the outcome (a graph matched, or none did) to its guard-complete hook
(``torch._C._dynamo.eval_frame.set_guard_complete_hook``, the hook behind
``torch.compiler.set_enable_guard_collectives``): a match runs the compiled graph; a miss compiles
(default stance), runs the frame's Python (``eager_on_recompile``, after the warm-up) or raises
(``fail_on_recompile``). :func:`install` registers a hook that counts both and returns the outcome
unchanged (after any hook it replaced), so a miss followed by a compile is not counted as eager.
It is one Python call per compiled frame called (a regionally compiled transformer makes one per
block), in the hot path's thread: a thread-local pair of integers, no lock. Why this and not the
alternatives: a forward hook runs outside the compiled frame (``nn.Module.compile`` compiles the
``forward`` frame, not ``Module._call_impl`` that calls the hooks), so it cannot see which way the
frame went;
TorchDynamo's ``counters`` change only when it compiles; wrapping the backend's compiled function
means replacing Inductor's wrapper that ``torch.compile`` builds for its modes and options.
AOTInductor packages and OpenVINO models count their own calls (:func:`count_call`): a package
that ran, or the module's own ``forward`` in its place; an OpenVINO model always runs compiled.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("renderfarm.worker")
_lock = threading.Lock()
_state = {"compiles": 0, "aot_compiled": 0, "aot_loaded": 0}
#: The stance last set here: "default" (compile what is new), "eager_on_recompile" (held),
#: "force_eager" or "fail_on_recompile". Modules compiled ahead of time (:mod:`pipeline.optimize.aot`) follow it too.
_stance = ["default"]
_aot_paths: set[Path] = set()
_local = threading.local()  # this thread's CallCounts
#: A guard-complete hook that was registered before :func:`install`'s, called first by it.
_chained: list[Callable[[bool], bool] | None] = [None]
_warned = [False]  # install() said once that this torch cannot show TorchDynamo's hits


@dataclass
class CallCounts:
    """Calls of compiled code, by how they ran: ``compiled`` (a TorchDynamo frame whose guards
    matched one of its graphs, an AOTInductor package, an OpenVINO model) and ``eager`` (such a
    frame or module that ran its Python instead: no graph or package for these inputs while the
    graphs are held, or forced eager). ``pending``: the last TorchDynamo lookup in this thread
    missed, and a compile starting next means the frame did not run eagerly."""

    compiled: int = 0
    eager: int = 0
    pending: bool = field(default=False, compare=False)


def install() -> None:
    """Register the compile-start callback and the guard-complete hook (idempotent; cheap
    without compile).

    Registered again whenever it is missing from TorchDynamo's handler: ``torch._dynamo.reset()``
    clears every callback, so a flag alone would leave the counter silently at zero afterwards.
    With a torch whose ``torch._C._dynamo.eval_frame`` has no ``set_guard_complete_hook`` (2.13,
    the version this project installs, has it) TorchDynamo's hits and misses are not seen, and one
    warning says so; AOTInductor packages and OpenVINO models are still counted.
    """
    with _lock:
        from torch._C._dynamo import eval_frame
        from torch._dynamo import callback_handler

        if _on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_start)
        set_hook = getattr(eval_frame, "set_guard_complete_hook", None)
        if set_hook is None:
            if not _warned[0]:
                _warned[0] = True
                log.warning("this torch has no guard-complete hook: TorchDynamo's graphs are not seen serving "
                            "calls (compiled_renders / eager_renders count AOTInductor and OpenVINO only)")
        else:
            previous = set_hook(_on_guards)
            if previous is not None and previous is not _on_guards:
                _chained[0] = previous


def _counts() -> CallCounts:
    counts = getattr(_local, "counts", None)
    if counts is None:
        counts = _local.counts = CallCounts()
    return counts


def _on_start(_args) -> None:
    with _lock:
        _state["compiles"] += 1
    counts = _counts()
    if counts.pending:  # the miss that led here compiles: its frame runs the new graph
        counts.eager -= 1
        counts.pending = False


def _on_guards(hit: bool) -> bool:
    """TorchDynamo's guard-complete hook: ``hit`` is whether a compiled graph of the frame matched;
    returns it (as the hook it replaced returned it, if any). Raises only what that hook raises."""
    chained = _chained[0]
    if chained is not None:
        hit = bool(chained(hit))
    counts = _counts()
    if hit:
        counts.compiled += 1
    else:
        counts.eager += 1
    counts.pending = not hit
    return hit


def count_call(compiled: bool) -> None:
    """Count one call of a module compiled outside TorchDynamo, in this thread: ``compiled``
    (an AOTInductor package ran, an OpenVINO model ran) or not (the module's own ``forward`` ran
    in its place). :func:`observed` sees it."""
    counts = _counts()
    if compiled:
        counts.compiled += 1
    else:
        counts.eager += 1


@contextlib.contextmanager
def observed() -> Iterator[CallCounts]:
    """Inside: the calls of compiled code this thread makes are counted into the yielded
    :class:`CallCounts` (filled in on exit, also when the body raises). Needs :func:`install`
    for TorchDynamo's frames."""
    counts, seen = _counts(), CallCounts()
    compiled, eager = counts.compiled, counts.eager
    try:
        yield seen
    finally:
        seen.compiled, seen.eager = counts.compiled - compiled, counts.eager - eager


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
    """The stance last set by :func:`hold_compiled`, :func:`eager`, :func:`fail_on_recompile` or
    :func:`release_compiled`: ``"default"``, ``"eager_on_recompile"``, ``"force_eager"`` or
    ``"fail_on_recompile"``."""
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


def eager() -> contextlib.AbstractContextManager[None]:
    """Inside: compiled modules run eagerly and nothing compiles (``set_stance("force_eager")``),
    e.g. the memory measurement that sizes the batch before warm-up, whose shapes need no graph."""
    return _within_stance("force_eager")


def fail_on_recompile() -> contextlib.AbstractContextManager[None]:
    """Inside: a call that would compile raises instead of compiling or running eagerly:
    TorchDynamo's ``set_stance("fail_on_recompile")`` (its ``RuntimeError`` names the frame and
    the guards that failed), and an AOTInductor package not loaded by then raises ``RuntimeError``
    too (:mod:`pipeline.optimize.aot`). For tests that prove the warm-up compiled every shape a
    run uses; the stance before is restored on exit."""
    return _within_stance("fail_on_recompile")


@contextlib.contextmanager
def _within_stance(name: str) -> Iterator[None]:
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    before, _stance[0] = _stance[0], name
    try:
        if set_stance is None:
            yield
            return
        with set_stance(name):
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
