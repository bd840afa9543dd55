"""``renderfarm bench pipeline --table modelcard`` on ``tiny`` (CPU): the SDNQ uint4 model card's
columns, one spec at a time, and the allocator check that comes before any load."""

from __future__ import annotations

import importlib.util
import json

import pytest

from infra.cli import main

pytestmark = pytest.mark.bench
CARD_COLUMNS = {"load_s", "load_peak_allocated_mib", "load_peak_reserved_mib", "cold_s", "cold_peak_allocated_mib",
                "hot_mean_s_per_img", "hot_median_s_per_img", "hot_range_s_per_img", "hot_peak_reserved_mib",
                "hot_peak_allocated_mib", "speed_vs_first", "peak_vs_first", "psnr_db"}


def _run(tmp_path, bench_cache, specs: str) -> dict:
    out = tmp_path / "modelcard.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "pipeline", "--table", "modelcard", "--model", "tiny", "--width", "64", "--height", "64",
              "--steps", "2", "--guidance-scale", "1", "--repeats", "2", "--recipes", specs, "--device", "cpu",
              "--cache-dir", str(bench_cache), "--json", str(out)])
    assert exit_info.value.code in (0, None)
    return json.loads(out.read_text())


def test_modelcard_table_on_tiny(tmp_path, bench_cache, capsys):
    result = _run(tmp_path, bench_cache, "reference,exact")
    assert "--table modelcard" in capsys.readouterr().out
    assert result["benchmark"] == "modelcard" and result["allocator_check"].startswith("passed")
    rows = {r["recipe"]: r for r in result["rows"]}
    assert list(rows) == ["reference", "exact"]
    for row in rows.values():
        assert CARD_COLUMNS <= set(row) and len(row["hot_s_per_img"]) == 2
        assert row["load_peak_allocated_mib"] > 0 and row["hot_peak_allocated_mib"] > 0  # RSS on the CPU
        assert row["hot_peak_reserved_mib"] is None  # the CUDA caching allocator's: null here
        assert row["hot_range_s_per_img"][0] <= row["hot_median_s_per_img"] <= row["hot_range_s_per_img"][1]
    assert rows["reference"]["speed_vs_first"] == 1.0 and rows["reference"]["peak_vs_first"] == 1.0
    assert rows["exact"]["speed_vs_first"] > 0 and rows["exact"]["psnr_db"] is not None


@pytest.mark.skipif(importlib.util.find_spec("sdnq") is None, reason="sdnq not installed (pip install --no-deps sdnq)")
def test_modelcard_sdnq_uint4_enables_quantized_matmul(tmp_path, bench_cache):
    result = _run(tmp_path, bench_cache, "reference,sdnq-uint4")
    row = {r["recipe"]: r for r in result["rows"]}["sdnq-uint4"]
    assert "quantization" in row["approximations"] and row["dtype"] == "bfloat16"
    quantized = row["applied"]["sdnq_uint4"]
    assert {q["component"] for q in quantized} == {"text_encoder", "unet"}  # the card: pe, text_encoder, transformer
    assert all(q["use_quantized_matmul"] for q in quantized)  # switched on explicitly, as the card says
    assert row["psnr_db"] != "inf"  # uint4 weights change the pixels


def test_the_allocator_pitfall_is_refused_before_loading(monkeypatch, bench_cache):
    from bench.pipeline import PipelineBenchConfig, run_pipeline_bench

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:32")
    with pytest.raises(ValueError, match="expandable_segments"):
        run_pipeline_bench(PipelineBenchConfig(model="tiny", table="modelcard", device="cpu",
                                               recipes=("reference",), cache_dir=str(bench_cache)))
