"""``renderfarm bench pipeline --table modelcard``: the ERNIE-Image-Turbo SDNQ uint4 model card's
tables, redone here for any model and any specs.

Place in the data flow: :func:`bench.pipeline.side_by_side.run_pipeline_bench` hands a config with
``table="modelcard"`` to :func:`run_modelcard`.

The card (WaveCut/ERNIE-Image-Turbo-SDNQ-uint4-static) measures each configuration alone in a
fresh pipeline: load s and load peak, cold inference s and cold peak, hot mean and median s/img
and the hot peak torch reserved / allocated MiB, with the default CUDA allocator and no
``torch.cuda.empty_cache()`` between hot generations. So here: one subject at a time (loaded,
one cold render, ``repeats`` hot renders, freed), batch 1, and every peak is the process's
(``max_memory_allocated`` / ``max_memory_reserved`` since a reset at the start of the phase; the
RSS high-water mark on the CPU). Before anything loads, the allocator settings are checked: the
card measured ``expandable_segments:True`` with ``max_split_size_mb`` reserving about 48 GiB and
running 2-4x slower, and :func:`pipeline.memory.check_allocator_env` refuses that combination.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from bench.pipeline.instruments import Summary, load_average, machine_facts, mib, psnr
from bench.pipeline.specs import parse_specs
from bench.pipeline.subjects import load_subject, timed_render
from pipeline.device import probe
from pipeline.memory import check_allocator_env


def _highest(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def run_modelcard(config, log=print) -> dict:
    """Run the model-card table for ``config`` (a :class:`bench.pipeline.side_by_side.PipelineBenchConfig`;
    its batch sizes and ``sequential`` are ignored: batch 1, one subject at a time).

    Raises:
        ValueError: the forbidden allocator configuration is set, or a bad spec/config.
    """

    config.validate()
    check_allocator_env(os.environ)
    profile = probe(config.device)
    workload = config.workload()
    seeds = [config.seed]
    started = time.time()
    rows: list[dict] = []
    first_images = None
    for spec in parse_specs(config.recipes):
        log(f"loading {config.model} for {spec.text} …")
        s = load_subject(spec, workload, profile)
        images, cold, cold_memory = timed_render(s, seeds)
        log(f"cold {spec.text}: {cold.seconds:.2f} s")
        hot, windows = [], []
        for r in range(config.repeats):  # the card's "hot peak": the highest of the hot renders'
            _, timer, memory = timed_render(s, seeds)
            hot.append(round(timer.seconds, 4))
            windows.append(memory)
            log(f"hot {r + 1}/{config.repeats} {spec.text}: {timer.seconds:.3f} s/img")
        summary = Summary.of(hot)
        row = {
            "recipe": spec.text, "kind": spec.kind, "resolved": s.resolved, "dtype": s.dtype,
            "approximations": s.approximations, "applied": s.report.get("applied", {}),
            "skipped": s.report.get("skipped", {}), "batch_size": 1,
            "load_s": round(s.load_s, 3), "load_peak_allocated_mib": mib(s.load_memory.peak_allocated),
            "load_peak_reserved_mib": mib(s.load_memory.peak_reserved),
            "cold_s": round(cold.seconds, 3), "cold_peak_allocated_mib": mib(cold_memory.peak_allocated),
            "cold_peak_reserved_mib": mib(cold_memory.peak_reserved),
            "hot_s_per_img": hot, "hot_mean_s_per_img": summary.mean, "hot_median_s_per_img": summary.median,
            "hot_range_s_per_img": [summary.best, max(hot)],
            "hot_peak_reserved_mib": mib(_highest(w.peak_reserved for w in windows)),
            "hot_peak_allocated_mib": mib(_highest(w.peak_allocated for w in windows)),
            "weights_mib": mib(s.weights_bytes),
        }
        if first_images is None:
            first_images, first = images, row
        row["psnr_db"] = min(psnr(a, b) for a, b in zip(images, first_images))
        row["speed_vs_first"] = round(first["hot_median_s_per_img"] / summary.median, 3)
        peak = row["hot_peak_reserved_mib"] or row["hot_peak_allocated_mib"]
        first_peak = first["hot_peak_reserved_mib"] or first["hot_peak_allocated_mib"]
        row["peak_vs_first"] = round(peak / first_peak, 3) if peak and first_peak else None
        rows.append(row)
        s.close()
    return {
        "benchmark": "modelcard",
        "config": {**asdict(config), "batch_sizes": [1], "recipes": list(config.recipes),
                   "guidance_scale": workload.guidance_scale},
        "machine": {**machine_facts(profile), "load_average_after": load_average()},
        "allocator_check": "passed: not expandable_segments together with max_split_size_mb",
        "rows": rows,
        "seconds": round(time.time() - started, 1),
    }
