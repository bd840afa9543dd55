"""Memory: peak bytes per image, the batch size they allow, OOM recovery, allocator settings.

Place in the data flow: at start-up the worker (:mod:`pipeline.sizing`) renders batches of 1 and
2 images at the largest size its pool serves, one step, through :func:`measure_per_image` (again
with each upscaler its pool declares, the upscaling stage after the decode), turns the results into a batch size with
:func:`batch_size_for_stages` (the smallest that every path fits, capped by
``Recipe.max_batch_size``), and keeps it. When a batch still runs
out of memory:

* in the VAE decode only: :func:`guard_vae_decode` decodes that batch again one image at a time,
  so its denoising steps are kept;
* in the denoiser: :func:`render_in_parts` (the worker's render stage, :mod:`worker.render_stage`,
  renders every group through it) lowers the batch size for that shape only
  (:class:`BatchLimits`, raised back after enough successes) and renders the halves *after*
  leaving the ``except`` block (the exception's traceback holds the failed batch's tensors;
  inside the block they would stay alive while the halves render); :func:`split_on_oom` is the
  same policy for a caller that wants every result at once.

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA (and its xpu/npu twins), and the
process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``, reset through
``/proc/self/clear_refs``; ``resource.getrusage`` where that is missing) on the CPU.

Allocator (the ERNIE-Image-Turbo SDNQ uint4 model card): never ``expandable_segments`` together with
``max_split_size_mb`` (it over-reserved about 48 GiB and ran 2-4x slower), and no
``torch.cuda.empty_cache()`` between batches; after an OOM the caching allocator already frees
its cached blocks and retries before it raises, so none is needed here either.
"""

from __future__ import annotations

import logging
import re
import resource
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from pipeline.device import DeviceProfile

log = logging.getLogger("renderfarm.worker")

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
T = TypeVar("T")
R = TypeVar("R")


def _accel(kind: str):
    """torch's module of accelerator ``kind`` (``cuda``, ``xpu``, ``npu``), or None (the CPU, or
    an accelerator this torch lacks). torch is imported only for an accelerator: the CPU's
    figures come from /proc, so a worker that renders nothing with torch never loads it."""
    if kind not in ("cuda", "xpu", "npu"):
        return None
    import torch

    mod = getattr(torch, kind, None)
    return mod if mod is not None and hasattr(mod, "max_memory_allocated") else None


def reset_peak(device: str = "cpu") -> None:
    """Start a new peak-memory window on ``device`` (e.g. ``"cuda:0"`` or ``"cpu"``)."""
    mod = _accel(device.partition(":")[0])
    if mod is not None:
        mod.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass  # no reset: the peak is the process lifetime's


def current_bytes(device: str = "cpu") -> int:
    """Bytes in use now: allocated tensors on an accelerator, the process RSS on the CPU."""
    mod = _accel(device.partition(":")[0])
    if mod is not None:
        return int(mod.memory_allocated(device))
    return _proc_status_bytes("VmRSS") or peak_bytes("cpu")


def peak_bytes(device: str = "cpu") -> int:
    """Peak bytes since the last :func:`reset_peak` (accelerator) or RSS high-water (CPU)."""
    mod = _accel(device.partition(":")[0])
    if mod is not None:
        return int(mod.max_memory_allocated(device))
    hwm = _proc_status_bytes("VmHWM")
    if hwm:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _proc_status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


@dataclass(frozen=True)
class PeakMeasurement:
    """Warm-up result in bytes: memory held before rendering, and the extra peak per image."""

    base_bytes: int
    per_image_bytes: int


def measure_per_image(render: Callable[[int], object], device: str = "cpu", sizes: tuple[int, int] = (1, 2),
                      enough: Callable[[PeakMeasurement], bool] | None = None) -> PeakMeasurement:
    """Render ``sizes`` images and fit ``peak = base + per_image * n`` through the two peaks.

    ``render(n)`` renders a batch of ``n`` images. The slope excludes activations that do not
    grow with the batch; when the second peak is no higher (a CPU allocator reusing pages), the
    first render's growth over the resident bytes is charged to its images instead.
    ``enough(bound)``: called after the first render with an upper bound of the fit, the resident
    bytes before it as the base and the whole growth of its peak over them charged to its images
    (a render's fixed extra memory, ≥ 0, then counts once per image: ``held + fixed + n·per ≤
    held + n·(fixed + per)`` for every n ≥ 1); when it returns True the second render is skipped
    and that bound is the result.
    """
    held = current_bytes(device)
    peaks = []
    for n in sizes:
        reset_peak(device)
        render(n)
        peaks.append(peak_bytes(device))
        if len(peaks) == 1 and enough is not None:
            bound = PeakMeasurement(held, max(1, -(-(peaks[0] - held) // n)))
            if enough(bound):
                return bound
    (n1, n2), (p1, p2) = sizes, peaks
    slope = (p2 - p1) // (n2 - n1)
    per_image = slope if slope > 0 else max(1, (p1 - held) // n1)  # RSS may not grow on reuse
    return PeakMeasurement(max(held, p1 - per_image * n1), per_image)


def batch_size_for(peak_per_image_bytes: int, base_bytes: int, device_total_bytes: int,
                   fraction: float, cap: int | None = None, reserved_bytes: int = 0) -> int:
    """Largest batch whose peak ``reserved + base + n * per_image`` stays under ``fraction * total``
    bytes. ``reserved_bytes``: memory that add-ons loaded after the measurement will hold
    (:func:`pipeline.sizing.addon_bytes`), taken off the budget first.

    Never below 1 (one image must be tried; an OOM then surfaces as a job error), never above
    ``cap`` (the recipe's ``max_batch_size``) when given.
    """
    if peak_per_image_bytes <= 0 or device_total_bytes <= 0:
        raise ValueError("peak_per_image_bytes and device_total_bytes must be positive")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if reserved_bytes < 0:
        raise ValueError(f"reserved_bytes must be at least 0, got {reserved_bytes}")
    n = int((fraction * device_total_bytes - reserved_bytes - base_bytes) // peak_per_image_bytes)
    return max(1, min(n, cap) if cap else n)


def batch_size_for_stages(measurements: Iterable[PeakMeasurement], device_total_bytes: int, fraction: float,
                          cap: int | None = None, reserved_bytes: int = 0) -> int:
    """The largest batch every measured path fits: :func:`batch_size_for` of each measurement
    (e.g. the diffusion alone, and the diffusion followed by each upscaler a pool declares),
    the smallest of them, each with ``reserved_bytes`` off the budget. The stages of one path run
    one after the other on the same device, so one path's measured peak is already the larger of
    its stages' peaks.

    Raises:
        ValueError: no measurement, or as :func:`batch_size_for`.
    """
    sizes = [batch_size_for(m.per_image_bytes, m.base_bytes, device_total_bytes, fraction, cap, reserved_bytes)
             for m in measurements]
    if not sizes:
        raise ValueError("batch_size_for_stages needs at least one measurement")
    return min(sizes)


def lru_victims(sizes: Mapping[str, int], incoming_bytes: int, *, max_count: int, max_bytes: int,
                keep: Iterable[str] = ()) -> list[str]:
    """The entries to evict from a cache bounded by count and bytes so that one more entry of
    ``incoming_bytes`` fits: the least recently used first, never a name in ``keep`` (what the
    call in progress needs; the cache then stays over its bounds rather than drop it).

    Args:
        sizes: name → bytes of each cached entry, least recently used first (an ``OrderedDict``'s order).
        incoming_bytes: the new entry's bytes. max_count: most entries. max_bytes: most bytes in all.
        keep: names never evicted.
    Returns:
        Names, in the order to evict them (the LoRA adapter and ControlNet caches use it).
    """
    kept, left, victims = set(keep), dict(sizes), []
    while left and (len(left) >= max_count or sum(left.values()) + incoming_bytes > max_bytes):
        victim = next((n for n in left if n not in kept), None)
        if victim is None:
            break
        victims.append(victim)
        del left[victim]
    return victims


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` means out of memory (CUDA/XPU/MPS allocator, or the host)."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # an allocator's OOM needs torch loaded: never import it here
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def render_in_parts(render: Callable[[list[T]], R], items: Sequence[T], limits: BatchLimits | None = None,
                    key: Hashable = None, *,
                    on_error: Callable[[list[T], Exception], bool] | None = None) -> Iterator[tuple[list[T], R]]:
    """The out-of-memory policy: ``render`` ``items`` in parts that fit, yielding ``(part,
    render(part))`` for each part that rendered, in the order of ``items``.

    With ``limits``, ``items`` are first cut into chunks of the cap for ``key`` (e.g. the
    group's compat key), an OOM lowers that cap (:meth:`BatchLimits.lowered`, logged as ``out of
    memory on a group of N; this shape now renders at most M at once``) and each rendered part
    counts towards raising it again (:meth:`BatchLimits.succeeded`, before the part is yielded).
    A part of two or more items that runs out of memory is rendered again as two halves, each
    the same way, *after* the ``except`` block has ended: the exception's traceback references
    the frames, and so the activations, of the part that failed.

    Any other error, and an OOM of a single item, goes to ``on_error(part, exc)`` inside the
    ``except`` block: it returns True to have the part rendered in halves all the same (a
    caller isolating a failing item by bisection; ignored for a single item) or False when it
    has dealt with the part's failure (the part yields nothing). Without ``on_error`` the error
    is raised. The generator renders lazily: each part renders when the caller asks for it.
    """
    items = list(items)
    cap = limits.cap(key, len(items)) if limits is not None else len(items)
    if len(items) > cap:  # this shape ran out of memory before: render it in chunks it fits in
        for i in range(0, len(items), cap):
            yield from render_in_parts(render, items[i:i + cap], limits, key, on_error=on_error)
        return
    try:
        result = render(items)
    except Exception as exc:
        oom = is_oom_error(exc)
        if oom and limits is not None:
            log.warning("out of memory on a group of %d; this shape now renders at most %d at once", len(items),
                        limits.lowered(key, len(items)))
        if oom and len(items) > 1:
            halves = True
        elif on_error is None:
            raise
        else:
            halves = on_error(items, exc) and len(items) > 1
    else:
        if limits is not None:
            limits.succeeded(key, len(items))
        yield items, result
        return
    if halves:  # outside the except block: the failed part's frames and tensors are freed first
        mid = len(items) // 2
        yield from render_in_parts(render, items[:mid], limits, key, on_error=on_error)
        yield from render_in_parts(render, items[mid:], limits, key, on_error=on_error)


def split_on_oom(render: Callable[[Sequence[T]], list[R]], items: Sequence[T],
                 limits: BatchLimits | None = None, key: Hashable = None) -> tuple[list[R], int]:
    """:func:`render_in_parts` for a caller that wants every result at once: ``render(items)``
    (a list of results per item), split on OOM. Returns the results in the order of ``items``
    and the largest part that rendered (0 for no items).

    Raises:
        Exception: any error but an OOM of two or more items, as ``render`` raised it (a single
            item that still runs out of memory re-raises, after lowering its cap).
    """
    parts = list(render_in_parts(render, items, limits, key))
    return [r for _, results in parts for r in results], max((len(part) for part, _ in parts), default=0)


class BatchLimits:
    """Per-shape batch caps: an OOM at ``n`` images caps that shape (``key``, e.g. the group's
    compat key: size, steps, guidance) at ``n // 2``; after ``recover_after`` successful renders at
    the cap it doubles, and the cap disappears once it reaches the size that failed. Other shapes
    keep the worker's full batch size. Thread-safe."""

    def __init__(self, recover_after: int = 8):
        if recover_after < 1:
            raise ValueError("recover_after must be >= 1")
        self.recover_after = recover_after
        self._caps: dict[Hashable, list[int]] = {}  # key -> [cap, failed size, successes at cap]
        self._lock = threading.Lock()

    def cap(self, key: Hashable, default: int) -> int:
        """The most items to render at once for ``key`` (``default`` when it is not capped)."""
        with self._lock:
            entry = self._caps.get(key)
            return min(default, entry[0]) if entry else default

    def lowered(self, key: Hashable, failed_size: int) -> int:
        """Record an OOM of ``failed_size`` items; returns the new cap (>= 1)."""
        with self._lock:
            cap = max(1, failed_size // 2)
            entry = self._caps.get(key)
            self._caps[key] = [min(cap, entry[0]) if entry else cap, max(failed_size, entry[1] if entry else 0), 0]
            return self._caps[key][0]

    def succeeded(self, key: Hashable, size: int) -> None:
        """Record a successful render of ``size`` items for ``key``."""
        with self._lock:
            entry = self._caps.get(key)
            if entry is None or size < entry[0]:
                return
            entry[2] += 1
            if entry[2] >= self.recover_after:
                entry[0], entry[2] = entry[0] * 2, 0
                if entry[0] >= entry[1]:
                    del self._caps[key]

    def snapshot(self) -> dict:
        """``{str(key): cap}`` of the capped shapes (for heartbeats and logs)."""
        with self._lock:
            return {str(k): v[0] for k, v in self._caps.items()}


def guard_vae_decode(vae) -> None:
    """Make ``vae.decode`` survive an OOM of a whole batch: decode it again one image at a time
    (the same per-image computation as diffusers' exact ``enable_slicing``), so the denoised
    latents, and every denoising step, are kept. Idempotent; counts in ``vae._renderfarm_sliced_decodes``."""
    if getattr(vae, "_renderfarm_decode_guard", False):
        return
    decode = vae.decode

    def guarded(z, *args, return_dict: bool = True, **kwargs):
        try:
            return decode(z, *args, return_dict=return_dict, **kwargs)
        except Exception as e:
            if not is_oom_error(e) or z.shape[0] <= 1:
                raise
        vae._renderfarm_sliced_decodes = getattr(vae, "_renderfarm_sliced_decodes", 0) + 1
        import torch

        parts = [decode(z[i:i + 1], *args, return_dict=False, **kwargs)[0] for i in range(z.shape[0])]
        sample = torch.cat(parts)
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample)

    vae.decode = guarded
    vae._renderfarm_decode_guard = True


def allocator_env(profile: DeviceProfile, num_threads: int = 0) -> dict[str, str]:
    """Environment to set before a worker process imports torch.

    CUDA keeps the default caching allocator (the SDNQ uint4 model card measured it fastest); the CPU gets
    ``OMP_NUM_THREADS``. The forbidden allocator combination is never produced.
    """
    env: dict[str, str] = {}
    if profile.kind == "cpu":
        env["OMP_NUM_THREADS"] = str(num_threads or profile.cpu_cores)
    for var in ALLOC_CONF_VARS:
        assert not _forbidden(env.get(var, "")), "allocator_env produced expandable_segments+max_split_size_mb"
    return env


def _forbidden(conf: str) -> bool:
    opts = {k.strip(): v.strip() for k, _, v in (p.partition(":") for p in conf.split(",")) if k.strip()}
    return opts.get("expandable_segments", "").lower() == "true" and "max_split_size_mb" in opts


def check_allocator_env(environ: Mapping[str, str], strict: bool = True) -> None:
    """Refuse (ValueError) or, with ``strict=False``, warn about the SDNQ model card's allocator pitfall."""
    for var in ALLOC_CONF_VARS:
        if _forbidden(environ.get(var, "")):
            msg = (f"{var}={environ[var]!r} combines expandable_segments with max_split_size_mb; "
                   "the ERNIE-Image-Turbo SDNQ uint4 model card measured ~48 GiB reserved and 2-4x slower "
                   "denoising. Use the default allocator.")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
