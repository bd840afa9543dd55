"""Printing and saving bench results: rich tables of the pipeline, model-card and profile results,
and their JSON.

Place in the data flow: the end of every ``renderfarm bench`` command: result dict → table on
the terminal, JSON on disk (``--json``).
"""

from __future__ import annotations

import json
from pathlib import Path

#: (header, row key) of the pipeline table, in the order of the performance pages' tables; a pair
#: of keys is shown "median / best" (the ratios: medians divided, then best rounds divided).
PIPELINE_COLUMNS = (
    ("recipe", "recipe"), ("batch", "batch_size"), ("load s", "load_s"), ("cold s", "cold_s"),
    ("settle s", "settle_s"), ("rounds", "timed_rounds"), ("hot median s/img", "hot_median_s_per_img"),
    ("hot best s/img", "hot_best_s_per_img"), ("spread %", "hot_spread_pct"), ("it/s", "it_per_s"),
    ("img/s", "images_per_s"), ("peak alloc MiB", "peak_allocated_mib"), ("peak reserved MiB", "peak_reserved_mib"),
    ("PSNR dB", "psnr_db"), ("GFLOP/img", "flops_per_image"), ("GFLOP/s", "achieved_gflop_per_s"),
    ("% fp32 GEMM", "pct_of_fp32_matmul"), ("% bf16 GEMM", "pct_of_bf16_matmul"),
    ("vs reference median / best", ("speedup", "speedup_best")), ("vs peer median / best", ("vs_peer", "vs_peer_best")),
)
#: The columns of the SDNQ model card's tables.
MODELCARD_COLUMNS = (
    ("recipe", "recipe"), ("load s", "load_s"), ("load peak MiB", "load_peak_allocated_mib"),
    ("cold s", "cold_s"), ("cold peak MiB", "cold_peak_allocated_mib"), ("hot mean s/img", "hot_mean_s_per_img"),
    ("hot median s/img", "hot_median_s_per_img"), ("hot range s/img", "hot_range_s_per_img"),
    ("hot peak reserved MiB", "hot_peak_reserved_mib"), ("hot peak allocated MiB", "hot_peak_allocated_mib"),
    ("hot speed vs first", "speed_vs_first"), ("hot peak vs first", "peak_vs_first"),
)
RATIOS = ("speedup", "vs_peer", "speedup_best", "vs_peer_best", "speed_vs_first", "peak_vs_first")


def _fmt(key, value) -> str:
    if isinstance(key, tuple):  # a pair of columns in one cell
        return " / ".join(_fmt(k, v) for k, v in zip(key, value))
    if value is None:
        return "-"
    if key == "psnr_db":
        return "inf (identical)" if value in (float("inf"), "inf") else f"{value:.1f}"
    if key.startswith("flops") or key.endswith("flops_per_image"):
        return f"{value / 1e9:.4g}"
    if key in RATIOS:
        return f"{value:.2f}x"
    if isinstance(value, list):
        return "–".join(_fmt("", v) for v in value)
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def _table(title: str, columns, rows: list[dict], caption: str):
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "recipe" else "right")
    for row in rows:
        cells = [_fmt(key, tuple(row.get(k) for k in key) if isinstance(key, tuple) else row.get(key))
                 for _, key in columns]
        if row.get("status", "ok") != "ok":
            cells[0] += f" ({row['status']})"
        table.add_row(*cells)
    return table


def _machine_caption(m: dict) -> str:
    rates, sizes = m.get("gemm_flops_per_s") or {}, m.get("gemm_sizes") or {}
    gemm = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" + (f" at {sizes[k]}³" if k in sizes else "")
                     for k, v in rates.items())
    device = m["device"].get("name") or m["device"]["kind"]
    text = f"{device}; torch {m['torch']}"
    if gemm:
        text += f"; GEMM {gemm} (medians)"
    if m["device"]["kind"] == "cpu":
        before, after = m.get("load_average_before"), m.get("load_average_after")
        if before and after:
            text += f"; {m['threads']} threads, load average {before[0]} → {after[0]} on {m['nproc']} cores"
    return text


def result_table(result: dict):
    """A rich Table of a :func:`bench.pipeline.side_by_side.run_pipeline_bench` result (either table)."""
    c = result["config"]
    head = f"{c['model']} {c['width']}x{c['height']}, {c['steps']} steps, guidance {c['guidance_scale']}"
    caption = _machine_caption(result["machine"])
    if result["benchmark"] == "modelcard":
        return _table(f"bench pipeline --table modelcard: {head}, {c['repeats']} hot renders",
                      MODELCARD_COLUMNS, result["rows"], caption)
    if not c.get("sequential"):
        caption += "; reserved = the whole process (every pipeline resident)"
    caption += _method_note(result)
    return _table(f"bench pipeline: {head}, {c['repeats']} rounds", PIPELINE_COLUMNS, result["rows"], caption)


def _method_note(result: dict) -> str:
    """What the timings are, and what went wrong: rows that failed, a run that did not finish,
    rounds dropped by ``bench show --skip-rounds``, fewer rounds than :data:`MIN_ROUNDS`."""
    from bench.pipeline.summary import MIN_ROUNDS

    rows, method = result["rows"], result["config"].get("method") or {}
    note = ("; each row: 1 cold + 1 settle call untimed, then timed rounds" if method.get("settle_calls")
            else "; each row: 1 cold call untimed, then timed rounds (no settle call)")
    if result.get("skipped_rounds"):
        note += f"; the first {result['skipped_rounds']} timed round(s) of every row dropped"
    timed = [r.get("timed_rounds") or 0 for r in rows if r.get("status", "ok") == "ok"]
    pending = [f"{r['recipe']} batch {r['batch_size']}" for r in rows if r.get("status") == "pending"]
    if pending:
        note += f"; not reached: {', '.join(pending)}"
    if timed and min(timed) < MIN_ROUNDS:
        note += f"; fewer than {MIN_ROUNDS} timed rounds: indicative only"
    if result.get("complete") is False:
        note += "; INCOMPLETE: the run stopped before its end"
    for row in rows:
        if row.get("error"):
            note += f"; {row['recipe']} batch {row['batch_size']} failed at {row['error']}"
    return note


def profile_tables(result: dict) -> list:
    """Rich tables of a :func:`bench.pipeline.profile.run_profile` result: counts per step, and
    time by category."""
    from rich.table import Table

    c = result["config"]
    counts = Table(title=f"bench profile: {c['model']} {c['recipe']} {c['width']}x{c['height']}, {c['steps']} steps, "
                         f"batch {c['batch_size']}: per denoising step (median of {result['steps']} steps)")
    counts.add_column("what")
    for column in ("per step", "per scheduler.step", "per denoiser call"):
        counts.add_column(column, justify="right")
    per = {k: result[k] for k in ("per_step", "per_scheduler_step", "per_denoiser_call")}
    for key, label in (("launches", "kernel launches (API calls)"), ("kernels", "kernels run"),
                       ("syncs", "host-device syncs (API calls)"), ("d2h_copies", "D2H copies"),
                       ("cpu_ops", "ATen ops (CPU)")):
        counts.add_row(label, *(_fmt("", per[p].get(key)) for p in per))
    sync = result.get("sync_debug")
    if sync:
        counts.add_row("sync-debug warnings", _fmt("", sync.get("per_step")), _fmt("", sync.get("scheduler.step")),
                       _fmt("", sync.get("denoiser")))
    times = Table(title=f"where a step's time goes ({result['time_unit']}, {result['timeline']})")
    times.add_column("category")
    for column in ("whole render ms", "%", "denoiser ms", "%"):
        times.add_column(column, justify="right")
    render, denoiser = result["time_by_category"]["render"], result["time_by_category"]["denoiser"]
    r_total, d_total = sum(render.values()) or 1, sum(denoiser.values()) or 1
    for cat in render:
        times.add_row(cat, f"{render[cat]:.2f}", f"{100 * render[cat] / r_total:.1f}",
                      f"{denoiser.get(cat, 0):.2f}", f"{100 * denoiser.get(cat, 0) / d_total:.1f}")
    d = result.get("denoiser") or {}
    if d.get("pct_of_bf16_matmul") is not None:
        times.caption = (f"denoiser: {d['ms_per_call']:.2f} ms per call, {d['flops_per_call'] / 1e9:.4g} GFLOP per "
                         f"call, {d['pct_of_bf16_matmul']}% of the measured bf16 GEMM rate")
    return [counts, times]


def write_json(result: dict, path: str | Path) -> None:
    """Write ``result`` as indented JSON (``inf`` as the string ``"inf"``), atomically: to a
    ``.partial`` file first, then renamed over ``path``."""
    def clean(x):
        if isinstance(x, float) and x == float("inf"):
            return "inf"
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a reader never sees a half-written file
    partial.write_text(json.dumps(clean(result), indent=2))
    partial.replace(path)


def resummarize(result: dict, skip_rounds: int = 0) -> dict:
    """A pipeline bench result read from its JSON, summarized again from its kept rounds (see
    :func:`bench.pipeline.summary.summarize`), less the first ``skip_rounds`` timed rounds of every
    row: for files whose first timed round was the warm-up (written before the settle call).

    Raises:
        ValueError: ``result`` is not a ``bench pipeline`` result with rows.
    """
    from bench.pipeline.summary import gemm_medians, summarize

    if result.get("benchmark") != "pipeline" or not isinstance(result.get("rows"), list):
        raise ValueError("not a bench pipeline result (benchmark: pipeline, with rows)")
    psnr = {(r["recipe"], r["batch_size"]): r.get("psnr_db") for r in result["rows"]}
    rows = summarize(result["rows"], gemm_medians(result), skip_rounds)
    for row in rows:  # inf was written as the string "inf"
        row["psnr_db"] = float(psnr[row["recipe"], row["batch_size"]]) if psnr[row["recipe"], row["batch_size"]] \
            is not None else None
    return {**result, "rows": rows, "skipped_rounds": skip_rounds}

