"""Summaries of a pipeline bench's rows from their kept rounds: medians, best, spread, ratios and
the share of the machine's GEMM rate each row reached.

Place in the data flow: :mod:`bench.pipeline.side_by_side` calls :func:`summarize` after every round (so a
checkpointed JSON is always summarized) and at the end; ``renderfarm bench show`` calls it on a
committed JSON, optionally without each row's first rounds, so that every headline figure in the
docs is reproduced from its file by one command. Pure functions of the rows: nothing here renders.

Method (the one a reviewer of GPU figures asks for): every row has one untimed cold call and one
untimed settle call (CUDA graphs recorded, caches filled) before its timed rounds; medians carry
the ratio columns (``speedup`` against the reference, ``vs_peer`` against the peer, same batch
size) and the ``*_best`` twins divide best rounds; ``hot_spread_pct`` is (worst − best) / median
in per cent. Files written before the settle call existed had their first timed round double as
the warm-up: ``skip_rounds=1`` drops it.

The roofline columns: ``achieved_gflop_per_s`` is the render's counted FLOPs (``FlopCounterMode``:
GEMMs, convolutions, attention) over the hot median; ``pct_of_fp32_matmul`` and
``pct_of_bf16_matmul`` divide it by the machine's dense ``torch.mm`` rate in that dtype, measured
in the same process once per round (median of the rounds), so what a recipe can still gain on
this machine is a number, not an argument.
"""

from __future__ import annotations

import statistics
from typing import Any

#: Rows below this many timed rounds are marked indicative in the tables (the bench's default).
MIN_ROUNDS = 5


def _sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant figures (a tiny model's floor is well under 1 ms)."""
    return float(f"{x:.{digits}g}")


def round_stats(values: list[float]) -> dict[str, float]:
    """Mean, median, best, worst (seconds per image, 4 decimals) and spread (% of the median) of
    the timed rounds ``values`` (seconds per image).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("no timed rounds to summarize")
    median = statistics.median(values)
    return {"mean": round(statistics.fmean(values), 4), "median": round(median, 4), "best": round(min(values), 4),
            "worst": round(max(values), 4),
            "spread_pct": round(100 * (max(values) - min(values)) / median, 1) if median else 0.0}


def _timing(row: dict, rounds: list[float]) -> None:
    s = round_stats(rounds)
    row.update(hot_mean_s_per_img=s["mean"], hot_median_s_per_img=s["median"], hot_best_s_per_img=s["best"],
               hot_worst_s_per_img=s["worst"], hot_spread_pct=s["spread_pct"], timed_rounds=len(rounds),
               images_per_s=round(1 / s["median"], 4) if s["median"] else None)
    calls = row.get("denoiser_calls")
    row["it_per_s"] = round(calls / (s["median"] * row["batch_size"]), 3) if calls and s["median"] else None


def _roofline(row: dict, rates: dict[str, float]) -> None:
    flops, median = row.get("flops_per_image"), row.get("hot_median_s_per_img")
    for key in ("achieved_gflop_per_s", "pct_of_fp32_matmul", "pct_of_bf16_matmul", "floor_s_per_img",
                "pct_of_floor"):
        row[key] = None
    if not flops or not median:
        return
    achieved = flops / median
    row["achieved_gflop_per_s"] = _sig(achieved / 1e9, 4)
    for key, dtype in (("pct_of_fp32_matmul", "float32"), ("pct_of_bf16_matmul", "bfloat16")):
        if rates.get(dtype):
            row[key] = _sig(100 * achieved / rates[dtype])
    rate = rates.get("float32" if row.get("dtype") == "float32" else "bfloat16")
    if rate:
        row["floor_s_per_img"] = _sig(flops / rate, 4)
        row["pct_of_floor"] = _sig(100 * (flops / rate) / median)


def _ratios(rows: list[dict]) -> None:
    first: dict[tuple[str, int], dict] = {}
    for row in rows:  # the first reference / peer row of a batch size is the one compared with
        if row.get("hot_median_s_per_img"):
            first.setdefault((row["kind"], row["batch_size"]), row)
    for row in rows:
        for attr, kind in (("speedup", "reference"), ("vs_peer", "peer")):
            other = first.get((kind, row["batch_size"]))
            row[attr] = row[f"{attr}_best"] = None
            if other is not None and row.get("hot_median_s_per_img"):
                row[attr] = round(other["hot_median_s_per_img"] / row["hot_median_s_per_img"], 3)
                row[f"{attr}_best"] = round(other["hot_best_s_per_img"] / row["hot_best_s_per_img"], 3)


def summarize(rows: list[dict], gemm_rates: dict[str, float] | None = None, skip_rounds: int = 0) -> list[dict]:
    """Fill every row's summary columns from its kept rounds (``hot_s_per_img``, seconds per image),
    less the first ``skip_rounds`` of each; returns new row dicts, the input untouched.

    ``gemm_rates``: FLOP/s by dtype name (``float32``, ``bfloat16``) for the roofline columns.
    A row without timed rounds left (a failed row, a cut-off run) keeps None in those columns.

    Raises:
        ValueError: ``skip_rounds`` is negative.
    """
    if skip_rounds < 0:
        raise ValueError(f"skip_rounds must be >= 0, got {skip_rounds}")
    out = []
    for original in rows:
        row: dict[str, Any] = dict(original)
        rounds = list(row.get("hot_s_per_img") or [])[skip_rounds:]
        if rounds:
            _timing(row, rounds)
            cpu = list(row.get("hot_cpu_s_per_img") or [])[skip_rounds:]
            row["cpu_s_per_img"] = round(statistics.median(cpu), 4) if cpu else None
        else:
            row.update({k: None for k in ("hot_mean_s_per_img", "hot_median_s_per_img", "hot_best_s_per_img",
                                          "hot_worst_s_per_img", "hot_spread_pct", "images_per_s", "it_per_s")})
            row["timed_rounds"] = 0
        _roofline(row, gemm_rates or {})
        out.append(row)
    _ratios(out)
    return out


def gemm_medians(result: dict) -> dict[str, float]:
    """The machine's GEMM rates (FLOP/s by dtype) a bench result recorded: the medians of its rounds."""
    machine = result.get("machine") or {}
    rounds = machine.get("gemm_flops_per_s_rounds") or {}
    medians = {k: float(statistics.median(v)) for k, v in rounds.items() if v}
    return medians or {k: float(v) for k, v in (machine.get("gemm_flops_per_s") or {}).items()}
