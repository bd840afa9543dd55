"""Reading a ``torch.profiler`` Chrome trace of one render: counts per denoising step, time by category.

Place in the data flow: :mod:`bench.pipeline.profile` exports the trace of one hot render whose
steps, denoiser calls and ``scheduler.step`` calls carry ranges (:class:`~bench.pipeline.render_probes.StepMarks`);
:func:`analyze` (here) turns its events into the numbers of the profile table. Pure functions of
the trace's JSON, so they are checked here on traces of the same format.

Event kinds used (Kineto's trace format, ``"ph": "X"`` complete events, times in µs):
``user_annotation`` (our ranges, on the host thread), ``cpu_op`` (ATen ops), ``cuda_runtime`` and
``cuda_driver`` (API calls on the host thread: ``cudaLaunchKernel``, ``cuLaunchKernel``,
``cudaGraphLaunch``, ``cudaMemcpyAsync``, ``cudaStreamSynchronize``, …, each with a
``correlation`` id) and ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` (device activity, carrying
the ``correlation`` id of the API call that launched it).

A range's counts are the host events inside its time span on its thread, and the device events
correlated with those API calls. Host-device synchronizations are the API calls that block the
host (:data:`SYNC_CALLS`); device-to-host copies are counted beside them (a ``.item()`` or
``.cpu()`` is one copy and one ``cudaStreamSynchronize``). The ERNIE-ViLG 2.0 article (Baidu,
PaddlePaddle) counts kernel launches per ``scheduler.step`` this way (about 12 → 7).
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

CATEGORIES = ("attention", "gemm", "norm", "elementwise/other")
_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|softmax", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|sm\d{2,3}_|matmul|\bmm\b|addmm|bmm|_mm\b|mm_|"
                   r"triton_tem|conv|cudnn|mkldnn|linear", re.I)
_NORM = re.compile(r"norm|RowwiseMoments|ComputeFusedParams|welford", re.I)  # ATen group norm: moments + apply
_FUSED_POINTWISE = ("triton_poi", "triton_per", "triton_red")  # Inductor's non-matmul kernels
LAUNCH = re.compile(r"LaunchKernel|LaunchCooperativeKernel|GraphLaunch")
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"})
HOST_API = ("cuda_runtime", "cuda_driver")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """The time category of a kernel or ATen op name: attention (flash, fmha, SDPA, softmax),
    gemm (cuBLAS/cuBLASLt incl. ``nvjet``, CUTLASS, cuDNN convolutions, Inductor templates,
    ``aten::mm``/``addmm``/oneDNN convolutions on the CPU), norm (layer/group/RMS norms, fused
    or not), elementwise/other (everything else, copies included)."""
    if _ATTENTION.search(name):
        return "attention"
    if not name.startswith(_FUSED_POINTWISE) and _GEMM.search(name):
        return "gemm"
    if _NORM.search(name):
        return "norm"
    return "elementwise/other"


class _Timeline:
    """Events of one kind on one thread, sorted by start, for span queries."""

    def __init__(self, events: Iterable[dict]):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def within(self, start: float, end: float) -> list[dict]:
        lo = bisect.bisect_left(self.starts, start)
        hi = bisect.bisect_right(self.starts, end)
        return [e for e in self.events[lo:hi] if e["ts"] + e.get("dur", 0) <= end + 1e-3]


def _by_thread(events: Iterable[dict]) -> dict:
    out = defaultdict(list)
    for e in events:
        out[e.get("tid")].append(e)
    return {tid: _Timeline(evs) for tid, evs in out.items()}


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """(op, self µs) for the nested ops of one thread: its duration less its direct children's."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0)))
    selves = [float(op.get("dur", 0)) for op in ops]
    open_ops: list[int] = []
    for i, op in enumerate(ops):
        while open_ops and ops[open_ops[-1]]["ts"] + ops[open_ops[-1]].get("dur", 0) <= op["ts"]:
            open_ops.pop()
        if open_ops:
            selves[open_ops[-1]] -= op.get("dur", 0)
        open_ops.append(i)
    return [(op, max(0.0, t)) for op, t in zip(ops, selves)]


def _top_level(ops: list[dict]) -> int:
    """How many ops are not inside another op (one thread)."""
    count, end = 0, float("-inf")
    for op in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if op["ts"] >= end:
            count += 1
            end = op["ts"] + op.get("dur", 0)
    return count


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def analyze(events: list[dict], ranges: tuple[str, str, str]) -> dict:
    """Counts per range kind and time by category, from a trace's ``traceEvents``.

    ``ranges`` = (step, denoiser, scheduler.step) range names. Returns ``steps`` (how many step
    ranges), ``per_step`` / ``per_denoiser_call`` / ``per_scheduler_step`` (medians of
    ``launches``, ``kernels``, ``syncs``, ``d2h_copies``, ``cpu_ops``; the first four None without
    device events), ``denoiser`` (``ms_per_call``: median device span of a call's kernels, or its
    host duration without a device; ``busy_ms_per_call``: summed kernel time), ``time_by_category``
    (``render`` and ``denoiser``: category → ms), ``timeline`` (``cuda`` or ``cpu``) and
    ``time_unit``.
    """
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if e.get("cat") in DEVICE]
    has_device = bool(device)
    by_corr = defaultdict(list)
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr[corr].append(e)
    api = _by_thread(e for e in complete if e.get("cat") in HOST_API)
    ops = [e for e in complete if e.get("cat") == "cpu_op"]
    op_lines = _by_thread(ops)
    annotations = [e for e in complete if e.get("cat") == "user_annotation"]
    step_name, denoiser_name, scheduler_name = ranges

    def counts(r: dict) -> dict:
        start, end, tid = r["ts"], r["ts"] + r.get("dur", 0), r.get("tid")
        inside_ops = op_lines[tid].within(start, end) if tid in op_lines else []
        out: dict[str, Any] = {"cpu_ops": _top_level(inside_ops)}
        if not has_device:
            return {"launches": None, "kernels": None, "syncs": None, "d2h_copies": None, **out}
        calls = api[tid].within(start, end) if tid in api else []
        launched = [d for c in calls for d in by_corr.get((c.get("args") or {}).get("correlation"), ())]
        out.update(launches=sum(1 for c in calls if LAUNCH.search(c["name"])),
                   kernels=sum(1 for d in launched if d.get("cat") == "kernel"),
                   syncs=sum(1 for c in calls if c["name"] in SYNC_CALLS),
                   d2h_copies=sum(1 for d in launched if d.get("cat") == "gpu_memcpy" and "DtoH" in d["name"]))
        out["_device"] = launched
        return out

    per_kind: dict[str, list[dict]] = {}
    for name in ranges:
        per_kind[name] = [counts(r) for r in annotations if r["name"] == name]

    def medians(rows: list[dict]) -> dict:
        keys = ("launches", "kernels", "syncs", "d2h_copies", "cpu_ops")
        return {k: (None if not rows or rows[0][k] is None else _median([r[k] for r in rows])) for k in keys}

    denoiser_rows = per_kind[denoiser_name]
    if has_device:
        spans = [max(d["ts"] + d.get("dur", 0) for d in r["_device"]) - min(d["ts"] for d in r["_device"])
                 for r in denoiser_rows if r["_device"]]
        busy = [sum(d.get("dur", 0) for d in r["_device"] if d.get("cat") == "kernel") for r in denoiser_rows]
        render_time = _category_ms((d["name"], d.get("dur", 0)) for d in device if d.get("cat") in DEVICE)
        denoiser_time = _category_ms((d["name"], d.get("dur", 0)) for r in denoiser_rows for d in r["_device"])
        unit = "device ms: summed kernel and copy durations"
    else:
        spans = [r.get("dur", 0) for r in annotations if r["name"] == denoiser_name]
        busy = spans
        selves = [st for tl in op_lines.values() for st in _self_times(tl.events)]
        render_time = _category_ms((op["name"], t) for op, t in selves)
        windows = [(r["ts"], r["ts"] + r.get("dur", 0), r.get("tid"))
                   for r in annotations if r["name"] == denoiser_name]
        denoiser_time = _category_ms((op["name"], t) for op, t in selves
                                     if any(s <= op["ts"] <= e and op.get("tid") == tid for s, e, tid in windows))
        unit = "CPU ms: self time of ATen ops"
    return {
        "steps": len(per_kind[step_name]),
        "denoiser_calls": len(denoiser_rows),
        "per_step": medians(per_kind[step_name]),
        "per_denoiser_call": medians(denoiser_rows),
        "per_scheduler_step": medians(per_kind[scheduler_name]),
        "denoiser": {"ms_per_call": _median([s / 1000 for s in spans]),
                     "busy_ms_per_call": _median([b / 1000 for b in busy])},
        "time_by_category": {"render": render_time, "denoiser": denoiser_time},
        "timeline": "cuda" if has_device else "cpu",
        "time_unit": unit,
    }


def _category_ms(items: Iterable[tuple[str, float]]) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, micros in items:
        out[category(name)] += micros / 1000
    return {k: round(v, 3) for k, v in out.items()}
