"""The worker's prefetched jobs (``worker.consumer.ReservedJobs``): the ids held now, and the most it
ever held with the process's RSS at that moment (``renderfarm bench farm``'s worker memory)."""

from __future__ import annotations

import sys

import pytest

from worker.consumer import ReservedJobs


def test_the_peak_is_the_most_held_at_once_with_the_rss_then():
    reserved = ReservedJobs()
    assert (reserved.peak, reserved.rss_at_peak_kib) == (0, None)
    for job_id in ("a", "b", "c"):
        reserved.add(job_id)
    reserved.discard(["a", "b"])
    reserved.add("d")
    assert reserved.snapshot() == ["c", "d"] and reserved.peak == 3
    if sys.platform == "linux":
        assert reserved.rss_at_peak_kib is not None and reserved.rss_at_peak_kib > 0


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_the_rss_at_the_peak_agrees_with_proc_status():
    reserved = ReservedJobs()
    reserved.add("a")
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    rss = reserved.rss_at_peak_kib
    assert rss is not None and 0 < rss <= peak
