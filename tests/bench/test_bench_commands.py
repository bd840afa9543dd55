"""``renderfarm bench pipeline`` and ``renderfarm bench farm`` run end to end on ``tiny`` (tiny
sizes, one round) and write their JSON with the expected columns. Timings are not asserted."""

from __future__ import annotations

import json
import math

import pytest

from infra.cli import main

pytestmark = pytest.mark.bench

ROW_COLUMNS = {"recipe", "batch_size", "load_s", "cold_s", "hot_mean_s_per_img", "hot_median_s_per_img", "peak_mib",
               "images_per_s", "speedup", "psnr_db", "flops_per_image", "floor_s_per_img", "pct_of_floor",
               "exact", "approximations"}


def run_cli(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)


def test_bench_pipeline_on_tiny_writes_its_json(tmp_path, bench_cache, capsys):
    out = tmp_path / "pipeline.json"
    run_cli(["bench", "pipeline", "--model", "tiny", "--width", "64", "--height", "64", "--steps", "2",
             "--batch-sizes", "1,2", "--recipes", "baseline,exact,fast,exact:fuse_qkv=false", "--repeats", "1",
             "--cache-dir", str(bench_cache), "--json", str(out)])
    assert "bench pipeline: tiny 64x64" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["recipe"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {("baseline", 1), ("exact", 1), ("exact", 2), ("fast", 1), ("fast", 2),
                         ("exact:fuse_qkv=false", 1), ("exact:fuse_qkv=false", 2)}
    for row in rows.values():
        assert ROW_COLUMNS <= set(row)
        assert row["hot_median_s_per_img"] > 0 and row["images_per_s"] > 0 and row["peak_mib"] > 0
        assert row["flops_per_image"] > 0 and 0 < row["pct_of_floor"]
    assert rows["baseline", 1]["speedup"] == 1.0 and rows["baseline", 1]["psnr_db"] == "inf"
    for key in (("exact", 1), ("exact", 2), ("exact:fuse_qkv=false", 2)):
        assert rows[key]["exact"] and rows[key]["approximations"] == []
        assert rows[key]["psnr_db"] == "inf" or rows[key]["psnr_db"] >= 40.0
    # what fast approximates depends on the CPU (bf16 where the recipe table says it wins: AMX, and
    # AVX512_BF16 if measured so; float32 elsewhere): the expectation comes from the probe's recipe
    from pipeline.device import probe
    from pipeline.recipes import recipe_for

    expected = recipe_for(probe("cpu"), "fast").approximations()
    assert "tiny_vae" in expected
    assert not rows["fast", 2]["exact"] and rows["fast", 2]["approximations"] == expected
    assert math.isfinite(rows["fast", 2]["psnr_db"])
    assert result["reports"]["fast"]["applied"]["tiny_vae"] == "taesd-arch"  # the offline TAESD architecture
    assert result["reports"]["exact"]["recipe"]["scheduler_precompute"] is True
    machine = result["machine"]
    assert machine["gemm_flops_per_s"]["float32"] > 0 and machine["gemm_flops_per_s"]["bfloat16"] > 0
    assert len(machine["load_average_before"]) == 3
    assert {"CLIPTextModel", "UNet2DConditionModel", "Decoder"} <= set(result["flops_by_module"]["baseline"])


def test_bench_farm_on_tiny_writes_its_json(tmp_path, bench_cache, monkeypatch, capsys):
    monkeypatch.setenv("RENDERFARM_CACHE_DIR", str(bench_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    out = tmp_path / "farm.json"
    run_cli(["bench", "farm", "--model", "tiny", "--jobs", "4", "--batch-size", "2", "--width", "64",
             "--height", "64", "--steps", "2", "--rounds", "1", "--submit-jobs", "200", "--submit-repeats", "1",
             "--json", str(out)])
    get_settings.cache_clear()
    assert "bench farm: tiny" in capsys.readouterr().out
    result = json.loads(out.read_text())
    full, bare = result["full_path"], result["bare_loop"]
    assert full["images_per_s"] > 0 and bare["images_per_s"] > 0 and full["ratio_to_bare"] > 0
    assert full["runs"][0]["jobs"] == 4
    overhead = result["overhead"]
    assert overhead["jobs"] == 4 and overhead["render_s"] > 0 and overhead["overhead_ms_per_job"] is not None
    assert result["submission"]["jobs"] == 200 and result["submission"]["median_s"] > 0
    assert result["cpu_ms_per_job"]["total"] > 0
