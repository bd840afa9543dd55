"""``renderfarm plan``: capacity planning for one worker pool under KEDA + HPA autoscaling.

Data flow: an arrival (a nightly burst, or a CSV of arrival times) + the pool's images/s per
replica (``--images-per-s`` or a ``bench farm`` JSON) + the pool's autoscaling settings (flags,
or the chart's values file) → the replay (:mod:`infra.capacity.replay`) → **here**: the replicas
over time, time to drain and GPU-hours as a table, a sweep or JSON. ``deploy/README.md`` says
how the chart's defaults were picked with it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from infra.capacity.replay import PlanResult, PoolModel, simulate
from infra.capacity.sources import (
    images_per_s_from_bench,
    parse_clock,
    pool_from_values,
    pool_model_from_values,
    read_arrivals_csv,
)


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "never"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _clock(start: float | None, t: float) -> str:
    if start is None:
        return f"+{_fmt_s(t)}"
    s = int(start + t) % 86400
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _thin(rows: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` rows: the first and last, the ones where the backlog empties or the peak
    is first reached, then evenly spaced others."""
    if len(rows) <= limit:
        return rows
    peak = max(r["replicas"] for r in rows)
    must = {0, len(rows) - 1}
    must |= {i for i in range(1, len(rows)) if rows[i]["outstanding"] == 0 < rows[i - 1]["outstanding"]}
    must.add(next(i for i, r in enumerate(rows) if r["replicas"] == peak))
    must.add(next(i for i, r in enumerate(rows) if r["ready"] == peak))
    rest = [i for i in range(len(rows)) if i not in must]
    room = max(0, limit - len(must))
    picked = {rest[int(k * len(rest) / room)] for k in range(room)} if room and rest else set()
    return [rows[i] for i in sorted(must | picked)]


def print_plan(result: PlanResult, pool: PoolModel, *, name: str, start: float | None, max_rows: int) -> None:
    """Print the replica timeline (rich table) and the summary."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = f"renderfarm plan: pool {name}, {result.jobs:,} jobs, {pool.images_per_s:g} images/s per replica"
    table = Table(title=title, title_justify="left")
    for col in ("time", "replicas", "ready", "outstanding", "images/s"):
        table.add_column(col, justify="right")
    for row in _thin(result.timeline, max_rows):
        table.add_row(_clock(start, row["t"]), str(row["replicas"]), str(row["ready"]),
                      f"{row['outstanding']:,}", f"{row['images_per_s']:g}")
    console.print(table)
    console.print(f"time to drain {_fmt_s(result.drain_s)} · "
                  f"first replica serving after {_fmt_s(result.first_ready_s)} · "
                  f"mean job latency {_fmt_s(result.mean_latency_s)} · peak {result.peak_replicas} replicas · "
                  f"back to zero after {_fmt_s(result.zero_at_s)} · "
                  f"replica-hours {result.replica_hours:.2f} · GPU-hours {result.gpu_hours:.2f}")
    console.print(f"[dim]target {pool.target:g} outstanding/replica, "
                  f"replicas {pool.min_replicas}..{pool.max_replicas}, cold start {pool.cold_start_s:g}s, "
                  f"polling {pool.polling_interval_s}s, cooldown {pool.cooldown_s}s[/dim]")


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def run_plan(args: argparse.Namespace) -> int:
    """``renderfarm plan``: replay, then print the timeline (or a sweep table), or JSON."""
    merged: dict
    name, merged = (args.pool or "pool"), {}
    if args.values:
        name, merged = pool_from_values(args.values, args.pool)
    if args.images_per_s is not None:
        rate = args.images_per_s
    elif args.bench:
        rate = images_per_s_from_bench(json.loads(Path(args.bench).read_text(encoding="utf-8")), name)
    else:
        raise SystemExit("renderfarm plan: give --images-per-s or --bench FILE")
    base = pool_model_from_values(merged, rate) if merged else PoolModel(images_per_s=rate)
    overrides = {k: v for k, v in (("min_replicas", args.min_replicas), ("activation", args.activation),
                                   ("polling_interval_s", args.polling_interval), ("cooldown_s", args.cooldown),
                                   ("cold_start_s", args.cold_start), ("gpus_per_replica", args.gpus_per_replica))
                 if v is not None}
    base = PoolModel(**{**asdict(base), "scale_up": base.scale_up, "scale_down": base.scale_down, **overrides})
    start = None
    if args.arrivals:
        arrivals = read_arrivals_csv(args.arrivals)
    else:
        start = parse_clock(args.at) if args.at else None
        arrivals = [(start or 0.0, args.jobs)]
    if start is None and args.arrivals:
        start = min(t for t, _ in arrivals) if any(t > 0 for t, _ in arrivals) else None

    targets = _floats(args.target) if args.target else [base.target]
    maxes = [int(m) for m in _floats(args.max_replicas)] if args.max_replicas else [base.max_replicas]
    runs = []
    for target in targets:
        for mx in maxes:
            model = PoolModel(**{**asdict(base), "scale_up": base.scale_up, "scale_down": base.scale_down,
                                 "target": target, "max_replicas": mx})
            runs.append((model, simulate(arrivals, model, horizon_s=args.horizon)))

    if args.json:
        out = [{"pool": name, "settings": asdict(m), "drain_s": r.drain_s, "gpu_hours": round(r.gpu_hours, 4),
                "replica_hours": round(r.replica_hours, 4), "mean_latency_s": round(r.mean_latency_s, 1),
                "peak_replicas": r.peak_replicas, "first_ready_s": r.first_ready_s, "zero_at_s": r.zero_at_s,
                "jobs": r.jobs, "timeline": r.timeline} for m, r in runs]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    if len(runs) == 1:
        print_plan(runs[0][1], runs[0][0], name=name, start=start, max_rows=args.max_rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"renderfarm plan sweep: pool {name}, {runs[0][1].jobs:,} jobs, {rate:g} images/s per replica"
                        "\n(target = outstanding jobs per replica; idle = share of replica time not rendering)",
                  title_justify="left")
    for col in ("target", "max", "peak", "drain", "mean latency", "replica-h", "GPU-h", "idle"):
        table.add_column(col, justify="right")
    for m, r in runs:
        busy_h = r.jobs / m.images_per_s / 3600
        idle = 1 - busy_h / r.replica_hours if r.replica_hours else 0.0
        table.add_row(f"{m.target:g}", str(m.max_replicas), str(r.peak_replicas), _fmt_s(r.drain_s),
                      _fmt_s(r.mean_latency_s),
                      f"{r.replica_hours:.2f}", f"{r.gpu_hours:.2f}", f"{idle:.0%}")
    Console().print(table)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm plan`` to the CLI."""
    p = subparsers.add_parser(
        "plan", help="replay an arrival against KEDA/HPA autoscaling: replicas, drain time, GPU-hours",
        description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("arrival")
    src.add_argument("--jobs", type=int, default=100_000, help="jobs arriving at once (default 100000)")
    src.add_argument("--at", default=None, help="clock time of the burst, HH:MM (e.g. 02:00)")
    src.add_argument("--arrivals", type=Path, default=None, help="CSV with columns t (s or HH:MM:SS) and optional jobs")
    rate = p.add_argument_group("throughput")
    rate.add_argument("--images-per-s", type=float, default=None, help="images/s of one replica")
    rate.add_argument("--bench", type=Path, default=None, help="a `renderfarm bench farm` JSON report")
    cfg = p.add_argument_group("autoscaling (defaults: --values, else the chart's defaults)")
    cfg.add_argument("--values", type=Path, action="append", default=[],
                     help="Helm values file(s) of deploy/helm/renderfarm (repeatable, later wins)")
    cfg.add_argument("--pool", default=None, help="pool name in the values (default: the first)")
    cfg.add_argument("--target", default=None, help="outstanding jobs per replica; a comma list sweeps")
    cfg.add_argument("--max-replicas", default=None, help="max replicas; a comma list sweeps")
    cfg.add_argument("--min-replicas", type=int, default=None)
    cfg.add_argument("--activation", type=float, default=None, help="activation threshold, jobs")
    cfg.add_argument("--polling-interval", type=int, default=None, help="KEDA polling interval, s")
    cfg.add_argument("--cooldown", type=int, default=None, help="KEDA cooldown before scaling to zero, s")
    cfg.add_argument("--cold-start", type=float, default=None, help="replica creation → first batch, s")
    cfg.add_argument("--gpus-per-replica", type=float, default=None, help="GPUs billed per replica")
    p.add_argument("--horizon", type=float, default=None, help="stop the replay after this many seconds")
    p.add_argument("--max-rows", type=int, default=30, help="timeline rows to print (thinned evenly)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_plan)
