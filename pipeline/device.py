"""Device probe: what one worker's accelerator is, as a :class:`DeviceProfile`.

Place in the data flow: the worker probes its device once at start-up; the profile goes to
:func:`pipeline.recipes.select_recipe` (profile → optimizations), to the batch sizing in
:mod:`pipeline.memory`, and, as JSON, into the worker's heartbeat (``GET /v1/workers``).

The probe only reads: it never allocates on the device beyond what initialising the backend
costs. Tests build profiles directly (``DeviceProfile(kind="cuda", ...)``) as fake probes.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import asdict, dataclass

import torch

KINDS = ("cuda", "mps", "xpu", "npu", "cpu")
GB = 10**9  # decimal GB, as GPU memory is sold and as pipeline.recipes thresholds read


@dataclass(frozen=True)
class DeviceProfile:
    """One device as the recipes see it. Memory in bytes; ``cpu_cores`` counts usable CPUs."""

    kind: str
    name: str = ""
    index: int = 0
    compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (8, 6)
    total_memory_bytes: int = 0
    free_memory_bytes: int = 0
    cpu_cores: int = 1
    avx512: bool = False  # /proc/cpuinfo flag avx512f
    amx: bool = False  # /proc/cpuinfo flags amx_tile and amx_bf16 (bf16 matmul tiles)
    avx512_bf16: bool = False  # /proc/cpuinfo flag avx512_bf16 (bf16 dot products without AMX, e.g. AMD Zen 4/5)
    flash_attn_available: bool = False  # the flash-attn package imports and the GPU is sm80+

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown device kind {self.kind!r}; expected one of {KINDS}")
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    @property
    def total_memory_gb(self) -> float:
        """Total memory in decimal GB (10**9 bytes)."""
        return self.total_memory_bytes / GB

    @property
    def torch_device(self) -> str:
        """The ``torch.device`` string, e.g. ``"cuda:0"`` or ``"cpu"``."""
        return self.kind if self.kind in ("cpu", "mps") else f"{self.kind}:{self.index}"

    def to_dict(self) -> dict:
        """JSON-able form (tuples become lists), for heartbeats and reports."""
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        d["total_memory_gb"] = round(self.total_memory_gb, 2)
        return d


def probe(device: str = "auto") -> DeviceProfile:
    """Probe ``device`` (``auto``, ``cpu``, ``cuda[:i]``, ``mps``, ``xpu[:i]``, ``npu[:i]``).

    ``auto`` prefers cuda, then xpu, npu, mps, and falls back to cpu.
    """
    kind, _, idx = device.partition(":")
    index = int(idx) if idx else 0
    if kind == "auto":
        kind = next((k for k in ("cuda", "xpu", "npu", "mps") if _backend_available(k)), "cpu")
    if kind not in KINDS:
        raise ValueError(f"unknown device {device!r}; expected auto or one of {KINDS}")
    if kind != "cpu" and not _backend_available(kind):
        raise RuntimeError(f"device {device!r} requested but torch reports no {kind} backend")
    cpu = _cpu_facts()
    if kind == "cuda":
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        cc = (props.major, props.minor)
        return DeviceProfile("cuda", props.name, index, cc, total, free,
                             flash_attn_available=cc >= (8, 0) and _flash_attn_importable(), **cpu)
    if kind in ("xpu", "npu"):
        mod = getattr(torch, kind)
        name = mod.get_device_name(index) if hasattr(mod, "get_device_name") else kind
        free, total = _mem_get_info(mod, index)
        return DeviceProfile(kind, name, index, None, total, free, **cpu)
    if kind == "mps":
        total = int(torch.mps.recommended_max_memory())  # Metal's working-set budget, bytes
        free = max(0, total - int(torch.mps.driver_allocated_memory()))
        return DeviceProfile("mps", "Apple MPS", 0, None, total, free, **cpu)
    total, free = _host_memory()
    return DeviceProfile("cpu", _cpu_name(), 0, None, total, free, **cpu)


def _backend_available(kind: str) -> bool:
    try:
        if kind == "mps":
            return bool(torch.backends.mps.is_available())
        if kind == "npu" and not hasattr(torch, "npu"):
            importlib.import_module("torch_npu")  # registers torch.npu (Ascend)
        mod = getattr(torch, kind, None)
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


def _mem_get_info(mod, index: int) -> tuple[int, int]:
    if hasattr(mod, "mem_get_info"):
        free, total = mod.mem_get_info(index)
        return int(free), int(total)
    total = int(mod.get_device_properties(index).total_memory)
    return total, total


def _flash_attn_importable() -> bool:
    """Whether the flash-attn package (Dao et al. 2022; cited by the ERNIE-ViLG 2.0 inference article
    and the Rapid Diffusion paper) imports."""
    try:
        from flash_attn import flash_attn_func  # noqa: F401
    except Exception:
        return False
    return True


def _cpu_facts() -> dict:
    flags = _cpuinfo_field("flags").split()
    return {
        "cpu_cores": usable_cpus(),
        "avx512": "avx512f" in flags,
        "amx": "amx_tile" in flags and "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
    }


def cpu_summary() -> dict:
    """This machine's CPU as a benchmark names it: ``{"name", "cores", "isa"}``.

    ``name`` is /proc/cpuinfo's model name; ``cores`` the CPUs this process may use;
    ``isa`` the widest matrix instructions the recipes choose by: ``"AMX"``,
    ``"AVX-512 + AVX512_BF16"``, ``"AVX-512"``, ``"AVX2"`` or ``"baseline"``.
    """
    flags = set(_cpuinfo_field("flags").split())
    facts = _cpu_facts()
    isa = ("AMX" if facts["amx"] else "AVX-512 + AVX512_BF16" if facts["avx512_bf16"] else
           "AVX-512" if facts["avx512"] else "AVX2" if "avx2" in flags else "baseline")
    return {"name": _cpu_name(), "cores": facts["cpu_cores"], "isa": isa}


def cpu_flags() -> list[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (``avx2``, ``avx512f``, ``amx_tile`` …);
    empty where there is no /proc/cpuinfo."""
    return _cpuinfo_field("flags").split()


def _cpuinfo_field(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    import platform

    return _cpuinfo_field("model name") or platform.processor() or "cpu"


def usable_cpus() -> int:
    """CPUs this process may use: the affinity mask, capped by a cgroup v2 ``cpu.max`` quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


def _host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes, capped by a cgroup v2 ``memory.max`` limit."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) * 1024  # kB → bytes
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = info.get("MemAvailable", total)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read())
            total, free = min(total, int(limit)), min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(total), int(free)
