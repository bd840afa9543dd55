"""Measuring instruments of the bench: device timers, memory windows, the machine's GEMM rate,
PSNR, the weights' bytes, the load average.

Place in the data flow: :mod:`bench.pipeline.side_by_side`, :mod:`bench.pipeline.modelcard` and
:mod:`bench.pipeline.profile` wrap renders in these; nothing here renders.

Timing on CUDA uses CUDA events recorded on the current stream around the render, read after
``Event.synchronize()`` (device work is asynchronous; a host clock would stop early); elsewhere
``time.perf_counter`` after the device's ``synchronize``. Memory on CUDA is
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``
(one window per measured render); on the CPU the process RSS and its high-water mark
(:mod:`pipeline.memory`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.memory import current_bytes, peak_bytes, reset_peak

MIB = 2**20
#: GEMM sizes (M = N = K) of the machine's matmul rate: a large one fills an H100 (METHOD: "use a
#: size that fills the chip"); on the CPU 2048³ (the earlier CPU tables) is the largest size, see
#: :func:`gemm_size`.
GEMM_SIZES = {"cuda": 8192, "cpu": 2048}
#: On the CPU the probe's size doubles from 256 until one call takes this long (seconds) or
#: reaches 2048: a CPU without native bfloat16 (AVX2 only, no AVX512_BF16 or AMX) runs a bf16
#: GEMM at ~1 GFLOP/s (measured on a 2-core AMD EPYC with AVX2: 0.87–1.29 GFLOP/s from 256³ to
#: 1024³), where one 2048³ call would take ~20 s and a probe of six calls two minutes.
CPU_GEMM_CALL_S = 0.1


def device_kind(device: str) -> str:
    """``"cuda:0"`` → ``"cuda"``."""
    return device.partition(":")[0]


def _accelerator(device: str):
    kind = device_kind(device)
    mod = getattr(torch, kind, None) if kind in ("cuda", "xpu", "npu", "mps") else None
    return mod if mod is not None and hasattr(mod, "synchronize") else None


def sync(device: str) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    mod = _accelerator(device)
    if mod is not None:
        mod.synchronize()


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so RSS growth is real use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class DeviceTimer:
    """``with DeviceTimer(device) as t: …`` → ``t.seconds`` (device time on CUDA, from events;
    wall time elsewhere) and ``t.cpu_seconds`` (this process's CPU time, all threads)."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device_kind(device) == "cuda"
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __enter__(self) -> DeviceTimer:
        sync(self.device)
        self._cpu0 = time.process_time()
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1000
        else:
            sync(self.device)
            self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu0


class MemoryWindow:
    """Peak memory of the ``with`` block, in bytes.

    ``before``: allocated bytes (CUDA) or RSS (CPU) at entry; ``peak_allocated``: the peak since
    entry (CUDA: ``max_memory_allocated``; CPU: ``VmHWM``, the RSS high-water mark); ``peak_reserved``:
    ``max_memory_reserved`` on CUDA (the caching allocator's segments), None elsewhere. Both are
    the process's: every pipeline resident in it counts.
    """

    def __init__(self, device: str):
        self.device = device
        self.before = 0
        self.peak_allocated = 0
        self.peak_reserved: int | None = None

    def __enter__(self) -> MemoryWindow:
        if device_kind(self.device) == "cpu":
            trim_heap()
        sync(self.device)
        self.before = current_bytes(self.device)
        reset_peak(self.device)
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.peak_allocated = peak_bytes(self.device)
        mod = _accelerator(self.device)
        if mod is not None and hasattr(mod, "max_memory_reserved"):
            self.peak_reserved = int(mod.max_memory_reserved(self.device))

    @property
    def growth(self) -> int:
        """Bytes the block added on top of what was held at entry (never negative)."""
        return max(0, self.peak_allocated - self.before)


def gemm_size(dtype: torch.dtype, device: str = "cpu") -> int:
    """The GEMM size (M = N = K) of the rate probe in ``dtype`` on ``device``.

    On an accelerator, :data:`GEMM_SIZES` (8192 on CUDA, as the device notes measure the
    H100/H200 bf16 rate). On the CPU, the smallest power of two from 256 whose one call takes
    at least :data:`CPU_GEMM_CALL_S` seconds, capped at 2048 (so the probe stays seconds long
    where a dtype has no fast kernels, and fills the cores where it has).
    """
    kind = device_kind(device)
    cap = GEMM_SIZES.get(kind, GEMM_SIZES["cpu"])
    if kind != "cpu":
        return cap
    n = 256
    while n < cap:
        a = torch.randn(n, n).to(dtype)
        torch.mm(a, a)  # the first call of a size pays for packing and thread start-up
        start = time.perf_counter()
        torch.mm(a, a)
        if time.perf_counter() - start >= CPU_GEMM_CALL_S:
            break
        n *= 2
    return n


def matmul_flops_per_s(dtype: torch.dtype, device: str = "cpu", n: int | None = None, reps: int = 5,
                       warmup: int = 1) -> float:
    """Median FLOP/s of ``torch.mm`` on two random n×n matrices (2·n³ FLOPs per call) in ``dtype``.

    ``n`` defaults to :func:`gemm_size` (8192 on CUDA; at most 2048 on the CPU, every core).
    Random data, never zeros (zeros run faster on some GPUs). Each call is timed alone (events on
    CUDA).
    """
    n = n or gemm_size(dtype, device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(warmup):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        with DeviceTimer(device) as t:
            torch.mm(a, b)
        times.append(t.seconds)
    del a, b
    return 2 * n**3 / statistics.median(times)


GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gemm_sizes(device: str) -> dict[str, int]:
    """:func:`gemm_size` of each dtype of :func:`gemm_rates`, by dtype name."""
    return {name: gemm_size(dtype, device) for name, dtype in GEMM_DTYPES.items()}


def gemm_rates(device: str, sizes: dict[str, int] | None = None) -> dict[str, float]:
    """FLOP/s of dense ``float32`` and ``bfloat16`` GEMMs on ``device`` (see :func:`matmul_flops_per_s`),
    at ``sizes`` by dtype name (default: :func:`gemm_sizes`)."""
    sizes = sizes or gemm_sizes(device)
    reps, warmup = (10, 3) if device_kind(device) == "cuda" else (5, 1)
    return {name: matmul_flops_per_s(dtype, device, n=sizes[name], reps=reps, warmup=warmup)
            for name, dtype in GEMM_DTYPES.items()}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (peak 255); inf when identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def _storages(t: torch.Tensor):
    """(key, bytes) of the storages under ``t``; a tensor subclass (torchao's float8 or
    quantized weights) is opened into its inner tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
        return
    try:
        storage = t.untyped_storage()
        yield (storage.data_ptr(), str(t.device)), storage.nbytes()
    except (NotImplementedError, RuntimeError):  # a wrapper without storage: count its elements
        yield (id(t), str(t.device)), t.numel() * t.element_size()


def weights_bytes(pipe) -> int:
    """Bytes of every parameter and buffer of the pipeline's modules (shared storages once)."""
    seen, total = set(), 0
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                for key, nbytes in _storages(t):
                    if key not in seen:
                        seen.add(key)
                        total += nbytes
    return total


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (runnable processes; compare with ``nproc``)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_busy_s() -> float | None:
    """CPU seconds all cores of this machine have been busy since boot (Linux ``/proc/stat``: every
    state but idle and iowait), for the CPU an interval cost the whole machine, whichever process
    spent it; None where there is no ``/proc/stat``."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_until_gone(marker: str, timeout_s: float = 120.0, poll_s: float = 0.2) -> bool:
    """Wait until no process of this machine has ``marker`` (``"NAME=value"``) among its environment
    variables (Linux ``/proc/<pid>/environ``; processes that may not be read are not seen). A process
    and every child it starts inherit their environment, so a variable set only for one spawned
    process marks it and whatever it left running (an orphaned compiler, say). Returns True once
    none is left, False after ``timeout_s`` seconds or where there is no ``/proc``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    needle = marker.encode() + b"\0"
    deadline = time.monotonic() + timeout_s
    while True:
        left = False
        for environ in proc.glob("[0-9]*/environ"):
            try:
                data = environ.read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if data.startswith(needle) or b"\0" + needle in data:
                left = True
                break
        if not left:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def mib(value: int | None) -> float | None:
    """Bytes → MiB, one decimal; None stays None."""
    return None if value is None else round(value / MIB, 1)


@dataclass(frozen=True)
class Summary:
    """Mean, median and best of per-image seconds, rounded to 4 decimals."""

    mean: float
    median: float
    best: float

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(round(statistics.fmean(values), 4), round(statistics.median(values), 4), round(min(values), 4))


def machine_facts(profile, gemm: dict[str, list[float]] | None = None,
                  sizes: dict[str, int] | None = None) -> dict:
    """The machine and software a result came from, for its JSON (GEMM rates in FLOP/s, measured
    at ``sizes``: M = N = K by dtype name; ``gemm_size`` is the largest)."""
    import importlib.metadata as md

    versions: dict[str, str | None] = {}
    for package in ("diffusers", "transformers", "accelerate", "triton", "sdnq", "torchao", "flash-attn"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    facts = {
        "device": profile.to_dict(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "packages": versions,
        "threads": torch.get_num_threads(), "nproc": os.cpu_count(), "load_average": load_average(),
        "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
    }
    if profile.kind == "cuda":
        facts["cudnn"] = torch.backends.cudnn.version()
    if sizes:
        facts["gemm_sizes"], facts["gemm_size"] = sizes, max(sizes.values())
    if gemm:
        facts["gemm_flops_per_s"] = {k: round(statistics.median(v)) for k, v in gemm.items() if v}
        facts["gemm_flops_per_s_rounds"] = {k: [round(x) for x in v] for k, v in gemm.items()}
    return facts


def machine_caption(result: dict) -> str:
    """A table caption naming where a bench result ran: the CPU (model name, widest ISA, cores)
    from ``result["machine"]["cpu"]`` (:func:`pipeline.device.cpu_summary`), else the device's
    name or kind, and the load average before → after when the result has it."""
    m, device = result.get("machine", {}), result["device"]
    where = (f"{m['cpu']['name']} ({m['cpu']['isa']}), {m['cpu']['cores']} cores" if m.get("cpu")
             else device.get("name") or device.get("kind", ""))
    if m.get("load_average_before"):
        where += f"; load average {m['load_average_before'][0]} → {m['load_average_after'][0]}"
    return where
