"""The bench's method: summaries from the kept rounds (medians, best, spread, ratios, roofline),
`bench show` reproducing the GPU page's figures from their files, what a row ran with read back
from the objects, the JSON checkpointed after every round, and a failing row kept as failed."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from bench.pipeline.ran_with import compiled_regions, inductor_settings, mode_of
from bench.pipeline.summary import round_stats, summarize

ROOT = Path(__file__).resolve().parents[2]
GPU_PAGE = ROOT / "docs/performance/gpu.md"


def _row(recipe: str, kind: str, rounds: list[float], batch: int = 1, **extra) -> dict:
    return {"recipe": recipe, "kind": kind, "batch_size": batch, "hot_s_per_img": rounds, **extra}


def test_round_stats_give_median_best_worst_and_spread():
    assert round_stats([0.3, 0.1, 0.2, 0.5, 0.2]) == {"mean": 0.26, "median": 0.2, "best": 0.1, "worst": 0.5,
                                                      "spread_pct": 200.0}
    with pytest.raises(ValueError):
        round_stats([])


def test_ratios_divide_medians_and_best_rounds_of_the_same_batch_size():
    rows = summarize([_row("reference", "reference", [1.0, 0.8, 0.9]), _row("peer", "peer", [0.5, 0.3, 0.4]),
                      _row("exact", "farm", [0.2, 0.2, 0.1]), _row("exact", "farm", [0.05], batch=4),
                      _row("reference", "reference", [0.1], batch=4)])
    ref, peer, exact, exact4, _ = rows
    assert (ref["speedup"], ref["speedup_best"]) == (1.0, 1.0)
    assert (peer["speedup"], peer["speedup_best"]) == (2.25, round(0.8 / 0.3, 3))
    assert (exact["vs_peer"], exact["vs_peer_best"]) == (2.0, 3.0)  # 0.4 / 0.2 by medians, 0.3 / 0.1 by bests
    assert exact4["speedup"] == 2.0 and exact4["vs_peer"] is None  # no peer at batch 4
    assert exact["hot_spread_pct"] == 50.0 and exact["timed_rounds"] == 3


def test_skip_rounds_drops_each_rows_first_rounds_and_a_row_without_rounds_has_no_figures():
    rows = summarize([_row("reference", "reference", [2.0, 1.0, 1.0]), _row("exact", "farm", [9.0, 0.5]),
                      _row("fast", "farm", [], status="failed")], skip_rounds=1)
    assert [r["hot_median_s_per_img"] for r in rows] == [1.0, 0.5, None]
    assert rows[1]["speedup"] == 2.0 and rows[2]["speedup"] is None and rows[2]["timed_rounds"] == 0
    with pytest.raises(ValueError):
        summarize([], skip_rounds=-1)


def test_roofline_columns_divide_the_achieved_rate_by_each_measured_gemm_rate():
    row = summarize([_row("exact", "farm", [2.0], flops_per_image=4e12, dtype="bfloat16")],
                    {"float32": 1e12, "bfloat16": 4e12})[0]
    assert row["achieved_gflop_per_s"] == 2000.0  # 4 TFLOP in 2 s
    assert (row["pct_of_fp32_matmul"], row["pct_of_bf16_matmul"]) == (200.0, 50.0)
    assert (row["floor_s_per_img"], row["pct_of_floor"]) == (1.0, 50.0)  # a bf16 row's floor is the bf16 rate


def _show(capsys, folder: Path, path: Path, *args: str) -> dict:
    """``renderfarm bench show PATH ARGS --json …``: the result it printed, as written."""
    from bench.cli import main

    target = folder / f"{path.stem}{''.join(args)}.json"
    with pytest.raises(SystemExit) as stop:
        main(["show", str(path), *args, "--json", str(target)])
    assert stop.value.code == 0
    capsys.readouterr()
    return json.loads(target.read_text())


def test_bench_show_reproduces_the_gpu_pages_h200_figures_from_their_files(capsys, tmp_path):
    page = GPU_PAGE.read_text()
    commands = re.findall(r"renderfarm bench show (docs/benchmarks/\S+\.json)( --skip-rounds \d)?", page)
    assert len(commands) >= 4  # every headline file has its command on the page
    for file, _ in commands:
        assert (ROOT / file).exists(), file
    b1 = {r["kind"]: r for r in _show(capsys, tmp_path, ROOT / "docs/benchmarks/gpu-h200-2026-11-27-sd15-arch-b1.json",
                                      "--skip-rounds", "1")["rows"]}
    farm = b1["farm"]
    assert farm["timed_rounds"] == 2 and farm["hot_s_per_img"] == [0.2025, 0.166, 0.1591]  # every round kept
    figures = {"vs peer median": farm["vs_peer"], "vs peer best": farm["vs_peer_best"],
               "vs reference median": farm["speedup"], "vs reference best": farm["speedup_best"]}
    assert figures == {"vs peer median": 2.417, "vs peer best": 2.018, "vs reference median": 4.009,
                       "vs reference best": 3.975}
    assert "**4.01× / 3.98×** | **2.42× / 2.02×**" in page  # the page's table rounds these
    b8 = {r["kind"]: r for r in _show(capsys, tmp_path, ROOT / "docs/benchmarks/gpu-h200-2026-11-27-sd15-arch-b8.json",
                                      "--skip-rounds", "1")["rows"]}
    assert b8["farm"]["speedup"] == 1.648 and "**1.65×** on one round" in page
    b1_file = ROOT / "docs/benchmarks/gpu-h200-2026-11-27-sd15-arch-b1.json"
    kept = {r["kind"]: r for r in _show(capsys, tmp_path, b1_file)["rows"]}
    assert kept["farm"]["vs_peer"] == 2.801  # the old headline used the warm-up round; the page says so
    assert "read 2.80×" in page


def test_bench_show_refuses_what_it_cannot_read(tmp_path, capsys):
    from bench.cli import main

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "profile"}))
    for path in (other, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as stop:
            main(["show", str(path)])
        assert stop.value.code == 2
    assert "not a bench pipeline, ready or farm result" in capsys.readouterr().out


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.proj_out = torch.nn.Linear(4, 4)


def test_compiled_regions_name_each_compile_with_the_options_its_backend_carries():
    from pipeline.optimize.compile import ATEN_GEMMS, compile_kwargs

    transformer, vae = _Blocks(), torch.nn.Sequential(torch.nn.Linear(4, 4))
    for block in transformer.transformer_blocks:  # as compile_repeated_blocks does (lazy: nothing compiles here)
        block.compile(**compile_kwargs("reduce-overhead", False, ATEN_GEMMS))
    vae.forward = torch.compile(vae.forward, mode="default")
    pipe = types.SimpleNamespace(components={"transformer": transformer, "vae": vae, "tokenizer": object()})
    regions = {r["where"]: r for r in compiled_regions(pipe)}
    blocks = regions["transformer.transformer_blocks.*"]
    assert blocks["count"] == 3 and blocks["how"] == "module.compile()"
    assert blocks["backend"]["options"] == {"triton.cudagraphs": True, "max_autotune_gemm_backends": "ATEN"}
    assert blocks["backend"]["mode"] == "reduce-overhead+max_autotune_gemm_backends=ATEN"
    assert blocks["backend"]["dynamic"] is False
    assert regions["vae.forward"]["backend"]["mode"] == "default"
    assert "transformer.proj_out" not in regions  # not compiled: not listed
    assert mode_of({"max_autotune": True, "coordinate_descent_tuning": True}) == "max-autotune-no-cudagraphs"


def test_inductor_settings_are_read_inside_the_rows_context_not_from_the_tutorials_constant():
    from bench.pipeline.public_recipes import TUNING_FLAGS, inductor_flags, tutorial_flags

    outside = inductor_settings()
    with inductor_flags(tuning=False):
        without_tuning = inductor_settings()
    with inductor_flags(tuning=True):
        with_tuning = inductor_settings()
    assert without_tuning["conv_1x1_as_mm"] is True and without_tuning["epilogue_fusion"] is False
    assert not any(without_tuning[k] for k in TUNING_FLAGS) and all(with_tuning[k] for k in TUNING_FLAGS)
    assert inductor_settings() == outside  # scoped: the farm's rows keep Inductor's defaults
    assert set(tutorial_flags(False)) == set(tutorial_flags(True)) - set(TUNING_FLAGS)


@pytest.mark.long
def test_the_json_is_checkpointed_every_round_and_a_failing_row_is_kept_as_failed(bench_cache, tmp_path):
    from bench.pipeline import PipelineBenchConfig, run_pipeline_bench, write_json

    # the CPU has no cuDNN attention: pinning it makes that row's first render fail, for real
    specs = ("reference", "reference:sdpa=cudnn", "reference:dtype=bfloat16")
    config = PipelineBenchConfig(model="tiny", width=64, height=64, steps=1, batch_sizes=(1,), recipes=specs,
                                 repeats=2, device="cpu", cache_dir=str(bench_cache), count_flops=False,
                                 sequential=True)
    snapshots: list[dict] = []
    path = tmp_path / "bench.json"

    def checkpoint(result: dict) -> None:
        write_json(result, path)
        snapshots.append(json.loads(path.read_text()))
        last_row = result["rows"][2]
        if last_row["cold_s"] is not None:  # stopped from outside while the last row runs
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pipeline_bench(config, log=lambda _msg: None, checkpoint=checkpoint)
    last = {r["recipe"]: r for r in json.loads(path.read_text())["rows"]}
    assert json.loads(path.read_text())["complete"] is False
    assert last["reference"]["status"] == "ok" and last["reference"]["timed_rounds"] == 2
    assert last["reference"]["settle_s"] is not None and len(last["reference"]["hot_s_per_img"]) == 2
    assert last["reference:sdpa=cudnn"]["status"] == "failed"
    assert last["reference:sdpa=cudnn"]["error"].startswith("cold call, batch 1: RuntimeError")
    bf16 = last["reference:dtype=bfloat16"]
    assert bf16["status"] == "ok" and bf16["timed_rounds"] == 0  # its rounds never ran
    assert snapshots[0]["rows"][0]["status"] == "ok" and snapshots[0]["rows"][2]["status"] == "pending"
    rounds = [len(s["rows"][0]["hot_s_per_img"]) for s in snapshots]
    assert rounds == sorted(rounds) and 1 in rounds  # written after each round, not only at the end
