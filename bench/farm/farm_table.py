"""``renderfarm bench farm``'s table: a :func:`bench.farm.farm.run_farm_bench` result (or its
JSON, read back) as rows of metric, value and target, with the machine in the caption.

Place in the data flow: after the bench; it reads a result dict and touches nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator

from bench.farm.workload import NULL_MODEL


def result_table(result: dict):
    """A rich Table of a :func:`bench.farm.farm.run_farm_bench` result: metric, value, target."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=_title(c))
    for col in ("metric", "value", "target"):
        table.add_column(col, justify="left" if col != "value" else "right")
    for row in (*_path_rows(result), *_host_rows(result), *_submission_rows(result.get("submission"))):
        table.add_row(*row)
    cpu = m.get("cpu")
    table.caption = ((f"{cpu['name']} ({cpu['isa']}); " if cpu else "")
                     + f"load average {m['load_average_before'][0]} → {m['load_average_after'][0]} on "
                     f"{m['nproc']} cores; {result['seconds']:.0f} s in all")
    return table


def _title(c: dict) -> str:
    return (f"bench farm: {c['model']}, {c['jobs']} jobs, {c['workers']} worker(s), batch "
            f"{c['batch_size']}" + (f", {c.get('render_ms_per_image') or 0:g} ms/img"
                                    + f", {c['width']}x{c['height']}"
                                    + f" {c.get('output_format', 'png')}"
                                    if c["model"] == NULL_MODEL else
                                    f", {c['width']}x{c['height']}, {c['steps']} steps, "
                                    f"recipe {c['recipe']}"))


def _path_rows(result: dict) -> Iterator[tuple[str, str, str]]:
    """Throughput of the full path, the simulated GPU's efficiency, the bare loop, the worker's overhead."""
    c = result["config"]
    null = c["model"] == NULL_MODEL
    what = "jobs" if null and not c.get("render_ms_per_image") else "img"
    full = result.get("full_path", {})
    if full:
        yield (f"full path, end to end ({what}/s)", f"{full['images_per_s']:.3f}",
               "≥ 1000 jobs/s (1 worker)" if null and not c.get("render_ms_per_image") else "")
        yield f"full path, first start → last finish ({what}/s)", f"{full['worker_images_per_s']:.3f}", ""
        last = full["runs"][-1] if full.get("runs") else {}
        if last.get("image_bytes_mean") is not None:
            yield (f"encoded image, mean bytes ({', '.join(last['image_sizes'])}, last round)",
                   f"{last['image_bytes_mean']:,}", "")
    sim = result.get("simulated_gpu")
    if sim:
        # the targets this farm was built to: a fast GPU (≤ 100 ms/img) kept ≥ 95 % busy at 64², ≥ 90 % at
        # 512² and above with the default lossless format; a slow one ≥ 99 %
        large = (c.get("width") or 0) * (c.get("height") or 0) >= 512 * 512
        target = "≥ 99 %" if sim["ms_per_image"] > 100 else "≥ 90 %" if large else "≥ 95 %"
        yield (f"simulated GPU: {sim['ms_per_image']:g} ms/img, sleep-bound rate (img/s)",
               f"{sim['sleep_bound_images_per_s']:.3f}", "")
        yield "efficiency, end to end (full path / sleep-bound)", f"{100 * sim['efficiency']:.1f} %", target
        yield "efficiency, first start → last finish", f"{100 * sim['worker_span_efficiency']:.1f} %", ""
    if "bare_loop" in result:
        yield "bare in-process loop (img/s)", f"{result['bare_loop']['images_per_s']:.3f}", ""
        yield "full path / bare loop", f"{100 * full['ratio_to_bare']:.1f} %", "≥ 95 %"
    ov = result.get("overhead", {})
    if ov.get("jobs"):
        yield ("worker time beyond the render (ms/job; overlapped: start → recorded, waits included)",
               f"{ov['overhead_ms_per_job']:.2f}", "")
        yield "worker time in the render", f"{100 * ov['render_s'] / max(ov['worker_s'], 1e-9):.1f} %", ""


def _host_rows(result: dict) -> Iterator[tuple[str, str, str]]:
    """CPU per job of each farm process and per core, Redis's commands and bytes, the workers' memory."""
    from bench.farm.core_figures import per_core_rows

    c = result["config"]
    cpu = result.get("cpu_ms_per_job", {})
    if cpu:
        for k, v in cpu.items():
            if k != "total":
                yield f"  CPU ms per job: {k}", f"{v:.3f}", ""
        yield ("CPU ms per job, all farm processes", f"{cpu['total']:.3f}",
               "≤ 2 ms" if c["model"] == NULL_MODEL and not c.get("render_ms_per_image") else "")
    for metric, value in per_core_rows(result):
        yield metric, value, ""
    rd = result.get("redis")
    if rd:
        top = ", ".join(f"{k} {v:g}" for k, v in list(rd["by_command_per_job"].items())[:8])
        yield f"Redis commands per job ({top}, …)", f"{rd['commands_per_job']:.2f}", ""
        yield ("Redis network bytes per job, in / out",
               f"{rd['net_in_bytes_per_job']:.0f} / {rd['net_out_bytes_per_job']:.0f}", "")
        if "bytes_per_queued_job" in rd:
            yield (f"Redis bytes per queued job (used_memory; one job hash: MEMORY USAGE "
                   f"{rd['job_hash_memory_usage_bytes']})", f"{rd['bytes_per_queued_job']:.0f}", "")
    for w in result.get("worker_memory", {}).get("workers", []):
        label = f"worker {w['name']} (batch {w['batch_size']}, prefetch ≤ {w['prefetch_limit']})"
        if w["peak_rss_mib"] is not None:
            yield f"{label}: peak RSS, VmHWM (MiB)", f"{w['peak_rss_mib']:.1f}", ""
        if w["rss_mib_at_prefetch_peak"] is not None:
            yield (f"{label}: RSS holding its largest prefetch, {w['prefetch_peak_jobs']} jobs (MiB)",
                   f"{w['rss_mib_at_prefetch_peak']:.1f}", "")


def _submission_rows(sub: dict | None) -> Iterator[tuple[str, str, str]]:
    """The submission test: seconds per POST, per appendfsync policy, and the API's RSS growth."""
    if not sub:
        return
    yield (f"submit {sub['jobs']} jobs, one POST (s, median of {len(sub['runs_s'])})",
           f"{sub['median_s']:.3f}", "≤ 0.5 s for 10,000" if sub["jobs"] == 10_000 else "")
    for policy, row in sub.get("by_appendfsync", {}).items():
        yield (f"  appendfsync {policy}: submit {sub['jobs']} jobs (s, median of {len(row['runs_s'])}; "
               f"ms per job)", f"{row['median_s']:.3f}; {row['ms_per_job']:.3f}", "")
    rss = sub.get("api_rss_mib")
    if rss:
        yield (f"API RSS during the submissions (MiB): {rss['before']} before, peak {rss['peak_after']}",
               f"{rss['peak_growth']:+.1f}", "≤ 200 MB growth")
