"""The recipe tables, as data: one recipe per device class, the rules that pick the class, and
what each model family changes in it.

Place in the data flow: :func:`pipeline.recipes.recipe_for` reads these three tables, top to
bottom. Memory thresholds are decimal GB (10**9 bytes), as GPUs are sold: an "A100 40GB" reports
about 42e9 bytes. Each recipe is the ``fast`` flavour (approximations included); ``exact`` drops
them. ``dtype="float32"`` in a class recipe means "the model's reference dtype" for accelerator
classes: the fitting step replaces it (an accelerator never defaults to float32).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.device import GB, DeviceProfile
from pipeline.recipes.knobs import Recipe

#: One recipe per device class, approximations included (the ``fast`` flavour).
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    # Hopper / Ampere with room: static compile (one graph per batch bucket × declared size, built
    # at warm-up; dynamic=True had not finished compiling the SD 1.5 UNet after six minutes on an
    # H100 where a static compile took 77-82 s) with CUDA graphs (reduce-overhead: SD 1.5 at batch 1
    # is host-bound, 0.66 s of CPU per 0.61 s image on that H100), tiny VAE in fast. The CPU kernels of
    # pipeline.invariance never run on CUDA; batch invariance there is the pool's choice
    # (per-sample calls, measured by bench.pipeline.gpu_checks; off unless it costs under 10 %).
    Recipe("cuda-large", dtype="float32", attention="flash_attn", channels_last=True, fuse_qkv=True,
           compile_denoiser=True, compile_vae=True, compile_mode="reduce-overhead",
           max_batch_size=16, memory_fraction=0.9, tiny_vae="auto", scheduler_precompute=True),
    Recipe("cuda-mid", dtype="float32", attention="sdpa", channels_last=True, fuse_qkv=True,
           compile_denoiser=True, compile_vae=True, compile_mode="reduce-overhead",
           max_batch_size=8, memory_fraction=0.9, tiny_vae="auto", scheduler_precompute=True),
    # Fused QKV keeps the unfused weights too, so it is off where memory is short; no compile
    # (its workspace and warm-up do not pay on 8 GB cards that offload).
    Recipe("cuda-small", dtype="float32", attention="sdpa", channels_last=True, vae_slicing=True,
           max_batch_size=2, memory_fraction=0.85, tiny_vae="auto", scheduler_precompute=True),
    Recipe("accelerator", dtype="float32", attention="sdpa", vae_slicing=True, max_batch_size=4,
           memory_fraction=0.85, scheduler_precompute=True),  # xpu / npu
    Recipe("mps", dtype="float32", attention="sdpa", fuse_qkv=True, vae_slicing=True, max_batch_size=4,
           memory_fraction=0.7, tiny_vae="auto", scheduler_precompute=True),
    # CPU: torch.compile is opt-in (override compile_denoiser/compile_vae): Inductor took 66 s on
    # the tiny model on 2 cores, and again per new shape. No channels_last: with the batch-invariant
    # kernels (oneDNN convolutions, NCHW group norms) it only adds layout copies (sd15-arch UNet,
    # batch 8 at 32x32 latents, 1 thread: NCHW 15.3 s, channels_last 17.6 s; fused QKV saves ~6 %).
    # AMX Xeon (family 6 model 207, 2 vCPUs): OpenVINO runs the SD 1.x/2.x UNet, batched, and the
    # batch-invariant kernels are a pool's opt-in. `renderfarm bench pipeline --model sd15-arch
    # --width 256 --height 256 --steps 4 --batch-sizes 1,4 --repeats 2` (medians of 2 rounds, s/img,
    # batch 1 / 4; docs/benchmarks/cpu-xeon-amx-pipeline-sd15-arch-256-*.json): baseline 17.7 / 13.0;
    # exact as it was (PyTorch, invariant kernels) 18.4 / 14.8 (0.99x / 0.87x: slower than diffusers
    # at batch 4); invariant kernels off 17.8 / 12.5; OpenVINO UNet called per sample 14.2 / 15.4;
    # OpenVINO UNet batched 12.2 / 10.9 (1.45x / 1.19x). fast (bfloat16): PyTorch 2.76x / 3.13x,
    # OpenVINO 4.76x / 3.81x. The VAE decoder in OpenVINO too (vae_backend; exact keeps the full
    # decoder, fast swaps in the tiny one): on another AMX Xeon (KVM reports family 6 model 167;
    # quiet, the same command with --sequential, one pipeline loaded at a time): baseline 10.8 / 9.45,
    # exact with the PyTorch decoder 9.95 / 9.45 (1.09x / 1.00x), with the OpenVINO decoder 8.99 /
    # 8.69 (1.20x / 1.09x), faster in both rounds at both batches
    # (docs/benchmarks/cpu-xeon-amx-pipeline-sd15-arch-256-vae{,-sequential}.json); sd-turbo-arch
    # 256², 1 step, guidance 0, 3 rounds: exact 1.05x / 0.93x with the PyTorch decoder, 1.33x / 1.20x
    # with OpenVINO's (cpu-xeon-amx-pipeline-sd-turbo-arch-256-vae-sequential.json); with the
    # shipped one-decode-per-image decoder 1.06x / 1.06x against 0.80x / 0.82x for PyTorch's in the
    # same run (cpu-xeon-amx-pipeline-sd-turbo-arch-256-vae-per-image.json).
    # A third AMX Xeon (family 6 model 207 stepping 2, float32 GEMM 210-247 GFLOP/s): exact 1.33x / 0.91x
    # sequential, 1.21x / 0.98x interleaved (OpenVINO's float32 UNet ran at PyTorch's speed there: 10.0
    # vs 10.1 s at batch 8), fast 6.45x / 6.57x on sd-turbo-arch (cpu-xeon-amx-m207s2-*.json).
    Recipe("cpu-amx", dtype="bfloat16", attention="sdpa", fuse_qkv=True, backend="openvino",
           vae_backend="openvino", max_batch_size=4, memory_fraction=0.7, tiny_vae="auto",
           scheduler_precompute=True),
    # AVX-512 with AVX512_BF16 but no AMX (AMD EPYC): bfloat16 wins. `renderfarm bench pipeline`,
    # sd-turbo-arch 256², 1 step, guidance 0, 3 interleaved rounds (medians; load average 3-6 on the
    # 2 cores): fast in bfloat16 2.85x the float32 baseline at batch 1, 7.84x at batch 4; the same
    # recipe in float32 1.05x / 2.55x (CPU s/img 4.4 / 2.3 vs 9.8 / 5.8; GEMM 2048³ bf16 389 vs fp32
    # 91 GFLOP/s). bench/pipeline/results/sd-turbo-arch.json; OpenVINO: pipeline/README.md.
    # OpenVINO runs the UNet of SD 1.x/2.x faster than PyTorch here (same run, sd-turbo-arch 256²,
    # 1 step, 3 rounds, load average ~2): exact 1.33x the baseline with OpenVINO vs 1.11x without
    # (batch 1), fast 8.01x vs 5.21x (batch 1) and 8.96x vs 7.25x (batch 4). Skipped, with the
    # reason in the report, where the openvino wheel is not installed or the family is not SD 1/2.
    # sd15-arch 256², 4 steps, exact (float32, OpenVINO UNet called per sample for the invariant
    # kernels): 1.34x / 1.09x the baseline at batch 1 / 4; the baseline at batch 4 already runs near
    # the float32 GEMM rate, so no float32 recipe gains much more (docs/performance/index.md). On a
    # faster EPYC of the class (family 26; bf16 GEMM 871 vs 391 GFLOP/s) the same exact row gave
    # 1.83x / 1.29x, and 1.64x / 1.49x with the invariant kernels off. For sd-turbo-arch (1 step,
    # guidance 0) the invariant kernels put exact under diffusers at batch 4 on both EPYCs of the
    # class: 0.95x with them against 1.12x without (family 25, 2 rounds; family 26: 0.95x), and on
    # sd15-arch batch 4 went 1.13x -> 1.17x without them (family 25): so, as on the AMX Xeon, they
    # are a pool's opt-in (batch_invariant), and every exact row is at least 1.0x the baseline.
    # The VAE decoder in OpenVINO as on the AMX class: on the family 25 EPYC the sd15-arch decoder
    # alone (32x32 latents) took 3.93 / 14.64 s in PyTorch and 3.05 / 12.45 s in OpenVINO at batch
    # 1 / 4 (docs/performance/index.md). This recipe as it stands, on the family 26 EPYC with
    # --sequential (docs/benchmarks/cpu-epyc-f26-avx512-bf16-pipeline-*-256-sequential.json):
    # sd15-arch exact 2.10x / 1.59x at batch 1 / 4; sd-turbo-arch exact 1.71x / 1.37x, fast 8.62x / 6.31x.
    # On a family 25 EPYC of the class (float32 GEMM 124-128 GFLOP/s), sd15-arch exact 1.57x / 1.20x
    # (docs/benchmarks/cpu-epyc-f25-avx512-bf16-pipeline-sd15-arch-256-shipped-sequential.json).
    Recipe("cpu-avx512-bf16", dtype="bfloat16", attention="sdpa", fuse_qkv=True, backend="openvino",
           vae_backend="openvino", max_batch_size=4, memory_fraction=0.7, tiny_vae="auto",
           scheduler_precompute=True),
    # No bf16 (AVX-512 without AVX512_BF16, AVX2-only EPYCs): no batch-invariant kernels by default
    # (a pool that needs them sets batch_invariant). With them, exact was slower than diffusers on
    # an AVX-512 (VNNI) Xeon without bf16 (`renderfarm bench pipeline --model sd-turbo-arch --width
    # 256 --height 256 --steps 1 --guidance-scale 0 --batch-sizes 1,4 --recipes baseline,exact,fast
    # --repeats 3`, load ~3: 0.90x at batch 1, 0.88x at batch 4). What they cost, measured on the
    # AMX Xeon in float32 (the same kernels; the same command with exact, exact:batch_invariant=false,
    # 1 round finished, load 6.5-9): 59.1 vs 40.1 s/img at batch 1, 34.1 vs 19.9 at batch 4, against
    # the baseline's 67.0 and 35.1 (round 2, cut short: exact 27.4 vs baseline 22.5 at batch 4).
    # torch.compile stays opt-in on every CPU: Inductor made that exact
    # row 2.6x the baseline at batch 1 (25.8 s/img) but its cold start was 861 s at batch 1 and 893 s
    # at batch 4 on the 2 loaded cores (eager: 54 and 107 s), per bucket x size, before any cache.
    # OpenVINO in float32 runs the SD 1.x/2.x UNet here (an AVX2-only EPYC, 2 cores, the same
    # sd-turbo-arch command, two runs each with its own baseline, load ~2): fast 3.28x / 3.50x the
    # baseline at batch 1 / 4 with OpenVINO against 2.61x / 3.00x without; exact 1.14x / 1.00x against
    # 1.01x / 1.02x. Exact stays near 1.0x because the full VAE decoder, which exact keeps, is about
    # half of its time at 256² (docs/benchmarks/cpu-epyc-avx2-pipeline-sd-turbo-arch-256-*.json).
    # sd15-arch 256², 4 steps on that class (2 rounds, load ~2): exact 1.49x / 1.20x the baseline at
    # batch 1 / 4; with compile_vae (Inductor, frozen weights) 1.58x / 1.28x, for 33-34 s more cold start
    # per bucket x size: compile stays a pool's override (docs/performance/index.md).
    # This recipe on the AVX-512 (VNNI) Xeon without bf16 (family 6 model 85, 2 rounds, load ~2):
    # sd15-arch exact 1.25x / 1.14x the baseline at batch 1 / 4 (1.50x / 1.18x with compile_vae);
    # sd-turbo-arch fast 2.87x / 2.85x (4 rounds), exact 0.95x / 1.10x (within the rounds' spread).
    # The VAE decoder in OpenVINO as on the bf16 classes: on a second AVX2-only EPYC (family 25
    # model 1; float32 GEMM 183 GFLOP/s) with --sequential, sd15-arch 4 steps (2 rounds): baseline
    # 18.8 / 16.7 s/img, exact with the PyTorch decoder 16.4 / 16.1 (1.15x / 1.03x), with OpenVINO's
    # 15.2 / 14.9 (1.24x / 1.12x); sd-turbo-arch 1 step (3 rounds): exact 1.11x / 1.02x with the
    # PyTorch decoder, 1.31x / 1.20x with OpenVINO's, faster in every round
    # (docs/benchmarks/cpu-epyc-avx2-pipeline-{sd15-arch,sd-turbo-arch}-256-vae-sequential.json). On
    # the AVX-512 Xeon without bf16 the sd15-arch decoder alone took 8.2 / 16.8 s in PyTorch and
    # 6.5 / 13.2 s in OpenVINO at batch 2 / 4.
    Recipe("cpu", attention="sdpa", fuse_qkv=True, backend="openvino", vae_backend="openvino",
           max_batch_size=4, memory_fraction=0.7, tiny_vae="auto", scheduler_precompute=True),
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
    needs_avx512_bf16: bool = False

    def matches(self, p: DeviceProfile) -> bool:
        gb = p.total_memory_bytes / GB
        return (p.kind == self.kind and self.min_memory_gb <= gb < self.max_memory_gb
                and (self.min_compute_capability is None
                     or (p.compute_capability or (0, 0)) >= self.min_compute_capability)
                and (p.amx or not self.needs_amx) and (p.avx512_bf16 or not self.needs_avx512_bf16))


RECIPE_TABLE: list[Rule] = [
    Rule("cuda", "cuda-large", min_memory_gb=40, min_compute_capability=(8, 0)),  # bf16 needs sm80+
    Rule("cuda", "cuda-mid", min_memory_gb=12),
    Rule("cuda", "cuda-small"),
    Rule("xpu", "accelerator"),
    Rule("npu", "accelerator"),
    Rule("mps", "mps"),
    Rule("cpu", "cpu-amx", needs_amx=True),
    Rule("cpu", "cpu-avx512-bf16", needs_avx512_bf16=True),
    Rule("cpu", "cpu"),
]


@dataclass(frozen=True)
class FamilyFit:
    """What a family changes in a device-class recipe.

    ``weights_gb``: the pipeline's weights at its card dtype (all components, decimal GB; from the
    published parameter counts: SD 1.5 1.07B, SD 2.1 1.30B, SDXL 3.47B, SD3-medium 7.69B with
    T5-XXL, FLUX.1 16.9B, FLUX.2-dev ~56B with its 24B text encoder, ERNIE-Image without the
    prompt enhancer 5.77B from diffusers' defaults). ``batch_scale`` scales the class's batch cap
    (1024² latents are 4× SD 1.5's). ``fast_quantization``: the approximate quantization ``fast``
    uses on CUDA when it helps: fp8 dynamic (torchao, with compile) on compute capability ≥ 8.9
    for the large transformers; ERNIE-Image's SDNQ uint4 with quantized matmul per its card.
    """

    weights_gb: float
    batch_scale: float = 1.0
    fast_quantization: str | None = None
    fp8_min_cc: tuple[int, int] = (8, 9)


FAMILY_FITS: dict[str, FamilyFit] = {
    "sd1": FamilyFit(2.2),
    "sd2": FamilyFit(2.6),
    "sdxl": FamilyFit(7.0, 0.5),
    "sd3": FamilyFit(15.4, 0.5),
    "flux-schnell": FamilyFit(33.8, 0.25, "torchao_fp8_dynamic"),
    "flux-dev": FamilyFit(33.8, 0.25, "torchao_fp8_dynamic"),
    "flux2": FamilyFit(112.0, 0.25, "torchao_fp8_dynamic"),
    "ernie-image": FamilyFit(11.6, 0.25, "sdnq_uint4"),
    "kolors": FamilyFit(17.8, 0.5),  # fp16: SDXL-size UNet 2.6B + ChatGLM3-6B text encoder + VAE
}
