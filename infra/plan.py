"""``renderfarm plan``: capacity planning for one worker pool under KEDA + HPA autoscaling.

Data flow: an arrival (a nightly burst, or a CSV of arrival times) + the pool's images/s per
replica (``--images-per-s`` or a ``bench farm`` JSON) + the pool's autoscaling settings (flags,
or the chart's values file) → **a second-by-second replay** → replicas over time, time to
drain and GPU-hours. ``deploy/README.md`` says how the chart's defaults were picked with it.

The model follows what the chart deploys (``deploy/helm/renderfarm/templates/scaledobjects.yaml``):

- The signal is the pool's outstanding jobs (queued + reserved + running, :mod:`infra.broker.depths`).
- **KEDA** polls every ``polling_interval_s``. At zero replicas it activates the pool once
  outstanding > ``activation`` (0 → 1 replica); it scales back to zero after ``cooldown_s`` with
  outstanding ≤ ``activation``. Between 1 and max, the HPA decides.
- **HPA** (every ``hpa_sync_s``, 15 s in Kubernetes), metricType ``AverageValue``:
  ``desired = ceil(current × (outstanding / current) / target) = ceil(outstanding / target)``,
  skipped within a 10 % tolerance, clamped to [max(min, 1), max]; then the behavior:
  stabilization windows (scale up to the lowest, down to the highest recommendation of the
  window) and rate policies (``Pods``/``Percent`` per ``periodSeconds``, ``selectPolicy``).
- A new replica serves after ``cold_start_s`` (node, image pull, model load, warm-up) at
  ``images_per_s``; work is fluid (no batch granularity). A replica costs ``gpus_per_replica``
  GPUs from creation to removal, cold start included.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class Policy:
    """One HPA scaling policy: change by ``value`` pods (``Pods``) or percent (``Percent``) per ``period_s``."""

    type: str
    value: int
    period_s: int


@dataclass(frozen=True)
class Behavior:
    """HPA ``behavior`` for one direction: stabilization window (s), policies and ``select`` (Max/Min/Disabled)."""

    window_s: int
    policies: tuple[Policy, ...]
    select: str = "Max"


# Kubernetes' own defaults when a ScaledObject says nothing.
K8S_SCALE_UP = Behavior(0, (Policy("Pods", 4, 15), Policy("Percent", 100, 15)))
K8S_SCALE_DOWN = Behavior(300, (Policy("Percent", 100, 15),))


@dataclass(frozen=True)
class PoolModel:
    """One pool's throughput and autoscaling settings. Times in seconds."""

    images_per_s: float                 # per ready replica
    target: float = 64                  # outstanding jobs per replica (AverageValue)
    min_replicas: int = 0
    max_replicas: int = 4
    activation: float = 0               # activate from zero when outstanding > this
    polling_interval_s: int = 15
    cooldown_s: int = 600
    cold_start_s: float = 90
    gpus_per_replica: float = 1.0
    hpa_sync_s: int = 15
    scale_up: Behavior = field(default_factory=lambda: Behavior(0, (Policy("Pods", 4, 60), Policy("Percent", 100, 60))))
    scale_down: Behavior = field(default_factory=lambda: Behavior(300, (Policy("Percent", 50, 60),)))


@dataclass
class PlanResult:
    """What one replay found. ``timeline`` rows: ``t`` (s from the first arrival), ``replicas``
    (desired), ``ready``, ``outstanding`` (jobs) and ``images_per_s`` (served)."""

    timeline: list[dict[str, float]]
    drain_s: float | None               # first arrival → nothing outstanding after the last one
    gpu_hours: float                    # replica-hours × GPUs per replica
    replica_hours: float                # replicas alive (starting, busy or idle), hours
    mean_latency_s: float               # arrival → done, averaged over jobs (Little's law)
    peak_replicas: int
    first_ready_s: float | None         # first arrival → first replica serving
    zero_at_s: float | None             # first arrival → back at zero replicas (None: never)
    jobs: int
    end_s: float


def _policy_limit(behavior: Behavior, history: deque, now: float, current: int, up: bool) -> int:
    """Most (``up``) or fewest replicas the policies allow now, from the replica count at each
    policy's period start (current minus the changes made within the period)."""
    if behavior.select == "Disabled":
        return current
    limits = []
    for pol in behavior.policies:
        changed = sum(d for t, d in history if t > now - pol.period_s)
        start = current - changed
        if up:
            limits.append(start + pol.value if pol.type == "Pods" else math.ceil(start * (1 + pol.value / 100)))
        else:
            limits.append(start - pol.value if pol.type == "Pods" else math.floor(start * (1 - pol.value / 100)))
    if not limits:
        return current
    pick = max if (behavior.select == "Max") == up else min
    return pick(limits)


def simulate(arrivals: list[tuple[float, int]], pool: PoolModel, *, horizon_s: float | None = None) -> PlanResult:
    """Replay ``arrivals`` (``(seconds from the start, jobs)``) against ``pool``, one-second steps.

    Runs until every job is done and the pool is back at its minimum, or ``horizon_s`` seconds
    (default: 48 h past the last arrival).
    """
    arrivals = sorted((float(t), int(n)) for t, n in arrivals if n > 0)
    if not arrivals:
        raise ValueError("no arrivals")
    t0 = arrivals[0][0]
    pending = deque((t - t0, n) for t, n in arrivals)
    jobs = sum(n for _, n in arrivals)
    last_arrival = pending[-1][0]
    horizon = horizon_s if horizon_s is not None else last_arrival + 48 * 3600
    hpa_min, hpa_max = max(pool.min_replicas, 1), pool.max_replicas

    outstanding = 0.0
    replicas = pool.min_replicas
    pods: list[float] = [-pool.cold_start_s] * replicas     # ready-at times; min replicas start warm
    last_active = 0.0
    recs: deque[tuple[float, int]] = deque()                 # (t, HPA recommendation)
    changes: deque[tuple[float, int]] = deque()              # (t, replica delta) by the HPA
    gpu_s = replica_s = job_s = 0.0
    drain_s = first_ready = zero_at = None
    peak = replicas
    timeline: list[dict[str, float]] = []

    def record(t: float, served: float) -> None:
        ready = sum(1 for r in pods if r <= t)
        row = {"t": t, "replicas": replicas, "ready": ready, "outstanding": math.ceil(outstanding),
               "images_per_s": round(served, 3)}
        if not timeline or (row["replicas"], row["ready"]) != (timeline[-1]["replicas"], timeline[-1]["ready"]) \
                or (outstanding == 0) != (timeline[-1]["outstanding"] == 0):
            timeline.append(row)

    def set_replicas(n: int, t: float) -> None:
        nonlocal replicas, peak
        if n > replicas:
            pods.extend([t + pool.cold_start_s] * (n - replicas))
        elif n < replicas:
            pods.sort()                  # the ReplicaSet removes not-ready, then newest pods first
            del pods[n:]
        replicas = n
        peak = max(peak, n)

    t = 0.0
    while t <= horizon:
        while pending and pending[0][0] <= t:
            outstanding += pending.popleft()[1]
        metric = math.ceil(outstanding)
        if metric > pool.activation:
            last_active = t
        # KEDA: activation from zero, and deactivation after the cooldown.
        if int(t) % pool.polling_interval_s == 0:
            if replicas == 0 and metric > pool.activation:
                set_replicas(hpa_min, t)
                changes.append((t, replicas))
            elif pool.min_replicas == 0 and replicas > 0 and metric <= pool.activation \
                    and t - last_active >= pool.cooldown_s:
                set_replicas(0, t)
                recs.clear()
                changes.clear()
        # HPA: only while KEDA has the pool active (≥ 1 replica).
        if replicas > 0 and int(t) % pool.hpa_sync_s == 0:
            ratio = metric / (pool.target * replicas)
            rec = replicas if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(metric / pool.target)
            rec = min(max(rec, hpa_min), hpa_max)
            recs.append((t, rec))
            keep = max(pool.scale_up.window_s, pool.scale_down.window_s)
            while recs and recs[0][0] < t - keep:
                recs.popleft()
            up_rec = min(r for s, r in recs if s >= t - pool.scale_up.window_s)
            down_rec = max(r for s, r in recs if s >= t - pool.scale_down.window_s)
            new = replicas
            if up_rec > replicas:
                new = min(up_rec, _policy_limit(pool.scale_up, changes, t, replicas, up=True))
            elif down_rec < replicas:
                new = max(down_rec, _policy_limit(pool.scale_down, changes, t, replicas, up=False))
            new = min(max(new, hpa_min), hpa_max)
            if new != replicas:
                changes.append((t, new - replicas))
                set_replicas(new, t)
            while changes and changes[0][0] < t - 3600:
                changes.popleft()
        ready = sum(1 for r in pods if r <= t)
        if ready and first_ready is None:
            first_ready = t
        served = min(outstanding, ready * pool.images_per_s)
        outstanding -= served
        if outstanding < 1e-9:
            outstanding = 0.0
        gpu_s += replicas * pool.gpus_per_replica
        replica_s += replicas
        job_s += outstanding + served / 2    # jobs in the system during this second
        record(t, served)
        if outstanding == 0 and not pending and drain_s is None:
            drain_s = t + 1
        if drain_s is not None and replicas == 0 and zero_at is None:
            zero_at = t
        if drain_s is not None and replicas <= pool.min_replicas:
            break
        t += 1
    return PlanResult(timeline=timeline, drain_s=drain_s, gpu_hours=gpu_s / 3600, replica_hours=replica_s / 3600,
                      mean_latency_s=job_s / jobs,
                      peak_replicas=peak,
                      first_ready_s=first_ready, zero_at_s=zero_at, jobs=jobs, end_s=t)


# ------------------------------------------------------------------------- inputs


def parse_clock(text: str) -> float:
    """``HH:MM[:SS]`` → seconds after midnight."""
    parts = [float(p) for p in text.split(":")]
    if not 2 <= len(parts) <= 3:
        raise ValueError(f"not a HH:MM[:SS] time: {text!r}")
    return parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) == 3 else 0)


def read_arrivals_csv(path: Path) -> list[tuple[float, int]]:
    """Arrivals from a CSV: a column ``t`` (seconds, or ``HH:MM[:SS]``) or ``time``, and an
    optional ``jobs`` column (default 1 per row). Returns ``(seconds, jobs)`` pairs."""
    out = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            raw = (row.get("t") or row.get("time") or row.get("at") or "").strip()
            if not raw:
                continue
            at = parse_clock(raw) if ":" in raw else float(raw)
            out.append((at, int(row.get("jobs") or 1)))
    return out


def images_per_s_from_bench(data: Any, pool: str | None = None) -> float:
    """Images/s of one replica from a ``renderfarm bench farm`` JSON report.

    Looks for objects with ``images_per_s_per_worker``, or ``images_per_s`` (divided by
    ``workers`` when given); with ``pool``, an object whose ``pool`` (or ``model``) matches wins.
    """
    found: list[tuple[bool, float]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            rate = None
            if isinstance(node.get("images_per_s_per_worker"), (int, float)):
                rate = float(node["images_per_s_per_worker"])
            elif isinstance(node.get("images_per_s"), (int, float)):
                rate = float(node["images_per_s"]) / max(1, int(node.get("workers") or 1))
            if rate is not None:
                found.append((pool is not None and pool in (node.get("pool"), node.get("model")), rate))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(data)
    if not found:
        raise ValueError("no images_per_s in the bench JSON")
    matching = [r for hit, r in found if hit]
    return (matching or [r for _, r in found])[0]


def _behavior(raw: dict | None, default: Behavior) -> Behavior:
    if not raw:
        return default
    pols = tuple(Policy(p["type"], int(p["value"]), int(p["periodSeconds"])) for p in raw.get("policies", ()))
    return Behavior(int(raw.get("stabilizationWindowSeconds", default.window_s)), pols or default.policies,
                    raw.get("selectPolicy", "Max"))


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def pool_from_values(values_files: list[Path], pool: str | None) -> tuple[str, dict]:
    """A pool's settings from Helm values files (later files win, as with ``helm -f``), with
    ``workerDefaults`` filled in, like the chart does. ``pool=None`` takes the first pool."""
    import yaml

    values: dict = {}
    for path in values_files:
        values = _deep_merge(values, yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {})
    pools = values.get("pools") or []
    chosen = next((p for p in pools if pool is None or p.get("name") == pool), None)
    if chosen is None:
        raise ValueError(f"pool {pool!r} not in the values ({', '.join(p.get('name', '?') for p in pools)})")
    return chosen["name"], _deep_merge(values.get("workerDefaults") or {}, chosen)


def pool_model_from_values(merged: dict, images_per_s: float) -> PoolModel:
    """A :class:`PoolModel` from a merged chart pool (see :func:`pool_from_values`)."""
    a = merged.get("autoscaling") or {}
    beh = a.get("behavior") or {}
    gpus = float(merged.get("gpus", 1)) if merged.get("deviceClass") == "cuda" else 0.0
    return PoolModel(images_per_s=images_per_s, target=float(a.get("targetOutstandingPerReplica", 64)),
                     min_replicas=int(a.get("minReplicas", 0)), max_replicas=int(a.get("maxReplicas", 4)),
                     activation=float(a.get("activationOutstanding", 0)),
                     polling_interval_s=int(a.get("pollingInterval", 30)), cooldown_s=int(a.get("cooldownPeriod", 300)),
                     cold_start_s=float(merged.get("coldStartSeconds", 90)), gpus_per_replica=gpus,
                     scale_up=_behavior(beh.get("scaleUp"), K8S_SCALE_UP),
                     scale_down=_behavior(beh.get("scaleDown"), K8S_SCALE_DOWN))


# ------------------------------------------------------------------------- output


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
