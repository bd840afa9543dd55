"""``renderfarm bench ready``: a worker's time to ready, cold and with the compile cache.

Place in the data flow: beside the pipeline. Two fresh processes do what ``renderfarm worker``
does between its start and its first job, without Redis or S3 (:mod:`pipeline.ready` with file
storage): load the pipeline with the recipe (compile on), restore, warm up every (bucket ×
size) of the plan, save.

1. **cold**: an empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR`` in a temporary
   directory) and an empty ``TMPDIR``, no artifact: everything compiles; the artifact is
   exported to a file.
2. **cached**: another empty Inductor cache directory and ``TMPDIR``, as on a new replica; the
   artifact file is loaded before the warm-up (PyTorch recipe "Compile Time Caching in
   ``torch.compile``").

Where the recipe runs the UNet in OpenVINO, the cold phase also saves the converted UNet (IR) to
a directory beside the artifact and the cached phase reads it instead of tracing
(:mod:`pipeline.optimize.openvino_ir`): the worker does the same through the farm's bucket.

"Ready" is the wall time from the process's spawn to the end of its warm-up: interpreter and
imports, load, restore, warm-up. "Quiet" is the wall time from the spawn until the phase's last
process has exited (the phase and anything it left running, such as a compiler warm-up child,
found by the phase's own ``TMPDIR`` in their environment), and "machine CPU" the CPU seconds the
whole machine was busy over that time (``/proc/stat``; on a quiet machine, the phase's own cost):
what a start costs the other work of a small replica. Each phase also reports Inductor's FX graph
cache hits and misses and the AOTInductor packages it loaded and compiled
(:mod:`pipeline.optimize.aot`): the cached phase should compile nothing. The target is cached
≤ 25 % of cold.

With ``--controls`` the pool declares ControlNets (``NAME`` or ``NAME=SOURCE``; a name alone is the
offline ``tiny-controlnet-NAME``): the recipe keeps the UNet in PyTorch, as a worker's does
(``pipeline.recipes.CONTROLNETS_VS_OPENVINO``), and the warm-up renders each ControlNet alone at
every bucket × size after the plain renders (:mod:`pipeline.warm_controls`), so that the UNet's
graphs with ControlNet residuals are compiled (cold) or restored (cached) too. The baseline to
compare it with is the same command without ``--controls`` and with ``"backend": "torch"`` in the
overrides (the same compiled UNet, no unit set).

With ``--size-batch`` each phase also sizes the batch as a worker does (:mod:`pipeline.sizing`):
the cold phase measures peak memory at the largest size and keeps the record in a file, the
cached phase reads it; the warm-up then covers the buckets of that batch size. Each phase
reports the seconds of the worker's start-up states: load, sizing, warm-up.

``python -m bench.pipeline.time_to_ready PHASE CONFIG_JSON ARTIFACT OUT`` is one phase (the parent runs it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_OVERRIDES = {"compile_denoiser": True, "compile_vae": True, "batch_invariant": False}


@dataclass(frozen=True)
class ReadyConfig:
    """One time-to-ready measurement. Sizes are (width, height) pixels; ``overrides`` are recipe
    knobs on top of ``recipe`` (by default compile on, batch invariance off: the invariant CPU
    kernels do not compile); ``timeout_s`` bounds each phase, seconds. ``size_batch``: size the
    batch as a worker does (:func:`pipeline.sizing.size_batch` at the largest of ``sizes``; the
    cold phase measures and keeps the record in a file, the cached phase reads it) and warm up the
    buckets of that batch size instead of ``buckets``. ``controls``: ControlNets the pool declares
    (``NAME`` or ``NAME=SOURCE``; the module docstring)."""

    model: str = "tiny"
    device: str = "auto"
    recipe: str = "exact"
    buckets: tuple[int, ...] = (1, 2)
    sizes: tuple[tuple[int, int], ...] = ((64, 64),)
    steps: int = 1
    guidance_scale: float = 7.5
    overrides: str = json.dumps(DEFAULT_OVERRIDES)
    timeout_s: float = 3600.0
    size_batch: bool = False
    controls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be integers >= 1, got {self.buckets}")
        if not self.sizes or any(w < 8 or h < 8 for w, h in self.sizes):
            raise ValueError(f"sizes must be WIDTHxHEIGHT of at least 8 pixels, got {self.sizes}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        try:
            json.loads(self.overrides or "{}")
        except ValueError as exc:
            raise ValueError(f"overrides is not JSON: {exc}") from None
        from infra.controls import CONTROL_NAME_RE

        bad = [name for name in self.control_sources if not CONTROL_NAME_RE.fullmatch(name)]
        if bad:
            raise ValueError(f"controls must be NAME or NAME=SOURCE with NAME of A-Z a-z 0-9 . _ -, got {bad}")

    @property
    def control_sources(self) -> dict[str, str]:
        """ControlNet name → source of ``controls`` (a name alone: ``tiny-controlnet-<name>``)."""
        pairs = (item.partition("=") for item in self.controls)
        return {name: source or f"tiny-controlnet-{name}" for name, _, source in pairs}


def run_phase(phase: str, config: ReadyConfig, artifact: Path, spawned_at: float) -> dict:
    """One phase in this process (see the module docstring); returns its measurements (seconds)."""
    imported = time.time()
    from pipeline.buckets import bucket_sizes
    from pipeline.compile_cache import compile_counters
    from pipeline.device import cpu_summary
    from pipeline.optimize.openvino_ir import DirectoryIRStore
    from pipeline.pool_options import PoolOptions
    from pipeline.ready import get_ready
    from pipeline.warm import WarmPlan, prepare_renderer
    from pipeline.warm_controls import warm_control_sets

    started = time.perf_counter()
    ir_store = DirectoryIRStore(artifact.parent / "openvino-ir", read=phase == "cached", write=phase == "cold")
    pool = PoolOptions(controlnets=bool(config.controls)) if config.controls else None
    renderer, profile = prepare_renderer(config.model, config.device, config.recipe, config.overrides, pool=pool,
                                         ir_store=ir_store)
    if config.controls:
        from infra.settings import get_settings
        from pipeline.controlnet import ControlNets

        renderer.controlnets = ControlNets(renderer.pipe, config.control_sources, cache_dir=get_settings().cache_dir,
                                           prepare=renderer.prepare_controlnet)
    loaded = time.perf_counter()
    sizing = _size(phase, config, renderer, profile, artifact.parent / "sizing") if config.size_batch else None
    sized = time.perf_counter()
    buckets = bucket_sizes(sizing["batch_size"]) if sizing else tuple(sorted(config.buckets))
    plan = WarmPlan(buckets, tuple(config.sizes), config.steps, config.guidance_scale,
                    control_sets=warm_control_sets(renderer, pool))

    def fetch(_key):
        return artifact.read_bytes() if phase == "cached" else None

    def store(_key, blob: bytes) -> None:
        if phase == "cold":
            artifact.write_bytes(blob)

    ready = get_ready(renderer, profile, plan, fetch=fetch, store=store)
    done = time.time()
    applied = (renderer.recipe.get("report") or {}).get("applied", {})
    return {"phase": phase, "ready_s": done - spawned_at, "import_s": imported - spawned_at,
            "load_s": loaded - started, "sizing_s": sized - loaded if sizing else None, "sizing": sizing,
            "buckets": list(buckets), "control_sets": [list(c) for c in plan.control_sets],
            "restore_s": (ready["compile_cache"] or {}).get("seconds", 0.0),
            "warm_up_s": ready["warm_up"].get("seconds"), "renders": ready["warm_up"].get("renders"),
            "shapes": ready["warm_up"].get("shapes"),
            "compile_cache": ready["compile_cache"], "counters": compile_counters(),
            "compiles": ready["warm_up"].get("compiles"),
            "recipe": renderer.recipe.get("name"),
            "openvino_ir": (applied.get("backend") or {}).get("ir"),
            "openvino_vae_ir": (applied.get("vae_backend") or {}).get("ir"), "compiled": applied.get("compile"),
            "device": profile,
            "cpu": cpu_summary() if profile.get("kind") == "cpu" else None}


def _size(phase: str, config: ReadyConfig, renderer, profile: dict, folder: Path) -> dict:
    """:func:`pipeline.sizing.size_batch` at ``config.sizes`` with the record in ``folder`` (the
    cold phase writes it, the cached phase reads it)."""
    from pipeline.pool_options import PoolOptions
    from pipeline.sizing import record_name, size_batch

    def fetch(key):
        path = folder / record_name(key)
        return path.read_bytes() if phase == "cached" and path.exists() else None

    def store(key, blob: bytes) -> None:
        if phase == "cold":
            folder.mkdir(parents=True, exist_ok=True)
            (folder / record_name(key)).write_bytes(blob)

    pool = PoolOptions(sizes=tuple(config.sizes), guidance_scale=config.guidance_scale)
    return size_batch(renderer, profile, pool, fetch=fetch, store=store)


def _spawn(phase: str, config: ReadyConfig, artifact: Path, out: Path, cache_dir: Path) -> dict:
    # A temporary directory of its own too (TMPDIR), as a new replica's emptyDir /tmp: Inductor
    # keeps its precompiled C++ headers under the default temporary directory, whatever
    # TORCHINDUCTOR_CACHE_DIR says, so a shared /tmp would hand the cold phase's to the cached one.
    scratch = cache_dir.with_name(f"tmp-{phase}")
    scratch.mkdir(parents=True, exist_ok=True)
    from bench.pipeline.instruments import machine_busy_s, wait_until_gone

    spawned, busy = time.time(), machine_busy_s()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TMPDIR": str(scratch),
           "RENDERFARM_BENCH_SPAWNED_AT": repr(spawned)}
    proc = subprocess.run([sys.executable, "-m", "bench.pipeline.time_to_ready", phase, json.dumps(asdict(config)),
                           str(artifact), str(out)], env=env, capture_output=True, text=True,
                          timeout=config.timeout_s)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"bench ready: the {phase} phase exited {proc.returncode}:\n{tail}")
    # what the phase left running finishes (or is given up on) before the next phase starts
    quiet = wait_until_gone(f"TMPDIR={scratch}", timeout_s=min(300.0, config.timeout_s))
    busy_after = machine_busy_s()
    return {**json.loads(out.read_text()), "quiet_s": time.time() - spawned if quiet else None,
            "machine_cpu_s": busy_after - busy if busy is not None and busy_after is not None else None}


def run_ready_bench(config: ReadyConfig, log: Callable[[str], None] = print, keep_in: Path | None = None) -> dict:
    """Run the cold phase, then the cached phase, each in a fresh process; returns
    ``{"config", "cold", "cached", "ratio", "artifact_bytes", "artifact_sha256", "load_average"}``
    (ratio = cached ready seconds / cold ready seconds; ``load_average`` before and after,
    /proc/loadavg). Each phase's dict has ``ready_s``, ``quiet_s`` (None: something it started
    still ran after 300 s or there is no ``/proc``) and ``machine_cpu_s`` (None without
    ``/proc/stat``), seconds. ``keep_in``: a folder the compile-cache artifact is copied into
    (``<model>-b<buckets>-<W>x<H>.compile-cache``; ``artifact_kept`` names it), for a later run
    or a reviewer; by default it is deleted with the phases' temporary folder.

    Raises:
        RuntimeError: a phase failed (the message has the tail of its output).
        subprocess.TimeoutExpired: a phase ran past ``config.timeout_s``.
    """
    from bench.pipeline.instruments import load_average

    before = load_average()
    with tempfile.TemporaryDirectory(prefix="renderfarm-bench-ready-") as tmp:
        root = Path(tmp)
        artifact = root / "artifact.bin"
        log(f"cold: {config.model}, buckets {config.buckets}, sizes {config.sizes}, empty Inductor cache")
        cold = _spawn("cold", config, artifact, root / "cold.json", root / "inductor-cold")
        converted = cold.get("openvino_ir") or cold.get("openvino_vae_ir")
        if not artifact.exists() and not converted and not config.size_batch:
            raise RuntimeError("bench ready: the cold phase saved no artifact and converted nothing to OpenVINO "
                               f"(did the recipe compile anything? compile: {cold.get('compiled')})")
        size = artifact.stat().st_size if artifact.exists() else 0
        kept = _keep(artifact, config, keep_in)
        log(f"cold ready in {cold['ready_s']:.1f}s; artifact {size / 2**20:.1f} MiB; cached: another empty cache")
        cached = _spawn("cached", config, artifact, root / "cached.json", root / "inductor-cached")
    return {"config": asdict(config), "cold": cold, "cached": cached, "artifact_bytes": size, **kept,
            "ratio": cached["ready_s"] / cold["ready_s"] if cold["ready_s"] else None,
            "load_average": {"before": before, "after": load_average()}}


def _keep(artifact: Path, config: ReadyConfig, folder: Path | None) -> dict:
    """Copy the artifact into ``folder`` when given; ``{"artifact_sha256", "artifact_kept"}``."""
    if not artifact.exists():
        return {"artifact_sha256": None, "artifact_kept": None}
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    if folder is None:
        return {"artifact_sha256": digest, "artifact_kept": None}
    folder.mkdir(parents=True, exist_ok=True)
    sizes = "-".join(f"{w}x{h}" for w, h in config.sizes)
    name = f"{config.model}-b{'-'.join(map(str, config.buckets))}-{sizes}.compile-cache"
    shutil.copyfile(artifact, folder / name)
    return {"artifact_sha256": digest, "artifact_kept": name}


def served(counters: dict) -> int:
    """Graphs a phase took from the cache: FX graph cache hits plus AOTInductor packages loaded."""
    return int(counters["fxgraph_cache_hit"]) + int(counters.get("aot_loaded", 0))


def ready_table(result: dict):
    """The result as one rich table: model, device/CPU, recipe, buckets, sizes, steps, ControlNet
    unit sets warmed, cold s, cached s, ratio, the seconds of each start-up state (load, sizing,
    warm-up) cold and cached, compiles (:func:`pipeline.compile_cache.compiled_anew`) and cache
    hits (:func:`served`) in each phase."""
    from rich.table import Table

    from pipeline.compile_cache import compiled_anew

    cold, cached, config = result["cold"], result["cached"], result["config"]
    cpu = cold.get("cpu")
    device = f"{cpu['name']} ({cpu['isa']}, {cpu['cores']} cores)" if cpu else cold["device"].get("name", "")
    load = result.get("load_average") or {}
    table = Table(title=f"time to ready (spawn → warm-up done), load average {load.get('before')} → "
                        f"{load.get('after')}; artifact {result['artifact_bytes'] / 2**20:.1f} MiB")
    for column in ("model", "device", "recipe", "buckets", "sizes", "steps", "unit sets", "cold s", "cached s", "ratio",
                   "load s cold / cached", "sizing s cold / cached", "warm-up s cold / cached",
                   "cached quiet s", "cached machine CPU s", "compiles cold", "compiles cached",
                   "cache hits cached", "outcome", "OpenVINO IR cached (UNet / decoder)"):
        table.add_column(column)
    ratio = result.get("ratio")

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def pair(key: str) -> str:
        return f"{seconds(cold.get(key))} / {seconds(cached.get(key))}"

    sizing = (cached.get("sizing") or {}).get("record")
    table.add_row(config["model"], device, str(cold.get("recipe")),
                  ",".join(map(str, cold.get("buckets") or config["buckets"])),
                  ",".join(f"{w}x{h}" for w, h in config["sizes"]), str(config["steps"]),
                  " ".join("+".join(units) for units in cold.get("control_sets") or ()) or "-",
                  f"{cold['ready_s']:.1f}", f"{cached['ready_s']:.1f}", f"{ratio:.1%}" if ratio else "-",
                  pair("load_s"), pair("sizing_s") + (f" (record {sizing})" if sizing else ""), pair("warm_up_s"),
                  seconds(cached.get("quiet_s")), seconds(cached.get("machine_cpu_s")),
                  str(compiled_anew(cold["counters"])), str(compiled_anew(cached["counters"])),
                  str(served(cached["counters"])), (cached.get("compile_cache") or {}).get("outcome", "-"),
                  " / ".join((cached.get(k) or {}).get("outcome", "-") for k in ("openvino_ir", "openvino_vae_ir")))
    return table


def _main(argv: list[str]) -> int:
    phase, config_json, artifact, out = argv
    raw = json.loads(config_json)
    config = ReadyConfig(**{**raw, "buckets": tuple(raw["buckets"]), "sizes": tuple(map(tuple, raw["sizes"])),
                            "controls": tuple(raw.get("controls", ()))})
    spawned_at = float(os.environ.get("RENDERFARM_BENCH_SPAWNED_AT") or time.time())
    result = run_phase(phase, config, Path(artifact), spawned_at)
    Path(out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
