"""``renderfarm bench pipeline`` and ``renderfarm bench farm`` run end to end on ``tiny`` (tiny
sizes, one round) and write their JSON with the expected columns. Timings are not asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from infra.cli import main

pytestmark = [pytest.mark.bench, pytest.mark.long]

#: The documented columns, plus the ones the ratios and the roofline need.
ROW_COLUMNS = {"recipe", "kind", "resolved", "batch_size", "dtype", "exact", "approximations", "load_s", "cold_s",
               "hot_mean_s_per_img", "hot_median_s_per_img", "it_per_s", "images_per_s", "peak_allocated_mib",
               "peak_reserved_mib", "psnr_db", "flops_per_image", "denoiser_flops_per_image", "pct_of_bf16_matmul",
               "denoiser_calls", "speedup", "vs_peer", "floor_s_per_img", "pct_of_floor"}
SPECS = ("reference", "peer", "exact", "fast", "exact+batch_invariant", "exact:fuse_qkv=false")
STEPS = 2  # tiny's scheduler is DDIM: one UNet call per step, classifier-free guidance batched


def run_cli(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)


def test_bench_pipeline_on_tiny_writes_its_json(tmp_path, bench_cache, capsys):
    from pipeline.device import probe
    from pipeline.recipes import recipe_for

    out = tmp_path / "pipeline.json"
    run_cli(["bench", "pipeline", "--model", "tiny", "--width", "64", "--height", "64", "--steps", str(STEPS),
             "--batch-sizes", "1,2", "--recipes", ",".join(SPECS), "--repeats", "1", "--device", "cpu",
             "--cache-dir", str(bench_cache), "--json", str(out)])
    assert "bench pipeline: tiny 64x64" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["recipe"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(spec, b) for spec in SPECS for b in (1, 2)}
    for row in rows.values():
        assert ROW_COLUMNS <= set(row)
        assert row["hot_median_s_per_img"] > 0 and row["images_per_s"] > 0 and row["peak_allocated_mib"] > 0
        assert row["peak_reserved_mib"] is None  # a CUDA allocator figure: null on the CPU
        assert row["denoiser_calls"] == STEPS
        assert row["it_per_s"] == pytest.approx(STEPS / (row["hot_median_s_per_img"] * row["batch_size"]), rel=0.01)
        assert 0 < row["denoiser_flops_per_image"] < row["flops_per_image"] and row["pct_of_bf16_matmul"] > 0
    reference = rows["reference", 1]
    assert reference["kind"] == "reference" and reference["dtype"] == "float32"  # the CPU's recommended dtype
    assert reference["speedup"] == 1.0 and reference["psnr_db"] == "inf" and reference["exact"]
    assert rows["exact", 2]["speedup"] > 0 and rows["exact", 2]["vs_peer"] > 0
    peer = result["reports"]["peer"]
    assert rows["peer", 1]["dtype"] == "bfloat16" and rows["peer", 1]["approximations"] == ["dtype"]
    assert peer["applied"]["fuse_qkv"] == ["unet", "vae"] and set(peer["applied"]["channels_last"]) == {"unet", "vae"}
    assert "compile" in peer["skipped"]  # the tutorial's torch.compile is for CUDA; opt-in on the CPU
    for key in (("exact", 1), ("exact", 2), ("exact:fuse_qkv=false", 2), ("exact+batch_invariant", 2)):
        assert rows[key]["exact"] and rows[key]["approximations"] == []
        assert rows[key]["psnr_db"] == "inf" or rows[key]["psnr_db"] >= 40.0
    assert "batch-invariant" in result["reports"]["exact+batch_invariant"]["resolved"]
    # exact does the reference's arithmetic; a module it runs in OpenVINO, invisible to the counter,
    # gets the FLOPs of its eager twin, and the report says which (rel: the VAE's 1x1 post-quant
    # convolution, counted apart in the reference, runs inside OpenVINO's decoder: 2 kFLOP here)
    hidden = result["reports"]["exact"].get("flops_from_eager", [])
    assert rows["exact", 1]["flops_per_image"] == pytest.approx(reference["flops_per_image"], rel=1e-4), hidden
    compiled = result["reports"]["exact"]["observed"]["compiled"]
    runtimes = {r["where"] for r in compiled if r["how"].startswith("runtime")}
    assert runtimes == {"unet", "vae.decoder"} and set(hidden) == {"UNet2DConditionModel", "Decoder"}, runtimes
    fast = recipe_for(probe("cpu"), "fast")  # what fast approximates depends on the CPU (bf16 with AMX)
    assert set(rows["fast", 2]["approximations"]) == set(fast.approximations()) and not rows["fast", 2]["exact"]
    assert math.isfinite(rows["fast", 2]["psnr_db"])
    assert result["reports"]["fast"]["applied"]["tiny_vae"] == "taesd-arch"  # the offline TAESD architecture
    assert result["reports"]["exact"]["recipe"]["scheduler_precompute"] is True
    machine = result["machine"]
    assert machine["gemm_flops_per_s"]["float32"] > 0 and machine["gemm_flops_per_s"]["bfloat16"] > 0
    assert set(machine["gemm_sizes"]) == {"float32", "bfloat16"} and len(machine["load_average_before"]) == 3
    assert machine["gemm_size"] == max(machine["gemm_sizes"].values())
    assert set(machine["gemm_sizes"].values()) <= {256, 512, 1024, 2048}
    assert {"CLIPTextModel", "UNet2DConditionModel", "Decoder"} <= set(result["flops_by_module"]["reference"])


def test_bench_pipeline_sequential_runs_one_spec_at_a_time(tmp_path, bench_cache):
    out = tmp_path / "sequential.json"
    knobs = "exact:fp8=true+first_block_cache=0.2"
    run_cli(["bench", "pipeline", "--model", "tiny", "--width", "64", "--height", "64", "--steps", "1",
             "--batch-sizes", "1", "--recipes", f"exact,reference,{knobs}", "--repeats", "2", "--sequential",
             "--no-flops", "--device", "cpu", "--cache-dir", str(bench_cache), "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["recipe"]: r for r in result["rows"]}
    assert list(rows) == ["reference", "exact", knobs]  # the reference first: the others are compared with it
    assert len(rows["exact"]["hot_s_per_img"]) == 2 and rows["exact"]["psnr_db"] is not None
    assert rows["exact"]["denoiser_calls"] == 1 and rows["exact"]["flops_per_image"] is None  # --no-flops
    # knobs that cannot apply here are skipped with their reason, and the row stays what it is
    skipped = result["reports"][knobs]["skipped"]
    assert "compute capability >= 8.9" in skipped["fp8"] and "no transformer blocks" in skipped["first_block_cache"]
    assert rows[knobs]["approximations"] == [] and rows[knobs]["exact"]


def test_bench_pipeline_refuses_a_bad_spec_with_its_reason(bench_cache, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "pipeline", "--model", "tiny", "--recipes", "reference,exact+warp_speed", "--device", "cpu",
              "--cache-dir", str(bench_cache)])
    assert exit_info.value.code == 2
    assert "unknown flag 'warp_speed' in bench spec 'exact+warp_speed'" in capsys.readouterr().out


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


def test_bench_farm_simulated_gpu_reports_its_efficiency_at_the_requested_size(tmp_path, capsys):
    out = tmp_path / "farm-null.json"
    run_cli(["bench", "farm", "--model", "null", "--render-ms-per-image", "5", "--jobs", "32", "--batch-size", "8",
             "--width", "128", "--height", "96", "--rounds", "1", "--submit-jobs", "0", "--json", str(out)])
    assert "bench farm: null, 32 jobs, 1 worker(s), batch 8, 5 ms/img, 128x96" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["config"]["width"], result["config"]["height"]) == (128, 96)
    run = result["full_path"]["runs"][0]
    assert run["jobs"] == 32 and run["image_sizes"] == ["128x96"]  # the flags reached the requests
    assert run["content_types"] == ["image/png"]
    assert run["image_bytes_mean"] > 128 * 96  # noise, not a flat colour: over a byte per pixel
    sim = result["simulated_gpu"]
    assert sim["ms_per_image"] == 5 and sim["sleep_bound_images_per_s"] == 200.0
    assert sim["efficiency"] > 0 and sim["worker_span_efficiency"] > 0
    assert "submission" not in result  # --submit-jobs 0
    (worker,) = result["worker_memory"]["workers"]
    assert (worker["batch_size"], worker["prefetch_limit"]) == (8, 16)
    assert 1 <= worker["prefetch_peak_jobs"] <= 16  # every job was prefetched before it started
    assert 0 < worker["rss_mib_at_prefetch_peak"] <= worker["peak_rss_mib"]


def test_bench_redis_with_the_state_store_and_a_broker_shard_apart_splits_redis_cpu_and_commands(tmp_path, capsys):
    out = tmp_path / "redis-split.json"
    run_cli(["bench", "redis", "--workers", "2", "--jobs", "64", "--batch-size", "16", "--split-state",
             "--broker-shards", "2", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    # the job transitions are the state store's, the messages the brokers': every Redis served
    # commands per job (counted exactly; their CPU, read from /proc in 10 ms ticks, is measured but
    # too coarse to assert on 64 jobs), and the two brokers about alike, each with every second job
    assert row["redis_state_commands_per_job"] > row["redis_commands_per_job"] > 0, row
    assert row["redis_commands_per_job"] == pytest.approx(row["redis_shard_commands_per_job"], rel=0.5), row
    assert None not in (row["redis_cpu_ms_per_job"], row["redis_state_cpu_ms_per_job"],
                        row["redis_shard_cpu_ms_per_job"]), row
    printed = capsys.readouterr().out
    assert "a broker and a state-store redis-server and a second broker" in printed


def test_bench_farm_encodes_the_requested_output_format(tmp_path, capsys):
    out = tmp_path / "farm-null-jpeg.json"
    run_cli(["bench", "farm", "--model", "null", "--jobs", "16", "--batch-size", "8", "--width", "128", "--height",
             "128", "--output-format", "jpeg", "--rounds", "1", "--submit-jobs", "0", "--no-bare", "--json", str(out)])
    from pipeline.device import cpu_summary

    printed = capsys.readouterr().out
    assert "bench farm: null, 16 jobs, 1 worker(s), batch 8, 0 ms/img, 128x128 jpeg" in printed
    result = json.loads(out.read_text())
    cpu = cpu_summary()
    assert result["machine"]["cpu"] == cpu and f"({cpu['isa']})" in printed  # the table names its CPU
    assert result["config"]["output_format"] == "jpeg"
    (run,) = result["full_path"]["runs"]
    assert run["content_types"] == ["image/jpeg"] and run["image_sizes"] == ["128x128"]
    pc = result["per_core"]  # the per-core rows: host = API + Redis + worker, SeaweedFS apart
    cpu_ms = result["cpu_ms_per_job"]
    assert pc["host_cpu_ms_per_job"] == pytest.approx(cpu_ms["api"] + cpu_ms["redis"] + cpu_ms["null-1"], abs=2e-3)
    assert pc["worker_cores_for_gpu"]["10.0"] == pytest.approx(cpu_ms["null-1"] / 10, abs=0.01)
    assert "cores a GPU at 10.0 ms/img needs" in printed


def test_bench_two_stage_on_tiny_has_a_row_per_path(tmp_path, bench_cache, monkeypatch, capsys):
    monkeypatch.setenv("RENDERFARM_CACHE_DIR", str(bench_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    out = tmp_path / "twostage.json"
    run_cli(["bench", "pipeline", "--two-stage", "--model", "tiny", "--target", "256", "--steps", "1",
             "--upscaler", "tiny-esrgan-x4", "--diffusion-upscaler", "tiny-sd-x4-upscaler", "--upscale-steps", "2",
             "--repeats", "1", "--device", "cpu", "--json", str(out)])
    from pipeline.device import cpu_summary

    printed = capsys.readouterr().out
    assert "bench pipeline --two-stage: tiny" in printed
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] == cpu_summary() and f"({cpu_summary()['isa']})" in printed  # names its CPU
    rows = result["rows"]
    assert [r["path"] for r in rows] == ["direct", "64² + tiny-esrgan-x4 ×4", "128² + tiny-esrgan-x4 ×2",
                                         "64² + tiny-sd-x4-upscaler ×4"]
    assert [r["diffusion_size"] for r in rows] == ["256x256", "64x64", "128x128", "64x64"]
    assert {r["output_size"] for r in rows} == {"256x256"}
    assert rows[0]["upscale_s_per_img"] == 0.0 and all(r["upscale_s_per_img"] > 0 for r in rows[1:])
    assert all(r["speedup"] > 0 for r in rows)


def test_bench_two_stage_refuses_a_target_that_does_not_divide(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "pipeline", "--two-stage", "--model", "tiny", "--target", "100", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "bench pipeline --two-stage: target 100 / 4 is not a multiple of 8" in capsys.readouterr().out


def test_bench_submit_records_every_job_of_each_post(tmp_path, capsys):
    out = tmp_path / "submit.json"
    run_cli(["bench", "submit", "--jobs", "40", "--repeats", "2", "--json", str(out)])
    assert "bench submit: 40 jobs per POST /v1/batches" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"] == {"jobs": 40, "repeats": 2}
    for what in ("post", "client", "api_cpu"):
        assert len(result[what]["runs_s"]) == 2 and result[what]["median_s"] >= 0
    assert result["post"]["jobs_per_s"] > 0  # every POST answered 202 with 40 job ids, or the command failed


def test_bench_messages_moves_every_job_id_once_in_both_modes(tmp_path, capsys):
    """Per-job mode sends one message per job and group mode ceil(jobs / group); the command itself
    fails when a mode loses or repeats a job id, so a result means every id arrived exactly once."""
    out = tmp_path / "messages.json"
    run_cli(["bench", "messages", "--jobs", "130", "--group", "64", "--rounds", "2", "--json", str(out)])
    assert "bench messages: 130 jobs per mode and round, groups of 64" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [run["messages"] for run in result["runs"]["per-job"]] == [130, 130]
    assert [run["messages"] for run in result["runs"]["group"]] == [3, 3]
    for mode in ("per-job", "group"):
        assert result["medians"][mode]["total_ms"] > 0


@pytest.mark.parametrize(("name", "target"), [("farm-sim10-64", "≥ 95 %"), ("farm-sim10-512", "≥ 90 %")])
def test_bench_farm_table_states_the_target_of_its_image_size(name, target):
    from rich.console import Console

    from bench.farm.farm_table import result_table

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / f"docs/benchmarks/cpu-epyc-f25-avx512-bf16-{name}.json").read_text())
    console = Console(width=250, record=True)
    console.print(result_table(result))
    (line,) = [line for line in console.export_text().splitlines() if "efficiency, end to end" in line]
    assert line.rstrip(" │").endswith(target), line


def test_bench_pipeline_modes_rows_count_each_modes_denoiser_calls(tmp_path, capsys):
    out = tmp_path / "modes.json"
    run_cli(["bench", "pipeline", "--modes", "--model", "tiny", "--width", "64", "--height", "64", "--steps", "4",
             "--repeats", "2", "--adapters", "0", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == ["txt2img", "img2img", "inpaint", "controlnet", "ip-adapter"]
    # strength 0.5 runs the schedule's second half; the units add work inside the same denoiser calls
    assert [rows[m]["denoiser_calls"] for m in rows] == [4, 2, 2, 4, 4], rows
    assert all(0 < row["s_per_img_best"] <= row["s_per_img"] for row in rows.values()), rows
    assert result["preprocess"]["canny_s_per_img"] > 0
    assert "ip-adapter" in capsys.readouterr().out
