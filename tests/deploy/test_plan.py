"""The capacity planner (infra.capacity): the KEDA + HPA replay against hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest

from infra.capacity.replay import Behavior, Policy, PoolModel, simulate
from infra.capacity.sources import (
    images_per_s_from_bench,
    parse_clock,
    pool_from_values,
    pool_model_from_values,
    read_arrivals_csv,
)
from tests.deploy.conftest import CHART, THREE_POOLS

FAST_UP = Behavior(0, (Policy("Percent", 1000, 15),))


def test_fixed_pool_drains_at_the_expected_time():
    """min = max = 2 warm replicas at 5 images/s each: 1,000 jobs take 100 s."""
    pool = PoolModel(images_per_s=5, min_replicas=2, max_replicas=2, cold_start_s=0)
    result = simulate([(0, 1000)], pool)
    assert result.drain_s == pytest.approx(100, abs=1)
    assert result.peak_replicas == 2
    assert result.mean_latency_s == pytest.approx(50, abs=1.5)     # FIFO fluid: half the drain time


def test_scale_from_zero_pays_the_cold_start_once():
    pool = PoolModel(images_per_s=10, max_replicas=1, cold_start_s=60, cooldown_s=120)
    result = simulate([(0, 600)], pool)
    assert result.first_ready_s == 60
    assert result.drain_s == pytest.approx(60 + 60, abs=1)


def test_never_exceeds_max_replicas_and_respects_policies():
    pool = PoolModel(images_per_s=1, max_replicas=7, target=10, cold_start_s=30)
    result = simulate([(0, 100_000)], pool, horizon_s=3600)
    assert result.peak_replicas == 7
    assert max(r["replicas"] for r in result.timeline) == 7
    # default scale-up: +4 pods or +100 % per 60 s, so 0 → 1 (activation) → 5 → 7
    steps = [r["replicas"] for r in result.timeline if r["t"] <= 120]
    assert steps[0] <= 5 and sorted(steps) == steps


def test_desired_replicas_follow_the_hpa_formula():
    """AverageValue: desired = ceil(outstanding / target) when nothing limits the rate."""
    pool = PoolModel(images_per_s=0.001, max_replicas=100, target=64, cold_start_s=10_000, scale_up=FAST_UP)
    result = simulate([(0, 1000)], pool, horizon_s=120)
    assert result.peak_replicas == math.ceil(1000 / 64)


def test_scales_to_zero_after_the_cooldown():
    pool = PoolModel(images_per_s=10, max_replicas=4, cold_start_s=10, cooldown_s=300, polling_interval_s=15)
    result = simulate([(0, 100)], pool)
    assert result.timeline[-1]["replicas"] == 0
    assert result.zero_at_s is not None
    assert result.drain_s + 300 <= result.zero_at_s <= result.drain_s + 300 + 15 + 1


def test_no_scale_to_zero_with_min_replicas():
    pool = PoolModel(images_per_s=10, min_replicas=1, max_replicas=4, cold_start_s=10, cooldown_s=60)
    result = simulate([(0, 100)], pool)
    assert result.zero_at_s is None and min(r["replicas"] for r in result.timeline) == 1


def test_activation_threshold_keeps_a_small_backlog_waiting():
    pool = PoolModel(images_per_s=10, max_replicas=4, activation=50)
    result = simulate([(0, 20)], pool, horizon_s=600)
    assert result.peak_replicas == 0 and result.drain_s is None


def test_gpu_hours_count_cold_start_busy_and_idle_time():
    pool = PoolModel(images_per_s=1, min_replicas=0, max_replicas=1, cold_start_s=100, cooldown_s=200,
                     gpus_per_replica=2)
    result = simulate([(0, 3600)], pool)
    # one replica alive from t=0 until cooldown after the drain (100 s cold + 3600 s work + 200 s)
    assert result.replica_hours == pytest.approx((100 + 3600 + 200) / 3600, abs=0.02)
    assert result.gpu_hours == pytest.approx(2 * result.replica_hours)


def test_scale_down_is_stabilized():
    pool = PoolModel(images_per_s=50, max_replicas=8, target=10, cold_start_s=5, cooldown_s=10_000,
                     scale_down=Behavior(300, (Policy("Percent", 50, 60),)))
    result = simulate([(0, 5000)], pool, horizon_s=2000)
    peak_t = max(r["t"] for r in result.timeline if r["replicas"] == result.peak_replicas)
    first_down = next(r["t"] for r in result.timeline if r["t"] > peak_t and r["replicas"] < result.peak_replicas)
    assert first_down - result.drain_s >= 240   # the 300 s window holds the peak after the queue empties


def test_arrivals_csv_and_clock(tmp_path):
    path = tmp_path / "arrivals.csv"
    path.write_text("t,jobs\n02:00,100\n02:00:30,50\n7300,\n")
    assert read_arrivals_csv(path) == [(7200, 100), (7230, 50), (7300, 1)]
    assert parse_clock("02:00") == 7200


def test_images_per_s_from_a_bench_report():
    report = {"pools": [{"pool": "a", "images_per_s": 12.0, "workers": 4},
                        {"pool": "b", "images_per_s_per_worker": 0.5}]}
    assert images_per_s_from_bench(report, "a") == 3.0
    assert images_per_s_from_bench(report, "b") == 0.5
    assert images_per_s_from_bench({"images_per_s": 7}) == 7


def test_values_files_drive_the_model():
    name, merged = pool_from_values([CHART / "values.yaml", THREE_POOLS], "sdxl-h100")
    model = pool_model_from_values(merged, images_per_s=0.5)
    assert name == "sdxl-h100" and model.gpus_per_replica == 1 and model.max_replicas == 16
    assert model.cold_start_s == 180 and model.target == 64
    assert model.scale_down.window_s == 300
    _, cpu = pool_from_values([CHART / "values.yaml", THREE_POOLS], "tiny-cpu")
    assert pool_model_from_values(cpu, images_per_s=2).gpus_per_replica == 0


def test_cli_json(capsys):
    import argparse

    from infra.capacity.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--jobs", "1000", "--at", "02:00", "--images-per-s", "5",
                              "--values", str(CHART / "values.yaml"), "--cold-start", "0", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pool"] == "cpu-tiny" and out["jobs"] == 1000 and out["drain_s"] > 0


def test_cli_sweep_table(capsys):
    import argparse

    from infra.capacity.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--jobs", "2000", "--images-per-s", "2", "--target", "16,64",
                              "--max-replicas", "2,4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "drain" in out and "GPU-h" in out and out.count("\n") > 6


def test_thinned_timeline_keeps_the_milestones():
    from infra.capacity.cli import _thin

    pool = PoolModel(images_per_s=0.5, max_replicas=16, cold_start_s=180)
    rows = simulate([(0, 20_000)], pool).timeline
    thin = _thin(rows, 8)
    assert len(thin) <= 8 and thin[0] == rows[0] and thin[-1] == rows[-1]
    assert any(r["ready"] == 16 for r in thin)                       # the peak, once warm
    assert any(r["outstanding"] == 0 for r in thin[:-1])             # the moment the backlog empties
