"""``renderfarm bench pipeline``: the reference, the strong peer and the farm's recipes side by
side, in one process, one run.

Place in the data flow: beside the pipeline, not in it. The command line builds a
:class:`PipelineBenchConfig`; :func:`run_pipeline_bench` loads one subject per spec
(:mod:`bench.pipeline.subjects`), renders the same prompts and seeds through each at every batch
size, and returns the JSON-able result that :mod:`bench.pipeline.tables` prints.

Method, per (spec, batch) cell: one untimed **cold** call (compilation included; its seconds are
the ``cold_s`` column), one untimed **settle** call (CUDA graphs recorded, allocator and autotune
caches filled; ``settle_s``), then ``repeats`` timed rounds (default :data:`bench.pipeline.summary.MIN_ROUNDS`).
By default every pipeline stays resident and the cells run round-robin, the order rotating each
round, so machine noise hits every cell alike; ``sequential`` loads one subject at a time (for
models of which several copies do not fit in device memory: FLUX, ERNIE-Image at 1024²). The
machine's dense GEMM rate is measured once per round, between the renders. Every round is kept
in the JSON; medians, best, worst and spread, the ratios and the roofline columns come from
:func:`bench.pipeline.summary.summarize`. After the settle call each row's report gets
``observed``: what it ran with, read back from the objects (:mod:`bench.pipeline.ran_with`).

A row that fails (to load, compile or render) is kept with ``status: failed`` and its error; the
other rows go on. With a ``checkpoint`` callback the result so far (``complete: false``) is handed
over after every cold call, settle call and round, so a run stopped from outside still leaves its
finished rounds (the command line rewrites its ``--json`` file each time).

Per row also: load s; it/s (denoiser calls per second, counted on a real render); images/s; peak
allocated and reserved MiB; PSNR against the reference's image for the same seed; FLOPs per image
(one batch-1 render under ``FlopCounterMode``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from bench.pipeline import adapter
from bench.pipeline.flop_counts import FlopCounts
from bench.pipeline.instruments import device_kind, gemm_rates, gemm_sizes, load_average, machine_facts, mib, psnr
from bench.pipeline.ran_with import cudagraph_skips, observe
from bench.pipeline.specs import BenchSpec, parse_specs
from bench.pipeline.subjects import FarmSubject, Subject, Workload, load_subject, timed_render
from bench.pipeline.summary import MIN_ROUNDS, summarize
from pipeline.device import probe

DEFAULT_RECIPES = ("reference", "peer", "exact", "fast", "exact+batch_invariant")
POOL = "pool"
Checkpoint = Callable[[dict], None]


@dataclass(frozen=True)
class PipelineBenchConfig:
    """What to measure. Sizes in pixels. ``batch_sizes`` holds ints and/or ``"pool"`` (the batch a
    worker of the first farm recipe would pick, measured after the cold renders of the others).
    ``guidance_scale`` None = a render request's default (7.5), for every row alike. ``repeats``:
    timed rounds after the cold and settle calls. ``table`` is ``pipeline`` or ``modelcard``
    (:mod:`bench.pipeline.modelcard`)."""

    model: str
    width: int = 256
    height: int = 256
    steps: int = 4
    batch_sizes: tuple = (1, 4)
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    repeats: int = MIN_ROUNDS
    guidance_scale: float | None = None
    device: str = "auto"
    cache_dir: str | None = None
    seed: int = 0
    count_flops: bool = True
    measure_gemm: bool = True  # the machine's GEMM rates, once per round (the roofline columns' divisor)
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
    """One (spec, batch size) cell as measured: seconds, MiB, FLOPs and dB as the field names say;
    None where a column does not apply or was not reached. The summary columns (medians, ratios,
    roofline) are added from ``hot_s_per_img`` by :func:`bench.pipeline.summary.summarize`."""

    recipe: str
    kind: str
    batch_size: int
    resolved: str | None = None
    dtype: str | None = None
    exact: bool | None = None
    approximations: list[str] = field(default_factory=list)
    status: str = "pending"  # "pending" (not reached yet) | "ok" (cold call done) | "failed"
    error: str | None = None
    load_s: float | None = None
    cold_s: float | None = None
    settle_s: float | None = None
    cold_peak_allocated_mib: float | None = None
    hot_s_per_img: list[float] = field(default_factory=list)
    hot_cpu_s_per_img: list[float] = field(default_factory=list)
    denoiser_calls: int | None = None  # per pipeline call (= per batch)
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    psnr_db: float | None = None
    flops_per_image: float | None = None
    denoiser_flops_per_image: float | None = None


class _Run:
    """The state of one bench run: subjects, cells, images, peaks, GEMM rounds, counts."""

    def __init__(self, config: PipelineBenchConfig, log, checkpoint: Checkpoint | None):
        config.validate()
        self.config, self.log, self.checkpoint_to = config, log, checkpoint
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
        self.flops = FlopCounts(config.count_flops)
        self.reports: dict[str, dict] = {}
        self.failed: set[str] = set()
        self.skips_before: dict[str, int] = {}  # Inductor's cudagraph_skips before each row's first call
        self.started, self.load_before = time.time(), load_average()
        for spec in self.specs:  # a bad override is the caller's error: raise before anything loads
            if spec.kind == "farm":
                adapter.farm_recipe(cast(str, spec.recipe), spec.options, self.profile, config.model)
            for b in self.batch_sizes:
                self.row(spec, b)  # rows in spec order, "pending" until their cold call

    def seeds(self, b: int) -> list[int]:
        return list(range(self.config.seed, self.config.seed + b))

    def row(self, spec: BenchSpec, b: int) -> Row:
        return self.rows.setdefault((spec.text, b), Row(spec.text, spec.kind, b))

    def fail(self, spec: BenchSpec, where: str, exc: BaseException, subject: Subject | None = None) -> None:
        """Mark every cell of ``spec`` failed (``where``: load, cold, settle, round n, count), free
        its subject, and go on with the other rows."""
        self.failed.add(spec.text)
        error = f"{where}: {type(exc).__name__}: {exc}"
        self.log(f"[red]{spec.text} failed at {error}[/]")
        for b in self.batch_sizes:
            row = self.row(spec, b)
            if row.status != "failed":
                row.status, row.error = "failed", error
        if subject is not None:
            subject.close()
        self.checkpoint()

    def attempt(self, s: Subject, where: str, fn: Callable[[], object]) -> bool:
        """Run one step of subject ``s``; a failure marks its rows failed (see :meth:`fail`)."""
        if s.spec.text in self.failed:
            return False
        try:
            fn()
        except Exception as exc:  # recorded on the row with its type and message; the other rows go on
            self.fail(s.spec, where, exc, s)
            return False
        return True

    def load(self, spec: BenchSpec) -> Subject | None:
        self.log(f"loading {self.config.model} for {spec.text} …")
        try:
            s = load_subject(spec, self.workload, self.profile)
        except Exception as exc:  # as in attempt(): the row records why it has no numbers
            self.fail(spec, "load", exc)
            return None
        self.reports[spec.text] = s.summary()
        return s

    def resolve_pool(self, subjects: list[Subject]) -> list[int]:
        """With ``pool`` among the batch sizes, measure the first farm subject's batch size (after
        its cold renders, so they stay first calls); returns the batch sizes it adds."""
        farm = next((s for s in subjects if s.spec.kind == "farm" and s.spec.text not in self.failed), None)
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
        """The cold call, then the settle call; after the settle call of the row's first batch, the
        row's ``observed`` facts."""
        def first() -> None:
            self.skips_before.setdefault(s.spec.text, cudagraph_skips())
            images, timer, memory = timed_render(s, self.seeds(b))
            self.images[s.spec.text, b] = images
            row = self.row(s.spec, b)
            row.status = "ok"
            row.resolved, row.dtype, row.exact, row.approximations = s.resolved, s.dtype, s.exact, list(
                s.approximations)
            row.load_s, row.cold_s = round(s.load_s, 3), round(timer.seconds, 3)
            row.cold_peak_allocated_mib = mib(s.weights_bytes + memory.growth)
            self.log(f"cold {s.spec.text} batch {b}: {timer.seconds:.2f} s")

        def settle() -> None:
            _, timer, _ = timed_render(s, self.seeds(b))
            self.row(s.spec, b).settle_s = round(timer.seconds, 3)
            if "observed" not in self.reports[s.spec.text]:
                self.reports[s.spec.text]["observed"] = observe(s.pipe, self.device, s.render_context,
                                                                self.skips_before.get(s.spec.text))

        if self.attempt(s, f"cold call, batch {b}", first) and self.attempt(s, f"settle call, batch {b}", settle):
            self.checkpoint()

    def hot(self, s: Subject, b: int, round_: int) -> None:
        def timed() -> None:
            _, timer, memory = timed_render(s, self.seeds(b))
            key = (s.spec.text, b)
            row = self.rows[key]
            row.hot_s_per_img.append(round(timer.seconds / b, 4))
            row.hot_cpu_s_per_img.append(round(timer.cpu_seconds / b, 4))
            self.peaks.setdefault(key, []).append(s.weights_bytes + memory.growth)
            if memory.peak_reserved is not None:
                self.reserved[key] = max(self.reserved.get(key, 0), memory.peak_reserved)
            self.log(f"round {round_ + 1}/{self.config.repeats} {s.spec.text} batch {b}: "
                     f"{timer.seconds / b:.3f} s/img"
                     + (f"  (load {load_average()[0]})" if device_kind(self.device) == "cpu" else ""))

        self.attempt(s, f"round {round_ + 1}, batch {b}", timed)

    def measure_gemm(self) -> None:
        if not self.config.measure_gemm:
            return
        self.gemm_sizes = self.gemm_sizes or gemm_sizes(self.device)  # one size per dtype for every round
        for name, rate in gemm_rates(self.device, self.gemm_sizes).items():
            self.gemm[name].append(rate)

    def count(self, s: Subject) -> None:
        """FLOPs and denoiser calls of one batch-1 render, once per architecture. A count that fails
        leaves the row's timings standing: the error goes to the row's report."""
        if s.spec.text in self.failed:
            return
        try:
            self._count(s)
        except Exception as exc:  # the counting pass (eager, FlopCounterMode) is not the row being timed
            self.reports[s.spec.text]["count_error"] = f"{type(exc).__name__}: {exc}"
            self.log(f"[yellow]{s.spec.text}: no FLOP/denoiser count ({type(exc).__name__}: {exc})[/]")

    def _count(self, s: Subject) -> None:
        if self.flops.count(s.spec.text, s.pipe, lambda: s.render([self.config.seed])):
            self.log(f"counted {'FLOPs and ' if self.config.count_flops else ''}denoiser calls with {s.spec.text}")

    def rounds(self, subjects: list[Subject]) -> None:
        """The timed rounds of ``subjects``' cells, round-robin, the order rotating each round."""
        for r in range(self.config.repeats):
            cells = [(s, b) for s in subjects if s.spec.text not in self.failed for b in self.batch_sizes]
            if not cells:
                return
            self.measure_gemm()
            shift = r % len(cells)
            for s, b in cells[shift:] + cells[:shift]:
                self.hot(s, b, r)
            self.checkpoint()

    def result(self, complete: bool) -> dict:
        """The JSON-able result from what is measured so far."""
        rows = _finish(self)
        machine = machine_facts(self.profile, self.gemm, self.gemm_sizes)
        machine["load_average_before"], machine["load_average_after"] = self.load_before, load_average()
        return {
            "benchmark": "pipeline",
            "complete": complete,
            "config": {**asdict(self.config), "batch_sizes": list(self.config.batch_sizes),
                       "recipes": list(self.config.recipes), "guidance_scale": self.workload.guidance_scale,
                       "pool_batch_size": self.pool, "resolved_batch_sizes": self.batch_sizes,
                       "method": {"cold_calls": 1, "settle_calls": 1, "timed_rounds": self.config.repeats}},
            "machine": machine,
            "flops_by_module": {t: c.by_module for t, c in self.flops.rows.items() if c.by_module},
            "reports": self.reports,
            "rows": rows,
            "seconds": round(time.time() - self.started, 1),
        }

    def checkpoint(self) -> None:
        if self.checkpoint_to is not None:
            self.checkpoint_to(self.result(complete=False))


def _run_resident(run: _Run) -> None:
    subjects = [s for s in map(run.load, run.specs) if s is not None]
    for s in subjects:
        for b in list(run.batch_sizes):
            run.cold(s, b)
    for b in run.resolve_pool(subjects):
        for s in subjects:
            run.cold(s, b)
    run.rounds(subjects)
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
        if s is None:
            continue
        for b in list(run.batch_sizes):
            run.cold(s, b)
        for b in run.resolve_pool([s]):
            run.cold(s, b)
        run.rounds([s])
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


def _finish(run: _Run) -> list[dict]:
    """Every row as a dict with its peaks, PSNR and counts filled in, summarized."""
    refs = _references(run)
    for (text, b), row in run.rows.items():
        if run.peaks.get((text, b)):
            row.peak_allocated_mib = mib(max(run.peaks[text, b]))
        row.peak_reserved_mib = mib(run.reserved.get((text, b)))
        if refs and (text, b) in run.images:
            row.psnr_db = min(psnr(img, refs[seed]) for img, seed in zip(run.images[text, b], run.seeds(b)))
        count, totals = run.flops.rows.get(text), run.flops.totals(text)
        if count is not None and totals is not None:
            row.denoiser_calls = count.denoiser_calls or None
            if run.config.count_flops and totals[0]:
                row.flops_per_image, row.denoiser_flops_per_image = totals[0], totals[1]
                if totals[2]:
                    run.reports[text]["flops_from_eager"] = totals[2]
    rates = {k: statistics.median(v) for k, v in run.gemm.items() if v}
    return summarize([asdict(r) for r in run.rows.values()], rates)


def run_pipeline_bench(config: PipelineBenchConfig, log=print, checkpoint: Checkpoint | None = None) -> dict:
    """Run the benchmark; returns the JSON-able result (``rows``, ``machine``, ``config``,
    ``reports``, ``complete``, …). ``checkpoint(result)`` gets the result so far after every cold
    call, settle call and round (``complete`` false), and the final one is returned.

    ``config.table == "modelcard"`` runs :func:`bench.pipeline.modelcard.run_modelcard` instead.

    Raises:
        ValueError: a bad config or spec, or (model-card table) the forbidden allocator
            configuration. A row that fails to load or render does not raise: it is kept with
            ``status: failed`` and its error.
    """
    if config.table == "modelcard":
        from bench.pipeline.modelcard import run_modelcard

        return run_modelcard(config, log)
    run = _Run(config, log, checkpoint)
    (_run_sequential if config.sequential else _run_resident)(run)
    return run.result(complete=True)
