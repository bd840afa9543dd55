"""Batch sizing: how many images a worker renders per pipeline call, from measured peak memory,
kept with the compile cache so that the next start of the same worker does not measure again.

Place in the data flow: ``renderfarm worker`` start-up → load the pipeline
(:func:`pipeline.warm.prepare_renderer`) → **here** (the ``sizing`` state) → warm up
(:mod:`pipeline.ready`). Storage is the caller's, as for the compile cache: the worker passes
functions over the farm's bucket (``infra.storage.compile_artifacts``), the bench functions over
files; nothing here knows S3.

What is measured (:func:`measure_sizing`):

* **where**: at the largest size the pool serves (:func:`sizing_shape`): its declared ``sizes``,
  else the square of its declared ``max_pixels``, else the size a request gets by default
  (:func:`pipeline.warm.served_sizes`), never a size the pool will not render;
* **how long**: one denoising step (:data:`SIZING_STEPS`): the denoiser's activations are freed
  between steps, so the peak of one step and the decode after it is the peak of any step count;
* **how often**: a batch of 1 and a batch of 2 images per path (the diffusion, then the diffusion
  followed by each upscaler the pool declares), fitted by :func:`pipeline.memory.measure_per_image`;
  the second render is skipped where an upper bound from the first already fits the device at the
  recipe's ``max_batch_size`` (the resident bytes plus the first render's whole growth over them
  per image: a CPU with tens of GiB, a large GPU; the batch size is then the cap), and nothing is
  rendered where that cap is 1.

The record (:class:`SizingRecord`: base and per-image bytes per path at that size) is stored under
a key of the model and its revision, the device, the versions, the recipe's knobs, the size, the
guidance and the paths (:func:`sizing_key`), in the compile cache's checked blob format
(:func:`pipeline.compile_cache.pack`): a hit skips the measurement, a miss measures and saves, a
corrupt or mismatched record is measured again with one log line. The batch size is computed from
the record on every start (:func:`pipeline.memory.batch_size_for_stages`), so a record measured on
a machine with more memory still sizes right on one with less.

Add-ons: the sizing renders carry no control units, and the ControlNets and IP-Adapter image
encoders a request may name are loaded on first use, after the sizing. So the batch size keeps their
bytes free (:func:`addon_bytes`): the ControlNet LRU's ``max_bytes`` (the most its ControlNets' parameters
may hold) plus every declared IP-Adapter's image encoder (kept once loaded:
:meth:`pipeline.ip_adapter.IPAdapters.reserved_bytes`) come off ``memory_fraction × total`` before
the measured base and per-image bytes. A ControlNet's own activations per image (one more pass per
step) are not measured: a batch that runs out of memory is split (:func:`pipeline.memory.split_on_oom`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from infra.schemas import RenderRequest
from pipeline.compile_cache import CacheKey, CorruptArtifact, MismatchedArtifact, base_fields, key_of, pack, unpack
from pipeline.memory import PeakMeasurement, batch_size_for_stages, measure_per_image
from pipeline.pool_options import PoolOptions
from pipeline.warm import served_sizes, warm_plan

log = logging.getLogger("renderfarm.worker")

#: Denoising steps of a sizing render: one gives the true peak (see the module docstring).
SIZING_STEPS = 1
#: Recipe fields that do not change a render's peak bytes (the batch bounds use them after).
_NOT_MEASURED = ("max_batch_size", "memory_fraction", "overridden", "approximations", "report", "capabilities",
                 "invariance", "family_checked")

Fetch = Callable[[CacheKey], "bytes | None"]
Store = Callable[[CacheKey, bytes], None]
Progress = Callable[[int, int, "float | None"], None]


@dataclass(frozen=True)
class SizingRecord:
    """What a sizing measured: the size (pixels), steps and guidance it rendered at, and per path
    (``diffusion``, or an upscaler's name) ``[base_bytes, per_image_bytes]``; ``bounded`` names the
    paths whose second render was skipped (their per-image bytes are the first render's whole
    growth over the resident bytes: an upper bound). ``seconds``: the measurement's wall time."""

    width: int
    height: int
    steps: int
    guidance_scale: float
    paths: dict[str, list[int]]
    bounded: tuple[str, ...] = ()
    seconds: float = 0.0

    def measurements(self) -> list[PeakMeasurement]:
        """One :class:`pipeline.memory.PeakMeasurement` per path."""
        return [PeakMeasurement(int(base), int(per)) for base, per in self.paths.values()]

    def to_json(self) -> bytes:
        """UTF-8 JSON of the record (the payload stored under its key)."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> SizingRecord:
        """The record in ``payload``.

        Raises:
            CorruptArtifact: not a record (bad JSON, missing or ill-typed fields).
        """
        try:
            raw = json.loads(payload)
            paths = {str(k): [int(v[0]), int(v[1])] for k, v in raw["paths"].items()}
            if not paths or any(per <= 0 or base < 0 for base, per in paths.values()):
                raise ValueError(f"no positive measurement in {paths}")
            return cls(int(raw["width"]), int(raw["height"]), int(raw["steps"]), float(raw["guidance_scale"]),
                       paths, tuple(raw.get("bounded") or ()), float(raw.get("seconds") or 0.0))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise CorruptArtifact(f"not a sizing record: {type(exc).__name__}: {exc}") from None


def sizing_shape(renderer, pool: PoolOptions | None = None) -> tuple[int, int, int]:
    """(width, height, steps) to measure at: the largest (by pixels) of the pool's declared
    ``sizes``; else the square of its ``max_pixels`` rounded down to the size multiple; else the
    default request size (:func:`pipeline.warm.served_sizes`); and :data:`SIZING_STEPS`."""
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    if pool.max_pixels and not pool.sizes:
        multiple = renderer.capabilities.size_multiple
        side = max(multiple, min(2048, int(pool.max_pixels ** 0.5)) // multiple * multiple)
        return side, side, SIZING_STEPS
    width, height = max(served_sizes(renderer, pool), key=lambda s: s[0] * s[1])
    return width, height, SIZING_STEPS


def sizing_paths(pool: PoolOptions) -> tuple[str, ...]:
    """The paths a sizing measures, in order: ``diffusion``, then each upscaler the pool declares
    (the renders followed by its ×4 upscale); two renders each at most."""
    return ("diffusion", *(pool.upscalers or ()))


def sizing_requests(renderer, n: int, *, width: int, height: int, steps: int, guidance_scale: float,
                    upscaler: str | None = None) -> list[RenderRequest]:
    """The ``n`` requests a sizing render makes, at ``guidance_scale`` (above 1 classifier-free
    guidance doubles the denoiser's batch), and with ``upscaler`` an ×4 upscale (the larger factor;
    a ×2 network is then followed by a resize), so that the upscaling stage's peak is measured with
    the diffusion's."""
    up = {"upscale": 4, "upscaler": upscaler} if upscaler else {}
    return [RenderRequest(prompt="warm-up", model=renderer.model, seed=i, width=width, height=height,
                          num_inference_steps=steps, guidance_scale=guidance_scale, **up) for i in range(n)]


def sizing_key(renderer, profile: dict, width: int, height: int, guidance_scale: float,
               paths: tuple[str, ...]) -> CacheKey:
    """The key of a sizing record: :func:`pipeline.compile_cache.base_fields` (model, revision,
    device, versions), the recipe's knobs that change a render's memory (all but the batch bounds),
    the size (pixels), the steps, whether guidance doubles the batch, and the measured paths."""
    knobs = {k: v for k, v in sorted(renderer.recipe.items()) if k not in _NOT_MEASURED and not isinstance(v, dict)}
    return key_of({**base_fields(renderer.model, profile), "component": "sizing", "recipe": knobs,
                   "size": [int(width), int(height)], "steps": SIZING_STEPS, "guidance": guidance_scale > 1.0,
                   "paths": list(paths)})


def record_name(key: CacheKey) -> str:
    """The storage name of a sizing record: ``<key name>.sizing`` (beside the Inductor artifacts)."""
    return f"{key.name}.sizing"


def measure_sizing(renderer, profile: dict, pool: PoolOptions | None = None, *, width: int | None = None,
                   height: int | None = None, on_progress: Progress | None = None) -> SizingRecord:
    """Measure peak bytes per path at :func:`sizing_shape` (or ``width`` × ``height``), one step,
    at the pool's guidance (:func:`pipeline.warm.warm_plan`'s); ``on_progress(done, total, eta_s)``
    after each render (renders; seconds). See the module docstring for the renders it skips."""
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    w, h, steps = sizing_shape(renderer, pool)
    width, height = width or w, height or h
    guidance = warm_plan(renderer, pool, 1).guidance_scale
    paths = sizing_paths(pool)
    usable = renderer.recipe["memory_fraction"] * profile["total_memory_bytes"]
    cap = renderer.max_batch_size
    total, done, started = 2 * len(paths), 0, time.perf_counter()
    measured: dict[str, list[int]] = {}
    bounded: list[str] = []
    if on_progress is not None:
        on_progress(0, total, None)
    for path in paths:
        upscaler = None if path == "diffusion" else path

        def render(n: int, upscaler: str | None = upscaler) -> None:
            nonlocal done
            renderer.render(sizing_requests(renderer, n, width=width, height=height, steps=steps,
                                            guidance_scale=guidance, upscaler=upscaler))
            done += 1
            if on_progress is not None:
                elapsed = time.perf_counter() - started
                on_progress(done, total, elapsed / done * (total - done))

        def enough(bound: PeakMeasurement, path: str = path) -> bool:
            fits = bound.base_bytes + cap * bound.per_image_bytes <= usable
            if fits:
                bounded.append(path)
            return fits

        m = measure_per_image(render, renderer.device, enough=enough)
        measured[path] = [m.base_bytes, m.per_image_bytes]
    record = SizingRecord(width, height, steps, guidance, measured, tuple(bounded),
                          round(time.perf_counter() - started, 3))
    for path, (base, per) in measured.items():
        how = (f"base {base / 2**20:.0f} MiB; an upper bound (one image's whole growth per image), and "
               f"max_batch_size {cap} of it fits {usable / 2**20:.0f} MiB: no second render"
               if path in bounded else f"base {base / 2**20:.0f} MiB")
        log.info("peak memory (%s): %.1f MiB per %dx%d image, %d step(s); %s", path, per / 2**20, width, height,
                 steps, how)
    return record


def addon_bytes(renderer) -> int:
    """Bytes the add-ons that ``renderer`` loads on first use may hold (see the module docstring):
    its ControlNets' LRU ``max_bytes`` (0 without ControlNets) plus its IP-Adapters'
    ``reserved_bytes()`` (0 without IP-Adapters).

    Raises:
        OSError / ValueError: an IP-Adapter's image encoder config cannot be read (as its first use would).
    """
    controlnets, ip_adapters = getattr(renderer, "controlnets", None), getattr(renderer, "ip_adapters", None)
    return ((controlnets.max_bytes if controlnets is not None else 0)
            + (ip_adapters.reserved_bytes() if ip_adapters is not None else 0))


def batch_size_from_memory(renderer, profile: dict, *, width: int | None = None, height: int | None = None,
                           pool: PoolOptions | None = None) -> int:
    """:func:`measure_sizing` without a record store: the largest batch (images) whose peak stays
    under the recipe's ``memory_fraction`` of the device memory less :func:`addon_bytes` in every
    path, capped by its ``max_batch_size`` (:func:`pipeline.memory.batch_size_for_stages`)."""
    record = measure_sizing(renderer, profile, pool, width=width, height=height)
    return batch_size_for_stages(record.measurements(), profile["total_memory_bytes"],
                                 renderer.recipe["memory_fraction"], cap=renderer.max_batch_size,
                                 reserved_bytes=addon_bytes(renderer))


def size_batch(renderer, profile: dict, pool: PoolOptions | None = None, *, fetch: Fetch | None = None,
               store: Store | None = None, on_progress: Progress | None = None) -> dict:
    """The worker's batch size, from the stored sizing record when one matches, else measured
    (:func:`measure_sizing`) and stored. Never raises for storage: a failed fetch or save is logged
    and only means measuring (or not keeping) the record.

    Args:
        renderer: the loaded :class:`pipeline.render.Renderer`. profile: its device profile (dict).
        pool: the pool's options (default ``renderer.pool``).
        fetch / store: get and put a blob under a key (None: no record store, always measure).
        on_progress: ``(done, total, eta_s)`` during a measurement (renders; seconds).
    Returns:
        ``{"batch_size", "record": "hit" | "miss" | "corrupt" | "mismatch" | "error" | "none" |
        "skipped", "reason", "measured" (bool), "reserved_bytes" (:func:`addon_bytes`), "seconds",
        "width", "height", "steps", "paths", "bounded", "saved"}``: ``record`` is how the stored
        record was found (``none``: no store;
        ``skipped``: ``max_batch_size`` 1, nothing to measure); seconds are the state's wall time.
    Raises:
        whatever a sizing render raises (the worker cannot serve a shape it cannot render).
    """
    started = time.perf_counter()
    pool = pool or getattr(renderer, "pool", None) or PoolOptions()
    cap, fraction, total_bytes = renderer.max_batch_size, renderer.recipe["memory_fraction"], \
        profile["total_memory_bytes"]
    width, height, steps = sizing_shape(renderer, pool)
    if cap == 1:
        log.info("batch size 1: the recipe's max_batch_size is 1, no sizing render")
        return {"batch_size": 1, "record": "skipped", "reason": "max_batch_size 1", "measured": False,
                "reserved_bytes": 0, "seconds": 0.0, "width": width, "height": height, "steps": steps, "paths": {},
                "bounded": [], "saved": None}
    guidance = warm_plan(renderer, pool, 1).guidance_scale
    key = sizing_key(renderer, profile, width, height, guidance, sizing_paths(pool))
    record, outcome, reason = _fetch_record(key, fetch)
    saved: dict | None = None
    measured = record is None
    if record is None:
        from pipeline import compile_count

        if on_progress is not None:  # the state's total before the first-call render, which takes a while too
            on_progress(0, 2 * len(sizing_paths(pool)), None)
        with compile_count.eager():  # the sizing shapes need no compiled graph (the warm-up builds those)
            renderer.warmup()  # first-call allocations stay out of the measured peaks
            record = measure_sizing(renderer, profile, pool, on_progress=on_progress)
        saved = _save_record(key, record, store) if store is not None else None
    reserved = addon_bytes(renderer)
    size = batch_size_for_stages(record.measurements(), total_bytes, fraction, cap=cap, reserved_bytes=reserved)
    log.info("batch size %d (sizing record %s%s; %.0f MiB kept for ControlNets and IP-Adapters)", size, outcome,
             f": {reason}" if reason else "", reserved / 2**20)
    return {"batch_size": size, "record": outcome, "reason": reason, "measured": measured, "reserved_bytes": reserved,
            "seconds": round(time.perf_counter() - started, 3), "width": width, "height": height, "steps": steps,
            "paths": record.paths, "bounded": list(record.bounded), "saved": saved, "key": record_name(key)}


def _fetch_record(key: CacheKey, fetch: Fetch | None) -> tuple[SizingRecord | None, str, str]:
    """(record or None, outcome, reason) of the stored record under ``key``; logs a bad one."""
    if fetch is None:
        return None, "none", ""
    try:
        blob = fetch(key)
    except Exception as exc:
        reason = f"fetch failed: {type(exc).__name__}: {exc}"
        log.warning("sizing record %s: %s; measuring", record_name(key), reason)
        return None, "error", reason
    if blob is None:
        return None, "miss", ""
    try:
        return SizingRecord.from_json(unpack(blob, key)), "hit", ""
    except (CorruptArtifact, MismatchedArtifact) as exc:
        outcome = "corrupt" if isinstance(exc, CorruptArtifact) else "mismatch"
        log.warning("sizing record %s: %s: %s; measuring", outcome, record_name(key), exc)
        return None, outcome, str(exc)


def _save_record(key: CacheKey, record: SizingRecord, store: Store) -> dict:
    """Store ``record`` under ``key``: ``{"bytes"}``, or ``{"error"}`` (logged, never raised)."""
    blob = pack(key, record.to_json())
    try:
        store(key, blob)
    except Exception as exc:
        log.warning("sizing record %s: could not save: %s: %s", record_name(key), type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}
    log.info("sizing record saved: %s (%d bytes)", record_name(key), len(blob))
    return {"bytes": len(blob)}


__all__ = ["SIZING_STEPS", "SizingRecord", "addon_bytes", "batch_size_from_memory", "measure_sizing", "record_name",
           "size_batch", "sizing_key", "sizing_paths", "sizing_requests", "sizing_shape"]
