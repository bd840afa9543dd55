"""The bench's GEMM-rate probe: sized by how fast this CPU runs each dtype, so a CPU without
native bfloat16 (AVX2 only) does not spend minutes on one 2048³ bf16 call; and what ``bench ready``
waits for after a phase: every process the phase left running, found by its environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from bench.pipeline import instruments


def test_gemm_size_grows_until_one_call_takes_the_target_time(monkeypatch):
    monkeypatch.setattr(instruments, "CPU_GEMM_CALL_S", 0.0)  # every call is long enough: the smallest size
    assert instruments.gemm_size(torch.float32) == 256
    monkeypatch.setattr(instruments, "CPU_GEMM_CALL_S", float("inf"))  # none is: the cap
    assert instruments.gemm_size(torch.float32) == instruments.GEMM_SIZES["cpu"] == 2048
    assert instruments.gemm_size(torch.float32, "cuda:0") == 8192  # accelerators keep the chip-filling size


def test_gemm_rates_are_measured_at_the_probed_sizes():
    sizes = instruments.gemm_sizes("cpu")
    assert set(sizes) == {"float32", "bfloat16"} and set(sizes.values()) <= {256, 512, 1024, 2048}
    rates = instruments.gemm_rates("cpu", sizes)
    assert set(rates) == set(sizes) and all(r > 0 for r in rates.values())


def _marked() -> tuple[str, dict[str, str]]:
    """A ``NAME=value`` marker no other process has, and this environment with it set."""
    value = uuid.uuid4().hex
    return f"RENDERFARM_TEST_MARK={value}", {**os.environ, "RENDERFARM_TEST_MARK": value}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_wait_until_gone_waits_for_what_an_exited_process_left_running(tmp_path):
    """Seen while the orphan runs, gone once it has ended: the orphan waits for a file, so the
    order of events is the test's, whatever the machine's speed."""
    marker, env = _marked()
    release = tmp_path / "release"
    busy = instruments.machine_busy_s()
    # the shell exits at once; the loop it put in the background goes on, an orphan with its environment
    subprocess.run(["sh", "-c", f"(while [ ! -e '{release}' ]; do sleep 0.05; done) &"], env=env, check=True)
    assert not instruments.wait_until_gone(marker, timeout_s=0)  # its parent is gone, the orphan is not
    assert not instruments.wait_until_gone(marker, timeout_s=0.3)  # nor does it end by itself
    release.touch()
    assert instruments.wait_until_gone(marker, timeout_s=30)
    assert instruments.wait_until_gone(marker, timeout_s=0)  # nothing left: true at once
    after = instruments.machine_busy_s()
    assert busy is not None and after is not None and after >= busy


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_wait_until_gone_gives_up_after_its_timeout():
    marker, env = _marked()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        started = time.monotonic()
        assert not instruments.wait_until_gone(marker, timeout_s=0.5)
        # it waited its timeout (a lower bound, which a slow machine only adds to); False before the
        # child's 60 s are up can only be the timeout firing, so the upper bound is loose on purpose
        assert 0.5 <= time.monotonic() - started < 30
    finally:
        child.kill()
        child.wait()
    assert instruments.wait_until_gone(marker, timeout_s=10)
