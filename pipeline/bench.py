"""``renderfarm bench pipeline``: recipes against the diffusers baseline, in one process, one run.

Place in the data flow: beside the pipeline, not in it. It loads the same model once per recipe
(the baseline exactly as a user of diffusers would: ``DiffusionPipeline.from_pretrained``, the
default attention, float32, the full VAE, one image per call), renders the same prompts and
seeds through each, and reports, per recipe and batch size, the columns of seed 002's tables
(load s, cold s, hot mean and median s/img, peak memory MiB), images/s, the speed-up over the
baseline, the PSNR against the baseline's pixels, and a roofline:

* **FLOPs per image**: ``torch.utils.flop_counter.FlopCounterMode`` over one full render (text
  encoder, every UNet step, VAE decode) at batch 1. Two ops the stock registry misses on the
  CPU are added: ``aten.mkldnn_convolution`` (the batch-invariant convolution of
  :mod:`pipeline.invariance`) and ``aten._scaled_dot_product_flash_attention_for_cpu``.
* **Machine FLOP/s**: a dense GEMM (``torch.mm``, M = N = K = 2048) in float32 and bfloat16 on
  every core, measured once per round between the renders, so it sees the same machine load.
* **Floor** = FLOPs per image / GEMM FLOP/s of the recipe's dtype; **% of floor** = floor /
  hot median s/img × 100 (100 % = every FLOP at dense-GEMM speed).

Timing discipline: every pipeline stays resident; recipes and batch sizes are interleaved
round-robin over ``repeats`` rounds (the order rotates each round), so machine noise (other
processes on the cores) hits every cell alike; medians are reported, with the best round and
the process CPU seconds per image beside them (on a shared machine a burst of other work can
slow one round several-fold, more than its share of the cores, since a parallel region waits
for its slowest thread). The machine's load average is recorded before and after.

Memory on the CPU is the process RSS, so "peak MiB" is charged per recipe: the bytes of its
own weights plus the RSS high-water (``VmHWM``) gained during its hot renders, after handing
freed heap back to the OS (``malloc_trim``). On an accelerator it is the weights plus
``max_memory_allocated`` gained during the render.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.device import DeviceProfile, probe
from pipeline.memory import current_bytes, peak_bytes, reset_peak
from pipeline.recipes import BASELINE, Recipe, apply_overrides, recipe_for

PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a red fox in the snow, golden hour",
    "an isometric city map, pastel colors",
    "a bowl of ramen, studio lighting",
    "portrait of an old sailor, oil on canvas",
    "a glass teapot on a wooden table",
    "a lighthouse in a storm, dramatic sky",
    "a field guide plate of botanical ferns",
)
GEMM_SIZE = 2048
MIB = 2**20


@dataclass(frozen=True)
class PipelineBenchConfig:
    """What to measure. Sizes in pixels; ``guidance_scale`` None = the pipeline's default (7.5)."""

    model: str
    width: int = 256
    height: int = 256
    steps: int = 4
    batch_sizes: tuple[int, ...] = (1, 4)
    recipes: tuple[str, ...] = ("baseline", "exact", "fast")
    repeats: int = 3
    guidance_scale: float | None = None
    device: str = "auto"
    cache_dir: str | None = None
    seed: int = 0
    count_flops: bool = True


@dataclass
class Row:
    """One (recipe, batch size) cell. Seconds, MiB, FLOPs and dB as the field names say."""

    recipe: str
    resolved: str
    batch_size: int
    exact: bool
    approximations: list[str]
    load_s: float
    cold_s: float
    hot_s_per_img: list[float] = field(default_factory=list)
    hot_cpu_s_per_img: list[float] = field(default_factory=list)
    hot_mean_s_per_img: float | None = None
    hot_median_s_per_img: float | None = None
    hot_best_s_per_img: float | None = None
    cpu_s_per_img: float | None = None  # median process CPU seconds (all threads) per image
    peak_mib: float | None = None
    images_per_s: float | None = None
    speedup: float | None = None
    psnr_db: float | None = None
    flops_per_image: float | None = None
    dtype: str = "float32"
    floor_s_per_img: float | None = None
    pct_of_floor: float | None = None


# ---- recipes ---------------------------------------------------------------------------------

def parse_recipe_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"exact"`` or ``"exact:compile_unet=true+num_threads=1"`` → (name, overrides).

    Overrides are ``+``-separated ``key=value`` pairs (commas separate recipes on the command
    line); values are JSON (``true``, ``4``, ``"x"``) or, failing that, plain strings.
    """
    name, _, rest = spec.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split("+"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"recipe override {item!r} in {spec!r} is not key=value")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return name.strip(), overrides


def resolve_recipe(spec: str, profile: DeviceProfile, model: str) -> Recipe:
    """The :class:`Recipe` a bench spec names, fitted to ``profile``.

    For the offline ``*-arch`` models (random weights) a recipe's tiny VAE is the offline
    ``taesd-arch`` (same architecture, random weights), since the real TAESD decodes trained
    latents only.
    """
    from pipeline.models import OFFLINE_MODELS
    from pipeline.optimize import OFFLINE_TINY_VAES

    name, overrides = parse_recipe_spec(spec)
    recipe = recipe_for(profile, name)
    if model in OFFLINE_MODELS and recipe.tiny_vae and "tiny_vae" not in overrides:
        overrides["tiny_vae"] = next(iter(OFFLINE_TINY_VAES))
    recipe = apply_overrides(recipe, overrides, allow_approximate=name not in ("exact", "baseline"))
    return replace(recipe, name=spec if spec != name or name == "baseline" else recipe.name)


# ---- subjects: one resident pipeline per recipe ------------------------------------------------

class Subject:
    """A recipe's resident pipeline and how to render seeds with it."""

    def __init__(self, spec: str, config: PipelineBenchConfig, profile: DeviceProfile):
        self.spec = spec
        self.config = config
        self.device = profile.torch_device
        self.baseline = spec == "baseline"
        self.recipe = BASELINE if self.baseline else resolve_recipe(spec, profile, config.model)
        self.threads = self.recipe.num_threads or torch.get_num_threads()
        self.flops: tuple[float, dict[str, float]] | None = None
        t0 = time.perf_counter()
        if self.baseline:
            from diffusers import DiffusionPipeline

            self.pipe = DiffusionPipeline.from_pretrained(_model_path(config)).to(self.device)
            self.pipe.set_progress_bar_config(disable=True)
            self.report: dict = {"applied": {}, "skipped": {}}
            self.renderer = None
        else:
            from pipeline.models import load_pipeline
            from pipeline.optimize import apply_recipe
            from pipeline.render import Renderer

            self.pipe = load_pipeline(config.model, cache_dir=_cache_dir(config))
            self.report = apply_recipe(self.pipe, self.recipe, device=self.device)
            self.renderer = Renderer(self.pipe, device=self.device, model=config.model)
        self.load_s = time.perf_counter() - t0
        self.weights_bytes = _weights_bytes(self.pipe)

    @property
    def dtype(self) -> str:
        return self.recipe.dtype

    def render(self, seeds: list[int]) -> list[np.ndarray]:
        """Render one call with ``seeds`` (prompt i ↔ seed i); returns uint8 HWC arrays."""
        torch.set_num_threads(self.threads)
        c = self.config
        prompts = [PROMPTS[s % len(PROMPTS)] for s in seeds]
        if self.baseline:
            kwargs = {} if c.guidance_scale is None else {"guidance_scale": c.guidance_scale}
            images = self.pipe(prompt=prompts, width=c.width, height=c.height, num_inference_steps=c.steps,
                               generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
                               output_type="pil", **kwargs).images
        else:
            from infra.schemas import RenderRequest

            extra = {} if c.guidance_scale is None else {"guidance_scale": c.guidance_scale}
            images = self.renderer.render([
                RenderRequest(prompt=p, seed=s, model=c.model, width=c.width, height=c.height,
                              num_inference_steps=c.steps, **extra) for p, s in zip(prompts, seeds)])
        _sync(self.device)
        return [np.asarray(im.convert("RGB")) for im in images]


def _cache_dir(config: PipelineBenchConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir)
    from infra.settings import get_settings

    return get_settings().cache_dir


def _model_path(config: PipelineBenchConfig) -> str:
    from pipeline.models import OFFLINE_MODELS, build_offline_model

    if config.model in OFFLINE_MODELS:
        return str(build_offline_model(config.model, _cache_dir(config)))
    return config.model


def _weights_bytes(pipe) -> int:
    seen, total = set(), 0
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                key = (t.untyped_storage().data_ptr(), t.device)
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total


def _sync(device: str) -> None:
    kind = device.partition(":")[0]
    mod = getattr(torch, kind, None) if kind in ("cuda", "xpu", "npu", "mps") else None
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so RSS growth is real use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- machine and FLOPs --------------------------------------------------------------------------

def matmul_flops_per_s(dtype: torch.dtype, device: str = "cpu", n: int = GEMM_SIZE, reps: int = 5) -> float:
    """Median FLOP/s of ``torch.mm`` on two n×n matrices (2·n³ FLOPs per call) in ``dtype``,
    with the current torch thread count (all cores by default); one warm-up call first."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def _flop_mapping() -> dict:
    from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

    def mkldnn_conv(x_shape, w_shape, *args, out_shape=None, **kwargs):
        return conv_flop_count(x_shape, w_shape, out_shape, transposed=False)

    def sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    mapping = {torch.ops.aten.mkldnn_convolution: mkldnn_conv}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_cpu
    return mapping


def count_flops(subject: Subject, seed: int = 0) -> tuple[float, dict[str, float]]:
    """FLOPs of one full batch-1 render (text encoder + UNet steps + VAE decode) and the
    split by top-level module class, from ``FlopCounterMode``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, depth=1, custom_mapping=_flop_mapping()) as counter:
        subject.render([seed])
    by_module = {k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()
                 if k != "Global" and "." not in k}
    return float(counter.get_total_flops()), by_module


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (peak 255); inf when identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (runnable processes; this machine has ``nproc`` cores)."""
    return [round(x, 2) for x in os.getloadavg()]


# ---- the run -----------------------------------------------------------------------------------

def run_pipeline_bench(config: PipelineBenchConfig, log=print) -> dict:
    """Run the benchmark; returns the JSON-able result (``rows``, ``machine``, ``config``)."""
    if config.repeats < 1 or not config.batch_sizes or not config.recipes:
        raise ValueError("need repeats >= 1, at least one batch size and one recipe")
    profile = probe(config.device)
    load_before = load_average()
    started = time.time()
    subjects: dict[str, Subject] = {}
    for spec in config.recipes:
        log(f"loading {config.model} for recipe {spec} …")
        subjects[spec] = Subject(spec, config, profile)
    cells = [(spec, b) for spec in config.recipes for b in config.batch_sizes
             if not (spec == "baseline" and b != 1)]  # the baseline is diffusers' one image per call
    seeds = {b: list(range(config.seed, config.seed + b)) for b in config.batch_sizes}
    images: dict[tuple[str, int], list[np.ndarray]] = {}
    rows: dict[tuple[str, int], Row] = {}
    for spec, b in cells:  # cold: the first call at this batch size after load
        s = subjects[spec]
        t0 = time.perf_counter()
        images[spec, b] = s.render(seeds[b])
        rows[spec, b] = Row(spec, s.recipe.name, b, not s.recipe.approximations(), s.recipe.approximations(),
                            round(s.load_s, 3), round(time.perf_counter() - t0, 3), dtype=s.dtype)
        log(f"cold {spec} batch {b}: {rows[spec, b].cold_s:.2f} s")
    gemm: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    peaks: dict[tuple[str, int], int] = {}
    for r in range(config.repeats):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            gemm[name].append(matmul_flops_per_s(dtype, profile.torch_device))
        order = cells[r % len(cells):] + cells[:r % len(cells)]
        for spec, b in order:
            s = subjects[spec]
            _trim_heap()
            before = current_bytes(s.device)
            reset_peak(s.device)
            c0, t0 = time.process_time(), time.perf_counter()
            s.render(seeds[b])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            peaks[spec, b] = max(peaks.get((spec, b), 0), peak_bytes(s.device) - before)
            rows[spec, b].hot_s_per_img.append(round(dt / b, 4))
            rows[spec, b].hot_cpu_s_per_img.append(round(cpu / b, 4))
            log(f"round {r + 1}/{config.repeats} {spec} batch {b}: {dt / b:.2f} s/img  (load {load_average()[0]})")
    baseline_extra = _baseline_references(subjects.get("baseline"), seeds, images)
    flops: dict[tuple, tuple[float, dict]] = {}
    if config.count_flops:
        for spec, s in subjects.items():
            key = tuple(type(s.pipe.components[k]).__name__ for k in ("text_encoder", "unet", "vae")
                        if k in s.pipe.components)
            if key not in flops:
                log(f"counting FLOPs of one render with {spec} …")
                flops[key] = count_flops(s, config.seed)
            s.flops = flops[key]
    rates = {k: statistics.median(v) for k, v in gemm.items()}
    base = rows.get(("baseline", 1))
    base_median = statistics.median(base.hot_s_per_img) if base else None
    for (spec, b), row in rows.items():
        s = subjects[spec]
        row.hot_mean_s_per_img = round(statistics.fmean(row.hot_s_per_img), 4)
        row.hot_median_s_per_img = round(statistics.median(row.hot_s_per_img), 4)
        row.hot_best_s_per_img = round(min(row.hot_s_per_img), 4)
        row.cpu_s_per_img = round(statistics.median(row.hot_cpu_s_per_img), 4)
        row.images_per_s = round(1 / row.hot_median_s_per_img, 4)
        row.peak_mib = round((s.weights_bytes + max(0, peaks.get((spec, b), 0))) / MIB, 1)
        if base_median:
            row.speedup = round(base_median / row.hot_median_s_per_img, 3)
        refs = baseline_extra
        if refs:
            row.psnr_db = min(psnr(img, refs[seed]) for img, seed in zip(images[spec, b], seeds[b]))
        if s.flops:
            row.flops_per_image = s.flops[0]
            rate = rates["bfloat16" if s.dtype == "bfloat16" else "float32"]
            # significant figures, not decimals: a small model's floor is well under 1 ms, and a
            # fixed 4-decimal rounding turned it (and its percentage) into 0
            floor = row.flops_per_image / rate
            row.floor_s_per_img = float(f"{floor:.4g}")
            row.pct_of_floor = float(f"{100 * floor / row.hot_median_s_per_img:.3g}")
    return {
        "benchmark": "pipeline",
        "config": {**asdict(config), "batch_sizes": list(config.batch_sizes), "recipes": list(config.recipes)},
        "machine": {
            "device": profile.to_dict(), "platform": platform.platform(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_before": load_before,
            "load_average_after": load_average(), "nproc": os.cpu_count(),
            "gemm_size": GEMM_SIZE, "gemm_flops_per_s": {k: round(v) for k, v in rates.items()},
            "gemm_flops_per_s_rounds": {k: [round(x) for x in v] for k, v in gemm.items()},
        },
        "flops_by_module": {spec: s.flops[1] for spec, s in subjects.items() if s.flops},
        "reports": {spec: {"recipe": s.recipe.to_dict(), "applied": s.report.get("applied", {}),
                           "skipped": s.report.get("skipped", {})} for spec, s in subjects.items()},
        "rows": [asdict(r) for r in rows.values()],
        "seconds": round(time.time() - started, 1),
    }


def _baseline_references(baseline: Subject | None, seeds: dict[int, list[int]],
                         images: dict[tuple[str, int], list[np.ndarray]]) -> dict[int, np.ndarray]:
    """The baseline's image for every seed any cell used (rendered one per call, untimed)."""
    if baseline is None:
        return {}
    refs = dict(zip(seeds[1], images["baseline", 1])) if ("baseline", 1) in images else {}
    for seed in sorted({s for group in seeds.values() for s in group} - set(refs)):
        refs[seed] = baseline.render([seed])[0]
    return refs


# ---- output ------------------------------------------------------------------------------------

COLUMNS = (
    ("recipe", "recipe"), ("batch", "batch_size"), ("load s", "load_s"), ("cold s", "cold_s"),
    ("hot mean s/img", "hot_mean_s_per_img"), ("hot median s/img", "hot_median_s_per_img"),
    ("hot best s/img", "hot_best_s_per_img"), ("CPU s/img", "cpu_s_per_img"),
    ("peak MiB", "peak_mib"), ("img/s", "images_per_s"), ("speed-up", "speedup"), ("PSNR dB", "psnr_db"),
    ("GFLOP/img", "flops_per_image"), ("floor s/img", "floor_s_per_img"), ("% of floor", "pct_of_floor"),
)


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "psnr_db":
        return "inf (identical)" if value == float("inf") else f"{value:.1f}"
    if key == "flops_per_image":
        return f"{value / 1e9:.4g}"
    if key == "speedup":
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def result_table(result: dict):
    """A rich Table of a :func:`run_pipeline_bench` result, with the machine in its caption."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    g = c["guidance_scale"] if c["guidance_scale"] is not None else "default"
    table = Table(title=f"bench pipeline: {c['model']} {c['width']}x{c['height']}, {c['steps']} steps, "
                        f"guidance {g}, {c['repeats']} rounds")
    for header, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "recipe" else "right")
    for row in result["rows"]:
        table.add_row(*(_fmt(key, row[key]) for _, key in COLUMNS))
    rates = m["gemm_flops_per_s"]
    table.caption = (f"{m['device'].get('name') or m['device']['kind']}, {m['threads']} threads; GEMM {m['gemm_size']}³ "
                     f"fp32 {rates['float32'] / 1e9:.0f} GFLOP/s, bf16 {rates['bfloat16'] / 1e9:.0f} GFLOP/s (medians); "
                     f"load average {m['load_average_before'][0]} → {m['load_average_after'][0]} on {m['nproc']} cores")
    return table


def write_json(result: dict, path: str | Path) -> None:
    """Write ``result`` as indented JSON (``inf`` PSNR as the string ``"inf"``)."""
    def clean(x):
        if isinstance(x, float) and x == float("inf"):
            return "inf"
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(result), indent=2))
