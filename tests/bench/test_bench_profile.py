"""``renderfarm bench profile`` on ``tiny`` (CPU): per-step counts, scheduler.step counts, time by
category, the denoiser's FLOPs per call, and the saved trace. Timings are not asserted."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.pipeline.trace import CATEGORIES
from infra.cli import main

pytestmark = pytest.mark.bench
STEPS = 3


# The farm's Renderer and a plain diffusers call. The farm's UNet runs on PyTorch here (backend=torch):
# on CPUs whose recipe runs it in OpenVINO, its kernels are outside torch.profiler's view.
@pytest.mark.parametrize("spec", ["exact:backend=torch", "reference"])
def test_bench_profile_on_tiny_writes_per_step_counts_and_categories(spec, tmp_path, bench_cache, capsys):
    out, saved = tmp_path / "profile.json", tmp_path / "trace.json.gz"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "profile", "--model", "tiny", "--width", "64", "--height", "64", "--steps", str(STEPS),
              "--recipe", spec, "--device", "cpu", "--cache-dir", str(bench_cache), "--json", str(out),
              "--trace", str(saved)])
    assert exit_info.value.code in (0, None)
    assert "per denoising step" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["steps"] == STEPS and result["denoiser_calls"] == STEPS  # DDIM: one UNet call per step
    per_step, per_call, per_sched = result["per_step"], result["per_denoiser_call"], result["per_scheduler_step"]
    assert per_step["cpu_ops"] > per_call["cpu_ops"] > per_sched["cpu_ops"] > 0  # a step holds both
    assert per_step["launches"] is None and result["sync_debug"] is None  # CUDA-only figures: null on the CPU
    render, denoiser = result["time_by_category"]["render"], result["time_by_category"]["denoiser"]
    assert list(render) == list(CATEGORIES) and render["gemm"] > 0 and denoiser["gemm"] > 0
    assert sum(denoiser.values()) < sum(render.values())  # the render also encodes text and decodes
    assert result["timeline"] == "cpu" and result["denoiser"]["ms_per_call"] > 0
    assert 0 < result["denoiser"]["flops_per_call"] * STEPS < result["flops_per_render"]
    assert result["denoiser"]["pct_of_bf16_matmul"] > 0
    events = json.loads(gzip.decompress(saved.read_bytes()))["traceEvents"]
    assert sum(e.get("name") == "renderfarm/step" for e in events) == STEPS
