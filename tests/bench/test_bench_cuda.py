"""The CUDA columns of ``bench pipeline`` and ``bench profile`` on ``tiny``: run where CUDA is
present (the GPU machine's smoke pass runs the same commands), skipped elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

from infra.cli import main

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA columns and kernel counts)")]


def _cli(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)


def test_pipeline_on_cuda_reports_allocator_peaks_and_the_bf16_rate(tmp_path, bench_cache):
    out = tmp_path / "cuda.json"
    _cli(["bench", "pipeline", "--model", "tiny", "--device", "cuda", "--width", "128", "--height", "128",
          "--steps", "2", "--batch-sizes", "1,2", "--repeats", "1", "--recipes",
          "reference,peer:compile=false,exact,exact+batch_invariant", "--cache-dir", str(bench_cache),
          "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["machine"]["gemm_size"] == 8192 and result["machine"]["gemm_flops_per_s"]["bfloat16"] > 0
    for row in result["rows"]:
        assert row["peak_reserved_mib"] >= row["peak_allocated_mib"] > 0  # reserved: the whole process
        assert row["pct_of_bf16_matmul"] > 0 and row["it_per_s"] > 0
    assert {r["dtype"] for r in result["rows"] if r["kind"] == "reference"} == {"float16"}


def test_profile_on_cuda_counts_kernels_and_syncs_per_step(tmp_path, bench_cache):
    out = tmp_path / "profile.json"
    _cli(["bench", "profile", "--model", "tiny", "--device", "cuda", "--width", "128", "--height", "128",
          "--steps", "3", "--recipe", "exact", "--cache-dir", str(bench_cache), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["timeline"] == "cuda" and result["steps"] == 3
    assert result["per_step"]["launches"] > 0 and result["per_step"]["kernels"] > 0
    assert result["per_scheduler_step"]["launches"] is not None
    assert result["sync_debug"]["steps"] == 3 and result["sync_debug"]["per_step"] is not None
    assert sum(result["time_by_category"]["denoiser"].values()) > 0
