"""The bench's GEMM-rate probe: sized by how fast this CPU runs each dtype, so a CPU without
native bfloat16 (AVX2 only) does not spend minutes on one 2048³ bf16 call."""

from __future__ import annotations

import torch

from pipeline.bench import measure


def test_gemm_size_grows_until_one_call_takes_the_target_time(monkeypatch):
    monkeypatch.setattr(measure, "CPU_GEMM_CALL_S", 0.0)  # every call is long enough: the smallest size
    assert measure.gemm_size(torch.float32) == 256
    monkeypatch.setattr(measure, "CPU_GEMM_CALL_S", float("inf"))  # none is: the cap
    assert measure.gemm_size(torch.float32) == measure.GEMM_SIZES["cpu"] == 2048
    assert measure.gemm_size(torch.float32, "cuda:0") == 8192  # accelerators keep the chip-filling size


def test_gemm_rates_are_measured_at_the_probed_sizes():
    sizes = measure.gemm_sizes("cpu")
    assert set(sizes) == {"float32", "bfloat16"} and set(sizes.values()) <= {256, 512, 1024, 2048}
    rates = measure.gemm_rates("cpu", sizes)
    assert set(rates) == set(sizes) and all(r > 0 for r in rates.values())
