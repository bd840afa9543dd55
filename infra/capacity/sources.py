"""What the capacity replay starts from: arrivals (a CSV), a replica's throughput (a ``bench
farm`` report) and a pool's autoscaling settings (the chart's Helm values).

Data flow: files the operator has → **here** → the arrivals and :class:`~infra.capacity.replay.PoolModel`
that :func:`infra.capacity.replay.simulate` replays (``renderfarm plan``, :mod:`infra.capacity.cli`).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from infra.capacity.replay import K8S_SCALE_DOWN, K8S_SCALE_UP, Behavior, Policy, PoolModel


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
