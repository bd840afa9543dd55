"""Video recipes: what a video pipeline (Wan 2.1, LTX-Video) gets on each device, as data.

Place in the data flow: :func:`pipeline.video.prepare.prepare_video_renderer` → :func:`video_recipe`
(here, from the image recipe of the device class, :func:`pipeline.recipes.recipe_for`) →
:func:`pipeline.video.apply.apply_video_recipe` on the warm pipeline.

What is kept from the image recipe: the dtype (the family's reference dtype: bfloat16 on
accelerators per the Wan 2.1 and LTX-Video cards, float32 on the CPU), the compile knob
(``compile_denoiser``, applied here as regional compilation: diffusers' ``compile_repeated_blocks``
of the transformer's ``_repeated_blocks``), ``compile_mode`` and ``memory_fraction``. The rest is
this module's table (:data:`VIDEO_FITS`, :data:`VIDEO_DEVICE`):

- ``vae_slicing`` (exact; diffusers "Reduce memory usage") is always on: a video request renders
  alone, so it changes nothing at batch 1 and caps a larger batch's decode peak.
- ``vae_tiling`` (approximate: tiles are blended; diffusers "Reduce memory usage", the Wan and
  LTX VAEs' ``enable_tiling``) is on in ``fast`` recipes on accelerators with less memory than
  :attr:`VideoDevice.tiling_below_gb`.
- ``cpu_offload`` (exact; ``enable_model_cpu_offload``) when the family's weights do not fit
  ``memory_fraction`` of the accelerator's memory; it turns compile off.
- ``vae_float32``: the Wan 2.1 card loads ``AutoencoderKLWan`` in float32 beside a bfloat16 transformer.
- ``step_cache`` (approximate, off by default): diffusers' First Block Cache
  (``FirstBlockCacheConfig(threshold=…)``, diffusers "Caching methods"; ParaAttention's dynamic
  caching), on only when an override asks for it in a recipe that allows approximations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pipeline.device import GB, DeviceProfile
from pipeline.recipes import COMPILE_MODES, DTYPES, parse_overrides, recipe_for


@dataclass(frozen=True)
class VideoFit:
    """A video family's weights at its card dtype (decimal GB, all components, from the parameter
    counts of :mod:`pipeline.models.offline`'s ``-arch`` builds) and whether its VAE stays float32."""

    weights_gb: float
    vae_float32: bool = False


#: Wan 2.1 T2V 1.3B: transformer 1.42B + UMT5-XXL 5.68B in bfloat16, VAE 0.13B in float32 (14.7 GB).
#: LTX-Video 2B: transformer 1.92B + T5-XXL 4.76B + VAE 0.42B in bfloat16 (14.2 GB).
#: Wan 2.1 I2V 14B: transformer 16.39B + UMT5-XXL 5.68B + CLIP ViT-H/14 vision 0.63B in bfloat16, VAE 0.13B in
#: float32 (45.9 GB; the card loads the image encoder in float32 too, 1.3 GB more, here it follows the dtype).
VIDEO_FITS: dict[str, VideoFit] = {"wan": VideoFit(14.7, vae_float32=True), "ltx": VideoFit(14.2),
                                   "wan-i2v": VideoFit(45.9, vae_float32=True)}


@dataclass(frozen=True)
class VideoDevice:
    """Per device kind: below ``tiling_below_gb`` of memory a ``fast`` recipe tiles the VAE."""

    tiling_below_gb: float


VIDEO_DEVICE: dict[str, VideoDevice] = {"cuda": VideoDevice(48.0), "xpu": VideoDevice(48.0),
                                        "npu": VideoDevice(48.0), "mps": VideoDevice(1e9), "cpu": VideoDevice(0.0)}
#: Knobs an override may set, and which of them are approximate (need a recipe that allows them).
APPROXIMATE = ("vae_tiling", "step_cache")
DEFAULT_CACHE_THRESHOLD = 0.05  # FirstBlockCacheConfig's default
CHOICES = {"dtype": DTYPES, "vae_dtype": DTYPES, "compile_mode": COMPILE_MODES}


@dataclass(frozen=True)
class VideoRecipe:
    """What :func:`pipeline.video.apply.apply_video_recipe` does to a video pipeline.

    ``dtype``: the transformer's and text encoder's; ``vae_dtype`` the VAE's. ``step_cache_threshold``:
    First Block Cache's threshold (the absmean relative change of the first block's residual under
    which the other blocks are skipped; higher skips more). ``allow_approximate``: the pool allows
    approximations (``fast``); ``overridden``/``adjusted``: knobs set by configuration / changed
    by a rule, with why.
    """

    name: str
    family: str
    dtype: str = "float32"
    vae_dtype: str = "float32"
    vae_tiling: bool = False
    vae_slicing: bool = True
    cpu_offload: bool = False
    compile_regional: bool = False
    compile_mode: str = "default"
    step_cache: bool = False
    step_cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    memory_fraction: float = 0.8
    max_batch_size: int = 1
    allow_approximate: bool = False
    overridden: tuple[str, ...] = field(default=(), compare=False)
    adjusted: tuple[str, ...] = field(default=(), compare=False)

    def approximations(self) -> list[str]:
        """The approximate knobs in force (``vae_tiling``, ``step_cache``)."""
        return [k for k in APPROXIMATE if getattr(self, k)]

    def to_dict(self) -> dict:
        """JSON-able form for ``renderer.recipe`` and the heartbeat."""
        d = asdict(self)
        d["overridden"], d["adjusted"], d["approximations"] = list(self.overridden), list(self.adjusted), \
            self.approximations()
        return d


_KNOBS = tuple(f.name for f in fields(VideoRecipe) if f.name not in ("name", "family", "overridden", "adjusted",
                                                                         "allow_approximate", "max_batch_size"))


def video_recipe(profile: DeviceProfile, name: str, family: str, overrides: Mapping[str, Any] | str | None = None,
                 model: str = "") -> VideoRecipe:
    """The video recipe for ``profile``, recipe ``name`` (``exact``, ``fast``, ``baseline`` or a
    device class of :data:`pipeline.recipes.RECIPES`) and ``family`` (``wan``, ``wan-i2v`` or ``ltx``), with
    ``overrides`` (a dict or JSON object of :data:`_KNOBS`) applied.

    Raises:
        ValueError: unknown family, unknown recipe, an unknown or ill-typed override, or an
            approximate knob turned on by an override in a recipe without approximations.
    """
    if family not in VIDEO_FITS:
        raise ValueError(f"no video recipe for family {family!r}; video families: {', '.join(VIDEO_FITS)}")
    base = recipe_for(profile, name, family, model)
    fit, device = VIDEO_FITS[family], VIDEO_DEVICE.get(profile.kind, VideoDevice(0.0))
    allow = name not in ("exact", "baseline") and not base.name.endswith("/exact")
    dtype = base.reference_dtype  # float32 on the CPU (no bf16 approximation for video here)
    memory_gb = profile.total_memory_bytes / GB
    accelerator = profile.kind != "cpu" and memory_gb > 0
    offload = accelerator and fit.weights_gb > base.memory_fraction * memory_gb
    recipe = VideoRecipe(
        name=f"{base.name}/video", family=family, dtype=dtype,
        vae_dtype="float32" if fit.vae_float32 else dtype,
        vae_tiling=allow and accelerator and memory_gb < device.tiling_below_gb,
        cpu_offload=offload, compile_regional=base.compile_denoiser and not offload,
        compile_mode=base.compile_mode, memory_fraction=base.memory_fraction, allow_approximate=allow,
        adjusted=(f"cpu_offload: {fit.weights_gb} GB of weights over {base.memory_fraction:.2f} of "
                  f"{memory_gb:.0f} GB",) if offload else ())
    return apply_video_overrides(recipe, overrides)


def apply_video_overrides(recipe: VideoRecipe, overrides: Mapping[str, Any] | str | None) -> VideoRecipe:
    """``recipe`` with configured knob values (see :func:`video_recipe`'s errors)."""
    overrides = parse_overrides(overrides)
    if not overrides:
        return recipe
    unknown = sorted(k for k in overrides if k not in _KNOBS)
    if unknown:
        raise ValueError(f"unknown video recipe field(s) in overrides: {', '.join(unknown)}; "
                         f"overridable: {', '.join(_KNOBS)}")
    for k, v in overrides.items():
        default = getattr(recipe, k)
        if isinstance(default, bool) != isinstance(v, bool) or \
                not isinstance(v, (bool, int, float) if isinstance(default, float) else type(default)):
            raise ValueError(f"video recipe field {k} must be {type(default).__name__}, got {v!r}")
    for k, choices in CHOICES.items():
        if k in overrides and overrides[k] not in choices:
            raise ValueError(f"video recipe field {k}={overrides[k]!r}; expected one of {choices}")
    threshold = overrides.get("step_cache_threshold", recipe.step_cache_threshold)
    if not float(threshold) > 0:
        raise ValueError(f"video recipe field step_cache_threshold must be > 0, got {threshold!r}")
    new = replace(recipe, **overrides, overridden=tuple(sorted({*recipe.overridden, *overrides})))
    turned_on = [k for k in APPROXIMATE if k in overrides and getattr(new, k)]
    if turned_on and not recipe.allow_approximate:
        raise ValueError(f"override(s) {', '.join(turned_on)} are approximate; allow approximate recipes for "
                         "this pool first (recipe fast)")
    if new.cpu_offload and new.compile_regional and "compile_regional" not in overrides:
        new = replace(new, compile_regional=False, adjusted=(*new.adjusted, "compile off: cpu_offload moves "
                                                              "the transformer between devices every call"))
    return new
