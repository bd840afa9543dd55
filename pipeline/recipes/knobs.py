"""The recipe knobs: what each one does, whether it is exact, and the :class:`Recipe` that holds them.

Place in the data flow: :mod:`pipeline.recipes.table` fills recipes per device class and family;
:func:`pipeline.optimize.apply_recipe` applies one to a warm pipeline.

"Exact" is relative to the model: the reference is diffusers at the dtype the model's card
recommends (:func:`pipeline.models.families.reference_dtype`), so running in that dtype is exact
and any other dtype is an approximation. Every other knob is exact or approximate on its own.
Sources are the public documents: the PaddlePaddle ERNIE-ViLG 2.0 inference article (Baidu), the
Rapid Diffusion paper (Alibaba PAI + SCUT, ACL 2023), the ERNIE-Image-Turbo SDNQ uint4 model card
(WaveCut/ERNIE-Image-Turbo-SDNQ-uint4-static), and diffusers' "Speed up inference" guide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

DTYPES = ("float32", "float16", "bfloat16")
#: default = as diffusers loaded it; sdpa = PyTorch SDPA; flash_attn = the flash-attn kernels
#: (a processor for UNets, diffusers' attention dispatcher for transformers); cudnn = PyTorch's
#: cuDNN SDPA through the dispatcher (transformers only); sliced = diffusers attention slicing.
ATTENTION = ("default", "sdpa", "flash_attn", "cudnn", "sliced")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TORCHAO = ("torchao_int8", "torchao_int8_dynamic", "torchao_fp8_dynamic")
#: ``openvino_int8``: NNCF int8 weight compression of the OpenVINO UNet (needs ``backend="openvino"``).
QUANTIZATION = (None, *TORCHAO, "sdnq_uint4", "openvino_int8")
BACKENDS = ("torch", "openvino")


class Optimization(NamedTuple):
    exactness: str  # "exact" | "approximate"
    source: str
    knob: bool = True  # a Recipe field; False for techniques applied elsewhere


EXACT, APPROX = "exact", "approximate"
_DIFFUSERS_GUIDE = "diffusers 'Speed up inference' guide"
OPTIMIZATIONS: dict[str, Optimization] = {
    "dtype": Optimization(APPROX, f"{_DIFFUSERS_GUIDE} (half precision); exact when it is the model card's dtype"),
    "attention": Optimization(EXACT, "ERNIE-ViLG 2.0 inference article (Flash Attention); Rapid Diffusion "
                                     "(FlashAttention, Dao et al. 2022); PyTorch SDPA; diffusers attention backends"),
    "channels_last": Optimization(EXACT, "ERNIE-ViLG 2.0 inference article: mixed layout computation"),
    "fuse_qkv": Optimization(EXACT, "ERNIE-ViLG 2.0 inference article: operator fusion; "
                                    "diffusers fuse_qkv_projections"),
    "compile_denoiser": Optimization(EXACT, "ERNIE-ViLG 2.0 article: norm/operator fusion; Rapid Diffusion: "
                                            "compiler; here torch.compile of the UNet or transformer"),
    "compile_regional": Optimization(EXACT, "diffusers compile_repeated_blocks (regional compilation)"),
    "compile_dynamic": Optimization(EXACT, "torch.compile dynamic shapes: a new size does not recompile"),
    "compile_vae": Optimization(EXACT, "as compile_denoiser, for the VAE decoder"),
    "compile_mode": Optimization(EXACT, "torch.compile modes"),
    "compile_freeze": Optimization(EXACT, "Inductor freezing (PyTorch 'Inductor CPU backend' tutorial): the compiled "
                                          "VAE decoder's weights become constants; CPU, default mode"),
    "compile_gemm_autotune": Optimization(EXACT, "Inductor's GEMM autotuning (torch/_inductor/kernel/mm.py: fp8 "
                                                 "scaled_mm benchmarks Triton templates in every mode); false: "
                                                 "max_autotune_gemm_backends=ATEN, one cuBLAS(Lt) choice"),
    "compile_aot": Optimization(EXACT, "AOTInductor (PyTorch 'AOTInductor' docs): the frozen CPU decoder compiled "
                                       "ahead of time, one package per shape, loaded by the next worker"),
    "vae_tiling": Optimization(APPROX, "diffusers 'Reduce memory usage': tiles are blended, pixels change "
                                       "above the tile size (512 px for SD)"),
    "vae_slicing": Optimization(EXACT, "diffusers 'Reduce memory usage': decodes one image at a time"),
    "cpu_offload": Optimization(EXACT, "diffusers enable_model_cpu_offload (moves whole models, same math)"),
    "quantization": Optimization(APPROX, "ERNIE-Image-Turbo SDNQ uint4 model card (quantized matmul); torchao "
                                         "int8 weight-only, int8/fp8 dynamic (with torch.compile); NNCF "
                                         "compress_weights int8 (OpenVINO's weight compression guide)"),
    "backend": Optimization(EXACT, "OpenVINO, the engine fastsdcpu uses (CPU; f32 inference precision is the same "
                                   "math, bf16 follows the dtype knob); pipeline/optimize/openvino.py"),
    "vae_backend": Optimization(EXACT, "OpenVINO for the VAE decoder (CPU, AutoencoderKL; the precision follows the "
                                       "VAE's dtype); pipeline/optimize/openvino_vae.py"),
    "tiny_vae": Optimization(APPROX, f"{_DIFFUSERS_GUIDE}: tiny autoencoder (TAESD family)"),
    "batch_invariant": Optimization(EXACT, "an image's pixels do not depend on its batch-mates "
                                           "(pipeline.invariance)"),
    "max_batch_size": Optimization(EXACT, "batching (same math per image, up to kernel rounding)"),
    "num_threads": Optimization(EXACT, "torch.set_num_threads"),
    "memory_fraction": Optimization(EXACT, "sizes batches only (pipeline.memory)"),
    "scheduler_precompute": Optimization(EXACT, "ERNIE-ViLG 2.0 inference article: precomputed scheduler "
                                                "parameters, no host-device sync in the loop; pipeline/scheduling.py"),
    # Techniques that are not recipe knobs:
    "norm_fusion": Optimization(EXACT, "ERNIE-ViLG 2.0 article: LayerNorm/GroupNorm fusion; Inductor does it "
                                       "under compile_denoiser", knob=False),
    "feature_cache": Optimization(APPROX, "DeepCache (Ma et al., CVPR 2024); not applied by this build", knob=False),
    "fewer_steps": Optimization(APPROX, f"{_DIFFUSERS_GUIDE}: distilled models; the SDNQ card's 8-step Turbo; a "
                                        "request's num_inference_steps, never changed by a recipe", knob=False),
}
_CHOICES: dict[str, tuple] = {"dtype": DTYPES, "attention": ATTENTION, "compile_mode": COMPILE_MODES,
                              "quantization": QUANTIZATION, "backend": BACKENDS,
                              "vae_backend": BACKENDS}
_BOOLS = ("channels_last", "fuse_qkv", "compile_denoiser", "compile_regional", "compile_dynamic", "compile_vae",
          "compile_freeze", "compile_aot", "compile_gemm_autotune", "vae_tiling", "vae_slicing", "cpu_offload",
          "scheduler_precompute", "batch_invariant")
#: Old knob names still accepted in overrides.
ALIASES = {"compile_unet": "compile_denoiser"}
_NOT_KNOBS = ("name", "overridden", "reference_dtype", "family", "adjusted")


@dataclass(frozen=True)
class Recipe:
    """What :func:`pipeline.optimize.apply_recipe` does to a pipeline. Defaults = diffusers defaults.

    ``reference_dtype`` is the model's exact dtype on the device (set when the recipe is fitted
    to a family and device); ``dtype`` equal to it is exact. ``family`` names the family fitted
    to (None: generic). ``tiny_vae`` is None, ``"auto"`` (the tiny autoencoder matching the VAE's
    config: hub id in production, offline build for offline models), a hub id, a directory or
    an offline build name. torchao quantization is only valid with ``compile_denoiser`` (without
    compile it runs many times slower than no quantization).
    """

    name: str = "baseline"
    dtype: str = "float32"
    attention: str = "default"
    channels_last: bool = False
    fuse_qkv: bool = False
    compile_denoiser: bool = False
    compile_regional: bool = False  # the repeated blocks only (diffusers compile_repeated_blocks)
    compile_dynamic: bool = False  # dynamic shapes: new sizes and batch sizes reuse the graph
    compile_vae: bool = False  # compiles the VAE decoder only
    compile_mode: str = "default"
    compile_freeze: bool = True  # Inductor freezing of the compiled VAE decoder (CPU, default mode only)
    compile_aot: bool = True  # the frozen decoder as AOTInductor packages (static shapes; pipeline/optimize/aot.py)
    compile_gemm_autotune: bool = True  # false: Inductor picks ATen's GEMMs (cuBLAS/cuBLASLt) without benchmarking
    vae_tiling: bool = False
    vae_slicing: bool = False
    cpu_offload: bool = False
    scheduler_precompute: bool = False  # pipeline/scheduling.py twins (bit-identical on the CPU)
    quantization: str | None = None
    backend: str = "torch"  # "openvino": the UNet runs in OpenVINO (CPU, SD 1.x/2.x UNets)
    vae_backend: str = "torch"  # "openvino": the VAE decoder runs in OpenVINO (CPU, AutoencoderKL)
    tiny_vae: str | None = None
    batch_invariant: bool = False
    max_batch_size: int = 1  # images per denoiser call, an upper bound for pipeline.memory
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    memory_fraction: float = 0.8  # batch peak must stay under this fraction of device memory
    reference_dtype: str = "float32"
    family: str | None = None
    overridden: tuple[str, ...] = field(default=(), compare=False)  # knobs set by configuration
    adjusted: tuple[str, ...] = field(default=(), compare=False)  # knobs changed by a conflict rule, with why

    def __post_init__(self) -> None:
        for name, choices in {**_CHOICES, "reference_dtype": DTYPES}.items():
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
            raise ValueError(f"recipe field tiny_vae must be auto, a hub id, a path or null, got {self.tiny_vae!r}")
        if self.quantization in TORCHAO and not self.compile_denoiser:
            raise ValueError(f"quantization={self.quantization} needs compile_denoiser=true: torchao quantized "
                             "layers run many times slower than unquantized ones without torch.compile")
        if self.quantization == "openvino_int8" and self.backend != "openvino":
            raise ValueError("quantization=openvino_int8 compresses the OpenVINO UNet's weights: it needs "
                             "backend=openvino")

    def approximations(self) -> list[str]:
        """The approximate knobs in force: ``dtype`` away from the reference, the others away from
        their exact default."""
        out = []
        for k in knob_names():
            exact_value = self.reference_dtype if k == "dtype" else DEFAULTS[k]
            if OPTIMIZATIONS[k].exactness == APPROX and getattr(self, k) != exact_value:
                out.append(k)
        return out

    def without_approximations(self) -> "Recipe":
        """This recipe with every approximate knob back at its exact value."""
        exact: dict[str, Any] = {k: self.reference_dtype if k == "dtype" else DEFAULTS[k]
                                 for k in self.approximations()}
        return replace(self, **exact)

    def to_dict(self) -> dict:
        """JSON-able form, with the approximations in force, for reports and ``GET /v1/workers``."""
        d = asdict(self)
        d["overridden"] = list(self.overridden)
        d["adjusted"] = list(self.adjusted)
        d["approximations"] = self.approximations()
        return d


def knob_names() -> list[str]:
    """The recipe fields a configuration may set."""
    return [f.name for f in fields(Recipe) if f.name not in _NOT_KNOBS]


DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Recipe)}
