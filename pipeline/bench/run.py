"""``renderfarm bench pipeline``: the reference, the strong peer and the farm's recipes side by
side, in one process, one run.

Place in the data flow: beside the pipeline, not in it. The command line builds a
:class:`PipelineBenchConfig`; :func:`run_pipeline_bench` loads one subject per spec
(:mod:`pipeline.bench.subjects`), renders the same prompts and seeds through each at every batch
size, and returns the JSON-able result that :mod:`pipeline.bench.report` prints.

Timing discipline: by default every pipeline stays resident and the (spec, batch) cells run
round-robin over ``repeats`` rounds, the order rotating each round, so machine noise hits every
cell alike; medians are reported beside the mean and the best round. ``sequential`` loads one
subject at a time (each runs its rounds, then is freed): for models of which several copies do
not fit in device memory (FLUX, ERNIE-Image at 1024²). The machine's dense GEMM rate is measured
once per round, between the renders, so it sees the same machine.

Per row: load s; cold s (the first call at that batch size, compilation included); hot mean,
median and best seconds per image; it/s (denoiser calls per second, one call per step with
classifier-free guidance batched, counted on a real render); images/s; peak allocated and
reserved MiB; PSNR against the reference's image for the same seed; FLOPs per image (one batch-1
render under ``FlopCounterMode``); the % of the device's measured bf16 GEMM rate that the
render's FLOPs reach (100 % = every FLOP at dense bf16 GEMM speed); ratios against the
reference and the peer at the same batch size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from pipeline.bench import adapter
from pipeline.bench.measure import (
    Summary,
    device_kind,
    gemm_rates,
    gemm_sizes,
    load_average,
    machine_facts,
    mib,
    psnr,
)
from pipeline.bench.probes import RenderCount, architecture, count_render, denoiser_class
from pipeline.bench.specs import parse_specs
from pipeline.bench.subjects import FarmSubject, Subject, Workload, load_subject, timed_render
from pipeline.device import probe

DEFAULT_RECIPES = ("reference", "peer", "exact", "fast", "exact+batch_invariant")
POOL = "pool"


@dataclass(frozen=True)
class PipelineBenchConfig:
    """What to measure. Sizes in pixels. ``batch_sizes`` holds ints and/or ``"pool"`` (the batch a
    worker of the first farm recipe would pick, measured after the cold renders of the others).
    ``guidance_scale`` None = a render request's
    default (7.5), for every row alike. ``table`` is ``pipeline`` or ``modelcard``
    (:mod:`pipeline.bench.modelcard`)."""

    model: str
    width: int = 256
    height: int = 256
    steps: int = 4
    batch_sizes: tuple = (1, 4)
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    repeats: int = 3
    guidance_scale: float | None = None
    device: str = "auto"
    cache_dir: str | None = None
    seed: int = 0
    count_flops: bool = True
    sequential: bool = False
    table: str = "pipeline"

    def workload(self) -> Workload:
        g = adapter.default_guidance_scale() if self.guidance_scale is None else self.guidance_scale
        return Workload(self.model, self.width, self.height, self.steps, g, self.cache_dir)

    def validate(self) -> None:
        """Raises ValueError on a config that cannot run."""
        if self.repeats < 1 or not self.batch_sizes or not self.recipes:
            raise ValueError("need repeats >= 1, at least one batch size and one recipe")
        bad = [b for b in self.batch_sizes if b != POOL and not (isinstance(b, int) and b >= 1)]
        if bad:
            raise ValueError(f"batch sizes must be integers >= 1 or 'pool', got {bad}")
        if self.table not in ("pipeline", "modelcard"):
            raise ValueError(f"table must be pipeline or modelcard, got {self.table!r}")


@dataclass
class Row:
    """One (spec, batch size) cell. Seconds, MiB, FLOPs and dB as the field names say; None
    where a column does not apply (reserved memory off CUDA, PSNR without a reference row)."""

    recipe: str
    kind: str
    resolved: str
    batch_size: int
    dtype: str
    exact: bool
    approximations: list[str]
    load_s: float
    cold_s: float
    cold_peak_allocated_mib: float | None = None
    hot_s_per_img: list[float] = field(default_factory=list)
    hot_cpu_s_per_img: list[float] = field(default_factory=list)
    hot_mean_s_per_img: float | None = None
    hot_median_s_per_img: float | None = None
    hot_best_s_per_img: float | None = None
    cpu_s_per_img: float | None = None
    denoiser_calls: int | None = None  # per pipeline call (= per batch)
    it_per_s: float | None = None
    images_per_s: float | None = None
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    speedup: float | None = None  # reference's hot median / this row's, same batch size
    vs_peer: float | None = None  # peer's hot median / this row's, same batch size
    psnr_db: float | None = None
    flops_per_image: float | None = None
    denoiser_flops_per_image: float | None = None
    pct_of_bf16_matmul: float | None = None
    floor_s_per_img: float | None = None
    pct_of_floor: float | None = None


class _Run:
    """The state of one bench run: subjects, cells, images, peaks, GEMM rounds, counts."""

    def __init__(self, config: PipelineBenchConfig, log):
        config.validate()
        self.config, self.log = config, log
        self.profile = probe(config.device)
        self.device = self.profile.torch_device
        self.workload = config.workload()
        self.specs = parse_specs(config.recipes)
        self.batch_sizes = [b for b in config.batch_sizes if b != POOL]
        self.pool: int | None = None
        self.rows: dict[tuple[str, int], Row] = {}
        self.images: dict[tuple[str, int], list[np.ndarray]] = {}
        self.peaks: dict[tuple[str, int], list[int]] = {}
        self.reserved: dict[tuple[str, int], int] = {}
        self.gemm: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        self.gemm_sizes: dict[str, int] = {}
        self.counts: dict[tuple, RenderCount] = {}
        #: denoiser class → FLOPs per call, from an eager count (a denoiser compiled to another
        #: runtime, OpenVINO, does the same arithmetic but is invisible to the FLOP counter)
        self.denoiser_call_flops: dict[str, float] = {}
        self.subject_counts: dict[str, RenderCount] = {}
        self.reports: dict[str, dict] = {}

    def seeds(self, b: int) -> list[int]:
        return list(range(self.config.seed, self.config.seed + b))

    def load(self, spec) -> Subject:
        self.log(f"loading {self.config.model} for {spec.text} …")
        s = load_subject(spec, self.workload, self.profile)
        self.reports[spec.text] = {"resolved": s.resolved, "dtype": s.dtype, "approximations": s.approximations,
                                   "applied": s.report.get("applied", {}), "skipped": s.report.get("skipped", {}),
                                   "load_peak_allocated_mib": mib(s.load_memory.peak_allocated),
                                   "load_peak_reserved_mib": mib(s.load_memory.peak_reserved)}
        recipe = getattr(s, "recipe", None)
        if recipe is not None:
            self.reports[spec.text]["recipe"] = recipe.to_dict()
        return s

    def resolve_pool(self, subjects: list[Subject]) -> list[int]:
        """With ``pool`` among the batch sizes, measure the first farm subject's batch size (after
        its cold renders, so they stay first calls); returns the batch sizes it adds."""
        farm = next((s for s in subjects if s.spec.kind == "farm"), None)
        if POOL not in self.config.batch_sizes or self.pool is not None or farm is None:
            return []
        self.pool = adapter.pool_batch_size(cast(FarmSubject, farm).renderer, self.profile, self.workload.width,
                                            self.workload.height, self.workload.steps)
        self.log(f"the pool's batch size for {farm.spec.text}: {self.pool}")
        if self.pool in self.batch_sizes:
            return []
        self.batch_sizes.append(self.pool)
        return [self.pool]

    def cold(self, s: Subject, b: int) -> None:
        images, timer, memory = timed_render(s, self.seeds(b))
        self.images[s.spec.text, b] = images
        self.rows[s.spec.text, b] = Row(
            s.spec.text, s.spec.kind, s.resolved, b, s.dtype, s.exact, list(s.approximations), round(s.load_s, 3),
            round(timer.seconds, 3), cold_peak_allocated_mib=mib(s.weights_bytes + memory.growth))
        self.log(f"cold {s.spec.text} batch {b}: {timer.seconds:.2f} s")

    def hot(self, s: Subject, b: int, round_: int) -> None:
        _, timer, memory = timed_render(s, self.seeds(b))
        key = (s.spec.text, b)
        row = self.rows[key]
        row.hot_s_per_img.append(round(timer.seconds / b, 4))
        row.hot_cpu_s_per_img.append(round(timer.cpu_seconds / b, 4))
        self.peaks.setdefault(key, []).append(s.weights_bytes + memory.growth)
        if memory.peak_reserved is not None:
            self.reserved[key] = max(self.reserved.get(key, 0), memory.peak_reserved)
        self.log(f"round {round_ + 1}/{self.config.repeats} {s.spec.text} batch {b}: {timer.seconds / b:.3f} s/img"
                 + (f"  (load {load_average()[0]})" if device_kind(self.device) == "cpu" else ""))

    def measure_gemm(self) -> None:
        self.gemm_sizes = self.gemm_sizes or gemm_sizes(self.device)  # one size per dtype for every round
        for name, rate in gemm_rates(self.device, self.gemm_sizes).items():
            self.gemm[name].append(rate)

    def count(self, s: Subject) -> None:
        """FLOPs and denoiser calls of one batch-1 render, once per architecture."""
        key = architecture(s.pipe)
        if key not in self.counts:
            self.log(f"counting {'FLOPs and ' if self.config.count_flops else ''}denoiser calls with {s.spec.text} …")
            count = count_render(s.pipe, lambda: s.render([self.config.seed]), flops=self.config.count_flops)
            denoiser = denoiser_class(s.pipe)
            if count.denoiser_flops > 0 and count.denoiser_calls:
                self.denoiser_call_flops.setdefault(denoiser, count.denoiser_flops / count.denoiser_calls)
            elif count.flops and count.denoiser_calls and denoiser in self.denoiser_call_flops:
                extra = self.denoiser_call_flops[denoiser] * count.denoiser_calls
                count.denoiser_flops, count.flops = extra, count.flops + extra
            self.counts[key] = count
        self.subject_counts[s.spec.text] = self.counts[key]

    def cells(self, specs) -> list[tuple]:
        return [(s, b) for s in specs for b in self.batch_sizes]


def _run_resident(run: _Run) -> None:
    subjects = [run.load(spec) for spec in run.specs]
    for s, b in run.cells(subjects):
        run.cold(s, b)
    for b in run.resolve_pool(subjects):
        for s in subjects:
            run.cold(s, b)
    cells = run.cells(subjects)
    for r in range(run.config.repeats):
        run.measure_gemm()
        shift = r % len(cells)
        for s, b in cells[shift:] + cells[:shift]:
            run.hot(s, b, r)
    for s in subjects:
        run.count(s)
    for s in subjects:
        s.close()


def _run_sequential(run: _Run) -> None:
    specs = list(run.specs)
    if POOL in run.config.batch_sizes:  # the pool's batch size comes from the first farm recipe: run it first
        first_farm = next((s for s in specs if s.kind == "farm"), None)
        if first_farm is not None:
            specs.remove(first_farm)
            specs.insert(0, first_farm)
    for spec in specs:
        s = run.load(spec)
        for _, b in run.cells([s]):
            run.cold(s, b)
        for b in run.resolve_pool([s]):
            run.cold(s, b)
        cells = run.cells([s])
        for r in range(run.config.repeats):
            run.measure_gemm()
            shift = r % len(cells)
            for _, b in cells[shift:] + cells[:shift]:
                run.hot(s, b, r)
        run.count(s)
        s.close()


def _references(run: _Run) -> dict[int, np.ndarray]:
    """The reference row's image for every seed, from its smallest batch that rendered it."""
    ref = next((s.text for s in run.specs if s.is_reference), None)
    refs: dict[int, np.ndarray] = {}
    for b in sorted(run.batch_sizes, reverse=True):
        if ref is not None and (ref, b) in run.images:
            refs.update(zip(run.seeds(b), run.images[ref, b]))
    return refs


def _finish(run: _Run) -> None:
    rates = {k: statistics.median(v) for k, v in run.gemm.items() if v}
    refs = _references(run)
    by_kind_batch: dict[tuple[str, int], Row] = {}
    for row in run.rows.values():  # the first reference / peer row is the one compared with
        by_kind_batch.setdefault((row.kind, row.batch_size), row)
    for (text, b), row in run.rows.items():
        summary = Summary.of(row.hot_s_per_img)
        row.hot_mean_s_per_img, row.hot_median_s_per_img, row.hot_best_s_per_img = \
            summary.mean, summary.median, summary.best
        row.cpu_s_per_img = round(statistics.median(row.hot_cpu_s_per_img), 4)
        row.images_per_s = round(1 / summary.median, 4)
        row.peak_allocated_mib = mib(max(run.peaks[text, b]))
        row.peak_reserved_mib = mib(run.reserved.get((text, b)))
        if refs:
            row.psnr_db = min(psnr(img, refs[seed]) for img, seed in zip(run.images[text, b], run.seeds(b)))
        count = run.subject_counts.get(text)
        if count is not None:
            row.denoiser_calls = count.denoiser_calls
            row.it_per_s = round(count.denoiser_calls / (summary.median * b), 3) if count.denoiser_calls else None
            if run.config.count_flops and count.flops:
                row.flops_per_image, row.denoiser_flops_per_image = count.flops, count.denoiser_flops
                bf16 = rates.get("bfloat16")
                row.pct_of_bf16_matmul = float(f"{100 * count.flops / (summary.median * bf16):.3g}") if bf16 else None
                rate = rates.get("float32" if row.dtype == "float32" else "bfloat16")
                if rate:  # significant figures, not decimals: a small model's floor is well under 1 ms
                    floor = count.flops / rate
                    row.floor_s_per_img = float(f"{floor:.4g}")
                    row.pct_of_floor = float(f"{100 * floor / summary.median:.3g}")
    for row in run.rows.values():
        for attr, kind in (("speedup", "reference"), ("vs_peer", "peer")):
            other = by_kind_batch.get((kind, row.batch_size))
            if other is not None and other.hot_median_s_per_img:
                # every row's hot median was set in the loop above
                setattr(row, attr, round(other.hot_median_s_per_img / cast(float, row.hot_median_s_per_img), 3))


def run_pipeline_bench(config: PipelineBenchConfig, log=print) -> dict:
    """Run the benchmark; returns the JSON-able result (``rows``, ``machine``, ``config``, …).

    ``config.table == "modelcard"`` runs :func:`pipeline.bench.modelcard.run_modelcard` instead.

    Raises:
        ValueError: a bad config or spec, a recipe that cannot be resolved, or (model-card table)
            the forbidden allocator configuration.
    """
    if config.table == "modelcard":
        from pipeline.bench.modelcard import run_modelcard

        return run_modelcard(config, log)
    run = _Run(config, log)
    started, load_before = time.time(), load_average()
    (_run_sequential if config.sequential else _run_resident)(run)
    _finish(run)
    machine = machine_facts(run.profile, run.gemm, run.gemm_sizes)
    machine["load_average_before"], machine["load_average_after"] = load_before, load_average()
    return {
        "benchmark": "pipeline",
        "config": {**asdict(config), "batch_sizes": list(config.batch_sizes), "recipes": list(config.recipes),
                   "guidance_scale": run.workload.guidance_scale, "pool_batch_size": run.pool,
                   "resolved_batch_sizes": run.batch_sizes},
        "machine": machine,
        "flops_by_module": {t: c.by_module for t, c in run.subject_counts.items() if c.by_module},
        "reports": run.reports,
        "rows": [asdict(r) for r in run.rows.values()],
        "seconds": round(time.time() - started, 1),
    }
