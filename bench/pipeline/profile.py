"""``renderfarm bench profile``: what one hot render does per denoising step.

Place in the data flow: beside the pipeline. The command line builds a :class:`ProfileConfig`;
:func:`run_profile` loads one subject (any bench spec), renders it cold and hot, then:

1. profiles one more hot render with ``torch.profiler`` (CPU, and CUDA where present), with
   ranges around each step, denoiser call and ``scheduler.step``
   (:class:`~bench.pipeline.render_probes.StepMarks`), and reads the trace (:mod:`bench.pipeline.trace`):
   kernel launches, kernels, host-device synchronizations and device-to-host copies per step,
   per ``scheduler.step`` and per denoiser call; device time by category (attention, GEMM,
   norms, elementwise/other) for the whole render and for the denoiser;
2. on CUDA, renders once more under ``torch.cuda.set_sync_debug_mode("warn")`` and counts the
   warnings (each a synchronizing call) by where the render was: denoiser, ``scheduler.step``,
   the rest of a step, or outside the loop, with the source lines that raised them;
3. counts the denoiser's FLOPs per call (``FlopCounterMode``) and sets them against its device
   time and the measured bf16 GEMM rate: the denoiser's % of the bf16 roofline.

The ERNIE-ViLG 2.0 article (Baidu, PaddlePaddle) is the yardstick for the counts: about 12 → 7
kernel launches per ``scheduler.step`` and no host-device synchronization in the loop.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from bench.pipeline import adapter, trace
from bench.pipeline.instruments import device_kind, gemm_rates, machine_facts
from bench.pipeline.render_probes import StepMarks, count_render
from bench.pipeline.specs import parse_spec
from bench.pipeline.subjects import Workload, load_subject, timed_render
from pipeline.device import probe


@dataclass(frozen=True)
class ProfileConfig:
    """One profile: a model, one bench spec (``recipe``), a size in pixels, steps and batch size.
    ``trace``: where to also save the Chrome trace (gzip when it ends in ``.gz``)."""

    model: str
    recipe: str = "exact"
    width: int = 256
    height: int = 256
    steps: int = 4
    batch_size: int = 1
    guidance_scale: float | None = None
    device: str = "auto"
    cache_dir: str | None = None
    seed: int = 0
    trace: str | None = None


def _profiled_render(subject, seeds: list[int], keep: str | None) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_kind(subject.device) == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    marks = StepMarks()
    with marks.installed(subject.pipe), torch.profiler.profile(activities=activities) as prof:
        subject.render(seeds, on_step=marks.on_step)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="renderfarm-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
        if keep:
            opener = gzip.open if keep.endswith(".gz") else open
            with open(path, "rb") as src, opener(keep, "wb") as dst:
                dst.write(src.read())
    finally:
        os.unlink(path)
    return trace.analyze(data.get("traceEvents", []), (StepMarks.STEP, StepMarks.DENOISER, StepMarks.SCHEDULER_STEP))


def _sync_debug(subject, seeds: list[int]) -> dict:
    """Synchronizing CUDA calls of one render, by phase, from ``set_sync_debug_mode("warn")``."""
    marks = StepMarks()
    by_phase: collections.Counter = collections.Counter()
    where: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            by_phase[marks.phase] += 1
            where[f"{marks.phase}: {os.path.basename(filename)}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with marks.installed(subject.pipe):
                subject.render(seeds, on_step=marks.on_step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    in_loop = by_phase["denoiser"] + by_phase["scheduler.step"] + by_phase["step"]
    return {"total": sum(by_phase.values()), "in_loop": in_loop, "steps": marks.steps,
            "per_step": round(in_loop / marks.steps, 2) if marks.steps else None,
            "denoiser": by_phase["denoiser"], "scheduler.step": by_phase["scheduler.step"],
            "rest_of_step": by_phase["step"], "outside_loop": by_phase["outside"],
            "top_sources": dict(where.most_common(10))}


def run_profile(config: ProfileConfig, log=print) -> dict:
    """Profile one hot render of ``config.recipe``; returns the JSON-able result (see module doc).

    Raises:
        ValueError: a bad spec, size or recipe (as the pipeline bench raises them).
    """
    if config.batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {config.batch_size}")

    started = time.time()
    profile = probe(config.device)
    guidance = adapter.default_guidance_scale() if config.guidance_scale is None else config.guidance_scale
    workload = Workload(config.model, config.width, config.height, config.steps, guidance, config.cache_dir)
    spec = parse_spec(config.recipe)
    log(f"loading {config.model} for {spec.text} …")
    subject = load_subject(spec, workload, profile)
    seeds = list(range(config.seed, config.seed + config.batch_size))
    _, cold, _ = timed_render(subject, seeds)
    _, hot, _ = timed_render(subject, seeds)
    log(f"cold {cold.seconds:.2f} s, hot {hot.seconds:.3f} s; profiling one hot render …")
    result = _profiled_render(subject, seeds, config.trace)
    sync = None
    if device_kind(subject.device) == "cuda":
        log("counting synchronizing calls (torch.cuda.set_sync_debug_mode) …")
        sync = _sync_debug(subject, seeds)
    log("counting the denoiser's FLOPs …")
    count = count_render(subject.pipe, lambda: subject.render(seeds))
    rate = gemm_rates(subject.device)["bfloat16"]
    denoiser = result["denoiser"]
    if count.denoiser_calls:
        denoiser["flops_per_call"] = count.denoiser_flops / count.denoiser_calls
        ms = denoiser.get("ms_per_call")
        denoiser["pct_of_bf16_matmul"] = (float(f"{100 * denoiser['flops_per_call'] / (ms / 1000 * rate):.3g}")
                                          if ms else None)
    subject.close()
    return {
        "benchmark": "profile",
        "config": {**asdict(config), "guidance_scale": guidance},
        "subject": {"resolved": subject.resolved, "dtype": subject.dtype, "approximations": subject.approximations,
                    "applied": subject.report.get("applied", {}), "skipped": subject.report.get("skipped", {})},
        "machine": {**machine_facts(profile), "gemm_bf16_flops_per_s": round(rate)},
        "cold_s": round(cold.seconds, 3), "hot_s": round(hot.seconds, 3),
        **result,
        "sync_debug": sync,
        "flops_per_render": count.flops,
        "seconds": round(time.time() - started, 1),
    }
