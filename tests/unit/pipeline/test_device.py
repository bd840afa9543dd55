"""Device probe → DeviceProfile: the real probe on this machine, and fake profiles."""

from __future__ import annotations

import json

import pytest

from pipeline.device import GB, DeviceProfile, cpu_flags, cpu_summary, probe


def test_probe_cpu_reads_the_host():
    p = probe("cpu")
    assert p.kind == "cpu" and p.torch_device == "cpu"
    assert p.cpu_cores >= 1
    assert 0 < p.free_memory_bytes <= p.total_memory_bytes
    assert p.compute_capability is None and not p.flash_attn_available
    flags = open("/proc/cpuinfo").read().split()
    assert p.avx512 == ("avx512f" in flags)
    assert p.amx == ("amx_tile" in flags and "amx_bf16" in flags)


def test_probe_auto_falls_back_to_cpu_without_accelerators():
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("an accelerator is present")
    assert probe("auto").kind == "cpu"


def test_probe_rejects_unknown_and_absent_devices():
    with pytest.raises(ValueError, match="unknown device"):
        probe("tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no cuda backend"):
            probe("cuda:0")


def test_fake_profile_is_frozen_and_json_able():
    p = DeviceProfile(kind="cuda", name="NVIDIA H100", index=1, compute_capability=[9, 0],
                      total_memory_bytes=80 * GB, free_memory_bytes=79 * GB, flash_attn_available=True)
    assert p.compute_capability == (9, 0) and p.torch_device == "cuda:1"
    d = json.loads(json.dumps(p.to_dict()))
    assert d["compute_capability"] == [9, 0] and d["total_memory_gb"] == 80.0
    with pytest.raises(AttributeError):
        p.kind = "cpu"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown device kind"):
        DeviceProfile(kind="tpu")


def test_cpu_summary_names_the_isa_the_probe_sees():
    """What a benchmark prints about its CPU agrees with the flags the recipes choose by."""
    p, summary = probe("cpu"), cpu_summary()
    assert summary["name"] == p.name and summary["cores"] == p.cpu_cores
    expected = ("AMX" if p.amx else "AVX-512 + AVX512_BF16" if p.avx512_bf16 else "AVX-512" if p.avx512 else
                "AVX2" if "avx2" in cpu_flags() else "baseline")
    assert summary["isa"] == expected
