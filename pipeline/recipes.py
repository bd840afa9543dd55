"""Recipes: the optimizations a device profile gets, as data.

Place in the data flow: worker → :func:`pipeline.device.probe` → :func:`select_recipe` (this
module) → :func:`pipeline.optimize.apply_recipe` on the warm pipeline. The recipe in force is
reported by the worker's heartbeat (``GET /v1/workers``) through :meth:`Recipe.to_dict`.

Three tables, read top to bottom:

* :data:`OPTIMIZATIONS` marks every knob (and the techniques that are not knobs) ``exact`` (same
  math up to float rounding) or ``approximate`` (changes the picture), with its source.
* :data:`RECIPES` holds one recipe per device class, approximations included.
* :data:`RECIPE_TABLE` maps a profile to a device class; first match wins.

Approximate knobs are only turned on when the pool allows them (``allow_approximate``), and an
override that turns one on without that permission is an error, never a silent change.

Memory thresholds are decimal GB (10**9 bytes), as GPUs are sold: an "A100 40GB" reports about
42e9 bytes (39.6 GiB). Sources are the seed documents: seed 000 (ERNIE-ViLG 2.0 / PaddlePaddle: Flash
Attention, norm fusion, mixed layout, scheduler precompute), seed 001 (Rapid Diffusion:
FlashAttention + compiler), seed 002 (SDNQ uint4 model card: quantized matmul, allocator
pitfall), seed 003 (diffusers "Speed up inference": fp16, distilled model, tiny autoencoder).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, NamedTuple

import torch

from pipeline.device import GB, DeviceProfile

DTYPES = ("float32", "float16", "bfloat16")
ATTENTION = ("default", "sdpa", "flash_attn", "sliced")  # default = as diffusers loaded it
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
QUANTIZATION = (None, "torchao_int8", "sdnq_uint4")
OVERRIDES_ENV = "RENDERFARM_RECIPE_OVERRIDES"


class Optimization(NamedTuple):
    exactness: str  # "exact" | "approximate"
    source: str
    knob: bool = True  # a Recipe field; False for techniques applied elsewhere


_EXACT, _APPROX = "exact", "approximate"
OPTIMIZATIONS: dict[str, Optimization] = {
    "dtype": Optimization(_APPROX, "seed 003: diffusers 'Speed up inference' (half-precision weights)"),
    "attention": Optimization(_EXACT, "seed 000 (Flash Attention), seed 001 (FlashAttention, Dao et al. 2022); "
                                      "PyTorch SDPA; diffusers sliced attention"),
    "channels_last": Optimization(_EXACT, "seed 000: mixed layout computation (removes transposes)"),
    "fuse_qkv": Optimization(_EXACT, "seed 000: operator fusion; diffusers fuse_qkv_projections"),
    "compile_unet": Optimization(_EXACT, "seed 000: norm/operator fusion; seed 001: BladeDISC; here torch.compile"),
    "compile_vae": Optimization(_EXACT, "as compile_unet, for the VAE decoder"),
    "compile_mode": Optimization(_EXACT, "torch.compile modes"),
    "vae_tiling": Optimization(_APPROX, "diffusers 'Reduce memory usage': tiles are blended, pixels change "
                                        "above the tile size (512 px for SD)"),
    "vae_slicing": Optimization(_EXACT, "diffusers 'Reduce memory usage': decodes one image at a time"),
    "cpu_offload": Optimization(_EXACT, "diffusers enable_model_cpu_offload (moves whole models, same math)"),
    "quantization": Optimization(_APPROX, "seed 002: SDNQ uint4 model card (quantized matmul); torchao int8 "
                                          "weight-only"),
    "tiny_vae": Optimization(_APPROX, "seed 003: tiny autoencoder (TAESD)"),
    "max_batch_size": Optimization(_EXACT, "batching (same math per image, up to kernel rounding)"),
    "num_threads": Optimization(_EXACT, "torch.set_num_threads"),
    "memory_fraction": Optimization(_EXACT, "sizes batches only (pipeline.memory)"),
    "scheduler_precompute": Optimization(_EXACT, "seed 000: precomputed scheduler parameters, no host-device "
                                                 "sync in the loop; pipeline/scheduling.py"),
    # Techniques that are not recipe knobs:
    "norm_fusion": Optimization(_EXACT, "seed 000: LayerNorm/GroupNorm fusion; Inductor does it under "
                                        "compile_unet", knob=False),
    "feature_cache": Optimization(_APPROX, "DeepCache (Ma et al., CVPR 2024); not applied by this build",
                                  knob=False),
    "fewer_steps": Optimization(_APPROX, "seed 003: distilled models; seed 002: 8-step Turbo; a request's or "
                                         "model spec's num_inference_steps, never changed by a recipe",
                                knob=False),
}
_CHOICES: dict[str, tuple] = {"dtype": DTYPES, "attention": ATTENTION, "compile_mode": COMPILE_MODES,
                              "quantization": QUANTIZATION}
_BOOLS = ("channels_last", "fuse_qkv", "compile_unet", "compile_vae", "vae_tiling", "vae_slicing", "cpu_offload",
          "scheduler_precompute")


@dataclass(frozen=True)
class Recipe:
    """What :func:`pipeline.optimize.apply_recipe` does to a pipeline. Defaults = diffusers defaults."""

    name: str = "baseline"
    dtype: str = "float32"
    attention: str = "default"
    channels_last: bool = False
    fuse_qkv: bool = False
    compile_unet: bool = False
    compile_vae: bool = False  # compiles the VAE decoder only
    compile_mode: str = "default"
    vae_tiling: bool = False
    vae_slicing: bool = False
    cpu_offload: bool = False
    scheduler_precompute: bool = False  # pipeline/scheduling.py twins (bit-identical on the CPU)
    quantization: str | None = None
    tiny_vae: str | None = None  # hub id or local directory of an AutoencoderTiny
    max_batch_size: int = 1  # images per denoiser call, an upper bound for pipeline.memory
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    memory_fraction: float = 0.8  # batch peak must stay under this fraction of device memory
    overridden: tuple[str, ...] = field(default=(), compare=False)  # knobs set by configuration

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"recipe field {name}={getattr(self, name)!r}; expected one of {choices}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"recipe field {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) \
                or self.max_batch_size < 1:
            raise ValueError(f"recipe field max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads < 0:
            raise ValueError(f"recipe field num_threads must be an integer >= 0, got {self.num_threads!r}")
        if not isinstance(self.memory_fraction, (int, float)) or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"recipe field memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.tiny_vae is not None and not (isinstance(self.tiny_vae, str) and self.tiny_vae):
            raise ValueError(f"recipe field tiny_vae must be a hub id, a path or null, got {self.tiny_vae!r}")

    def approximations(self) -> list[str]:
        """The approximate knobs in force (set away from the diffusers default)."""
        return [k for k in _knobs() if OPTIMIZATIONS[k].exactness == _APPROX and getattr(self, k) != _DEFAULTS[k]]

    def without_approximations(self) -> Recipe:
        """This recipe with every approximate knob back at its exact default."""
        return replace(self, **{k: _DEFAULTS[k] for k in self.approximations()})

    def to_dict(self) -> dict:
        """JSON-able form, with the approximations in force, for reports and ``GET /v1/workers``."""
        d = asdict(self)
        d["overridden"] = list(self.overridden)
        d["approximations"] = self.approximations()
        return d


def _knobs() -> list[str]:
    return [f.name for f in fields(Recipe) if f.name not in ("name", "overridden")]


_DEFAULTS = {f.name: f.default for f in fields(Recipe)}
BASELINE = Recipe()

#: One recipe per device class, approximations included (the ``fast`` flavour).
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("cuda-large", dtype="bfloat16", attention="flash_attn", channels_last=True, fuse_qkv=True,
           compile_unet=True, compile_vae=True, compile_mode="max-autotune", max_batch_size=16,
           memory_fraction=0.9, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
    Recipe("cuda-mid", dtype="float16", attention="sdpa", channels_last=True, fuse_qkv=True,
           compile_unet=True, compile_vae=True, compile_mode="max-autotune", max_batch_size=8,
           memory_fraction=0.9, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
    # Fused QKV keeps the unfused weights too, so it is off where memory is short.
    Recipe("cuda-small", dtype="float16", attention="sdpa", channels_last=True, vae_tiling=True,
           vae_slicing=True, cpu_offload=True, quantization="torchao_int8", max_batch_size=2,
           memory_fraction=0.85, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
    Recipe("accelerator", dtype="float16", attention="sdpa", vae_slicing=True, max_batch_size=4,
           memory_fraction=0.85, scheduler_precompute=True),  # xpu / npu (seed 003 measured fp16 on Ascend 910B)
    Recipe("mps", dtype="float16", attention="sdpa", fuse_qkv=True, vae_slicing=True, max_batch_size=4,
           memory_fraction=0.7, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
    # CPU: torch.compile is opt-in (override compile_unet/compile_vae). Inductor took 66 s to
    # compile even the tiny model on 2 cores, and again for each new batch shape; it then ran
    # that model 2.2x faster. Worth it for a long-lived worker, not for every cold start.
    # No channels_last on the CPU: with the batch-invariant kernels (pipeline.invariance: oneDNN
    # convolutions, NCHW group norms) it only adds layout copies. Measured on the sd15-arch UNet,
    # batch 8 at 32x32 latents, float32, 1 thread, CPU s per call, median of 3 interleaved:
    # NCHW 15.3, channels_last 17.6 (+15 %); fused QKV then saves ~6 %.
    Recipe("cpu-amx", dtype="bfloat16", attention="sdpa", fuse_qkv=True,
           max_batch_size=4, memory_fraction=0.7, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
    Recipe("cpu", attention="sdpa", fuse_qkv=True, max_batch_size=4,
           memory_fraction=0.7, tiny_vae="madebyollin/taesd", scheduler_precompute=True),
)}


@dataclass(frozen=True)
class Rule:
    """A predicate on a DeviceProfile, as data. Memory bounds in decimal GB: min inclusive, max exclusive."""

    kind: str
    recipe: str
    min_memory_gb: float = 0.0
    max_memory_gb: float = float("inf")
    min_compute_capability: tuple[int, int] | None = None
    needs_amx: bool = False

    def matches(self, p: DeviceProfile) -> bool:
        gb = p.total_memory_bytes / GB
        return (p.kind == self.kind and self.min_memory_gb <= gb < self.max_memory_gb
                and (self.min_compute_capability is None
                     or (p.compute_capability or (0, 0)) >= self.min_compute_capability)
                and (p.amx or not self.needs_amx))


RECIPE_TABLE: list[Rule] = [
    Rule("cuda", "cuda-large", min_memory_gb=40, min_compute_capability=(8, 0)),  # bf16 needs sm80+
    Rule("cuda", "cuda-mid", min_memory_gb=12),
    Rule("cuda", "cuda-small"),
    Rule("xpu", "accelerator"),
    Rule("npu", "accelerator"),
    Rule("mps", "mps"),
    Rule("cpu", "cpu-amx", needs_amx=True),
    Rule("cpu", "cpu"),
]


def device_class(profile: DeviceProfile) -> str:
    """The name in :data:`RECIPES` of the first :data:`RECIPE_TABLE` rule the profile matches."""
    for rule in RECIPE_TABLE:
        if rule.matches(profile):
            return rule.recipe
    raise LookupError(f"no recipe rule matches {profile!r}")


def recipe_for(profile: DeviceProfile, name: str = "exact") -> Recipe:
    """A named recipe fitted to ``profile``: ``baseline``, ``exact``, ``fast``, or a :data:`RECIPES` key.

    ``exact`` is the device-class recipe without approximations, ``fast`` keeps them; the
    bench's ``--recipes baseline,exact,fast`` uses these names.
    """
    if name == "baseline":
        return BASELINE
    base = name if name in RECIPES else device_class(profile) if name in ("exact", "fast") else None
    if base is None:
        raise ValueError(f"unknown recipe {name!r}; expected baseline, exact, fast or one of {sorted(RECIPES)}")
    r = _fit(RECIPES[base], profile)
    if name == "exact":
        return replace(r.without_approximations(), name=f"{base}/exact")
    return replace(r, name=f"{base}/fast") if name == "fast" else r


def _fit(r: Recipe, p: DeviceProfile) -> Recipe:
    """Resolve what depends on the probe: flash-attn presence, SDPA presence, CPU thread count."""
    attention = r.attention
    if attention == "flash_attn" and not p.flash_attn_available:
        attention = "sdpa"
    if attention == "sdpa" and not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        attention = "sliced"
    threads = p.cpu_cores if r.num_threads == 0 and p.kind == "cpu" else r.num_threads
    return replace(r, attention=attention, num_threads=threads)


def select_recipe(profile: DeviceProfile, allow_approximate: bool = False,
                  overrides: Mapping[str, Any] | str | None = None) -> Recipe:
    """The recipe for ``profile``: ``fast`` if the pool allows approximations, else ``exact``,
    then ``overrides`` (a dict or a JSON object; see :func:`overrides_from_env`)."""
    recipe = recipe_for(profile, "fast" if allow_approximate else "exact")
    return apply_overrides(recipe, overrides, allow_approximate) if overrides else recipe


def apply_overrides(recipe: Recipe, overrides: Mapping[str, Any] | str | None,
                    allow_approximate: bool = False) -> Recipe:
    """``recipe`` with configured knob values. Unknown fields and bad values raise ValueError; so
    does turning on an approximate knob when ``allow_approximate`` is false."""
    if isinstance(overrides, str):
        overrides = json.loads(overrides) if overrides.strip() else {}
    if not overrides:
        return recipe
    if not isinstance(overrides, Mapping):
        raise ValueError(f"recipe overrides must be a JSON object, got {type(overrides).__name__}")
    knobs = _knobs()
    unknown = sorted(k for k in overrides if k not in knobs)
    if unknown:
        raise ValueError(f"unknown recipe field(s) in overrides: {', '.join(unknown)}; "
                         f"overridable: {', '.join(knobs)}")
    new = replace(recipe, **overrides, overridden=tuple(sorted(set(recipe.overridden) | set(overrides))))
    if not allow_approximate:
        turned_on = [k for k in new.approximations() if k in overrides]
        if turned_on:
            raise ValueError(f"override(s) {', '.join(turned_on)} are approximate "
                             "(see recipes.OPTIMIZATIONS); allow approximate recipes for this pool first")
    return new


def overrides_from_env(environ: Mapping[str, str] = os.environ) -> dict:
    """The JSON object in ``RENDERFARM_RECIPE_OVERRIDES`` (empty dict when unset)."""
    text = environ.get(OVERRIDES_ENV, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OVERRIDES_ENV} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{OVERRIDES_ENV} must be a JSON object, got {type(value).__name__}")
    return value
