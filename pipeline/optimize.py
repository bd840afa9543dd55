"""Apply a :class:`~pipeline.recipes.Recipe` to a loaded diffusers pipeline.

Place in the data flow: worker → device probe → recipe → :func:`apply_recipe` (here), once, on
the warm pipeline, before warm-up. The returned report (what was applied, what was skipped and
why) goes into the worker's heartbeat next to the recipe, so ``GET /v1/workers`` shows the
optimizations really in force, not only the ones asked for.

Every step is guarded: a missing package (flash-attn, torchao, sdnq), a missing C++ compiler or
Triton for ``torch.compile``, or a step that raises, is recorded under ``skipped`` with its
reason, and the pipeline stays usable. Works on StableDiffusion-style pipelines (``unet``,
``vae``, ``text_encoder``); sources of each technique are in ``recipes.OPTIMIZATIONS``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import torch
from diffusers.models.attention_processor import AttnProcessor2_0, FusedAttnProcessor2_0

from pipeline.recipes import Recipe

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Offline tiny autoencoders: AutoencoderTiny configs with random weights (seed 0), the compute of
#: the real checkpoint without its download, for benchmarks of the offline ``*-arch`` models.
#: ``taesd-arch`` is madebyollin/taesd's config.json (= diffusers' AutoencoderTiny defaults:
#: 64-channel blocks, 1/3/3/3 encoder and 3/3/3/1 decoder blocks, 4 latent channels, 2.4M params).
OFFLINE_TINY_VAES: dict[str, dict] = {"taesd-arch": {"latent_channels": 4}}


def apply_recipe(pipe, recipe: Recipe, device: str | None = None) -> dict:
    """Apply ``recipe`` to ``pipe`` in place and return a JSON-able report.

    ``device`` (e.g. ``"cuda:0"``) is where the pipeline should run; with ``cpu_offload`` the
    pipeline is offloaded to it instead of moved. ``None`` leaves the pipeline where it is.
    Report keys: ``recipe``, ``device``, ``applied`` (step → value), ``skipped`` (step → reason),
    ``approximations`` (approximate knobs in force), ``seconds``.
    """
    t0 = time.perf_counter()
    applied: dict[str, object] = {}
    skipped: dict[str, str] = {}

    def step(name: str, fn) -> None:
        try:
            result = fn()
        except Exception as e:  # a failed optimization must not take the worker down
            skipped[name] = f"{type(e).__name__}: {e}"
            return
        if isinstance(result, _Skip):
            skipped[name] = result.reason
        elif result is not None:
            applied[name] = result

    if recipe.num_threads:
        step("num_threads", lambda: _threads(recipe.num_threads))
    if recipe.tiny_vae:
        step("tiny_vae", lambda: _tiny_vae(pipe, recipe.tiny_vae))
    step("dtype", lambda: _cast(pipe, recipe.dtype))
    attention = _attention_choice(recipe, skipped)
    if recipe.fuse_qkv:
        step("fuse_qkv", lambda: _fuse_qkv(pipe, attention))
    step("attention", lambda: _attention(pipe, attention, fused="fuse_qkv" in applied))
    if recipe.channels_last:
        step("channels_last", lambda: _channels_last(pipe))
    if recipe.quantization:
        step("quantization", lambda: _quantize(pipe, recipe.quantization, DTYPES[recipe.dtype]))
    if recipe.vae_tiling:
        step("vae_tiling", lambda: _vae_memory(pipe.vae, "tiling"))
    if recipe.vae_slicing:
        step("vae_slicing", lambda: _vae_memory(pipe.vae, "slicing"))
    if recipe.scheduler_precompute:
        step("scheduler_precompute", lambda: _precompute_scheduler(pipe))
    step("placement", lambda: _place(pipe, device, recipe.cpu_offload))
    if recipe.compile_unet or recipe.compile_vae:
        step("compile", lambda: _compile(pipe, recipe, device))
    return {
        "recipe": recipe.name,
        "device": device or str(getattr(pipe, "device", "")),
        "applied": applied,
        "skipped": skipped,
        "approximations": recipe.approximations(),
        "seconds": round(time.perf_counter() - t0, 3),
    }


class _Skip:
    def __init__(self, reason: str):
        self.reason = reason


def _threads(n: int) -> int:
    torch.set_num_threads(n)
    return n


def _vae_memory(vae, how: str) -> bool:
    """Tiled (approximate above the tile size) or sliced (exact) VAE decoding."""
    getattr(vae, f"enable_{how}")()
    return True


def _tiny_vae(pipe, source: str):
    """Seed 003: swap in a tiny autoencoder, only from local files (cache or directory)."""
    from diffusers import AutoencoderTiny

    if source in OFFLINE_TINY_VAES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # random weights, reproducible: for the offline *-arch models only
            tiny = AutoencoderTiny(**OFFLINE_TINY_VAES[source])
    else:
        try:
            tiny = AutoencoderTiny.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as e:
            return _Skip(f"{source} not available locally ({type(e).__name__}); pre-download it to enable")
    want, got = pipe.vae.config.latent_channels, tiny.config.latent_channels
    if want != got:
        return _Skip(f"{source} has {got} latent channels, the model's VAE has {want}")
    pipe.vae = tiny.to(device=pipe.vae.device, dtype=pipe.vae.dtype)
    return source


def _precompute_scheduler(pipe):
    """Seed 000: the scheduler's per-step constants on the device before the loop (exact; see
    :mod:`pipeline.scheduling`). Returns the twin's class name."""
    from pipeline.scheduling import precompute_scheduler, unsupported_reason

    reason = unsupported_reason(pipe.scheduler)
    if reason:
        return _Skip(reason)
    pipe.scheduler = precompute_scheduler(pipe.scheduler)
    return type(pipe.scheduler).__name__


def _cast(pipe, dtype: str) -> str:
    """Seed 003 half precision (approximate) or float32; no cast when already there."""
    target = DTYPES[dtype]
    if any(m.dtype != target for m in pipe.components.values() if isinstance(m, torch.nn.Module)):
        pipe.to(dtype=target)
    return dtype


def _attention_choice(recipe: Recipe, skipped: dict[str, str]) -> str:
    if recipe.attention != "flash_attn":
        return recipe.attention
    if importlib.util.find_spec("flash_attn") is None:
        skipped["flash_attn"] = "flash-attn package not installed; using PyTorch SDPA"
    elif recipe.dtype == "float32":
        skipped["flash_attn"] = "flash-attn needs float16 or bfloat16; using PyTorch SDPA"
    else:
        return "flash_attn"
    return "sdpa"


def _fuse_qkv(pipe, attention: str):
    """Fused QKV projections (exact; seed 000 operator fusion). Needs an SDPA-based processor."""
    from diffusers import AutoencoderKL

    if attention == "sliced":
        return _Skip("sliced attention has no fused-projection processor")
    if not hasattr(pipe, "fuse_qkv_projections"):
        return _Skip(f"{type(pipe).__name__} has no fuse_qkv_projections")
    with_vae = isinstance(pipe.vae, AutoencoderKL)
    pipe.fuse_qkv_projections(unet=True, vae=with_vae)
    return ["unet", "vae"] if with_vae else ["unet"]


def _attention(pipe, attention: str, fused: bool):
    if attention == "default":
        return "default"
    if attention == "sliced":
        pipe.enable_attention_slicing()
        return "sliced"
    sdpa = FusedAttnProcessor2_0 if fused else AttnProcessor2_0
    for name in ("unet", "vae"):
        model = getattr(pipe, name, None)
        if model is not None and hasattr(model, "set_attn_processor") and model.attn_processors:
            model.set_attn_processor(FlashAttnProcessor() if attention == "flash_attn" and name == "unet"
                                     else sdpa())
    return attention


class FlashAttnProcessor:
    """The flash-attn kernel (Dao et al. 2022; seeds 000 and 001) for the UNet's attention.

    Handles plain and fused (``to_qkv``/``to_kv``) projections. Anything the kernel does not
    cover (masks, 4-D inputs, group or spatial norms, fp32, non-CUDA tensors, head_dim > 256 or
    not a multiple of 8) goes to diffusers' SDPA processor, so it is never worse than SDPA.
    """

    def __init__(self, flash_fn=None, devices: tuple[str, ...] = ("cuda",)):
        if flash_fn is None:
            from flash_attn import flash_attn_func as flash_fn
        self.flash_fn, self.devices = flash_fn, devices
        self.sdpa, self.fused_sdpa = AttnProcessor2_0(), FusedAttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        fused = getattr(attn, "fused_projections", False)
        head_dim = attn.inner_dim // attn.heads
        if (attention_mask is not None or hidden_states.ndim != 3 or attn.spatial_norm is not None
                or attn.group_norm is not None or attn.norm_q is not None or attn.norm_k is not None
                or hidden_states.device.type not in self.devices
                or hidden_states.dtype not in (torch.float16, torch.bfloat16)
                or head_dim > 256 or head_dim % 8):
            fallback = self.fused_sdpa if fused else self.sdpa
            return fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        batch = hidden_states.shape[0]
        if fused and encoder_hidden_states is None:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            if encoder_hidden_states is not None and attn.norm_cross:
                context = attn.norm_encoder_hidden_states(context)
            q = attn.to_q(hidden_states)
            k, v = attn.to_kv(context).chunk(2, dim=-1) if fused else (attn.to_k(context), attn.to_v(context))
        q, k, v = (t.reshape(batch, -1, attn.heads, head_dim) for t in (q, k, v))
        out = self.flash_fn(q, k, v, dropout_p=0.0, causal=False)  # (batch, seq, heads, head_dim)
        out = attn.to_out[1](attn.to_out[0](out.reshape(batch, -1, attn.heads * head_dim).to(q.dtype)))
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor


def _channels_last(pipe):
    """Seed 000 'mixed layout computation': NHWC convolutions avoid transposes (exact)."""
    done = []
    for name in ("unet", "vae"):
        model = getattr(pipe, name, None)
        if model is not None:
            model.to(memory_format=torch.channels_last)
            done.append(name)
    return done


def _quantize(pipe, method: str, dtype: torch.dtype):
    """Weight quantization (approximate): torchao int8 weight-only, or seed 002's SDNQ uint4
    with quantized matmul. Quantizes the denoiser and the text encoder."""
    names = [n for n in ("unet", "text_encoder") if getattr(pipe, n, None) is not None]
    if method == "torchao_int8":
        if importlib.util.find_spec("torchao") is None:
            return _Skip("torchao not installed")
        from torchao.quantization import quantize_
        try:
            from torchao.quantization import Int8WeightOnlyConfig
            config = Int8WeightOnlyConfig()
        except ImportError:  # torchao < 0.9
            from torchao.quantization import int8_weight_only
            config = int8_weight_only()
        for n in names:
            quantize_(getattr(pipe, n), config)
        return {"method": method, "components": names}
    if importlib.util.find_spec("sdnq") is None:
        return _Skip("sdnq not installed")
    from sdnq import sdnq_post_load_quant

    qmm = importlib.util.find_spec("triton") is not None
    for n in names:
        setattr(pipe, n, sdnq_post_load_quant(getattr(pipe, n), weights_dtype="uint4", torch_dtype=dtype,
                                              use_quantized_matmul=qmm))
    report = {"method": method, "components": names, "quantized_matmul": qmm}
    if not qmm:
        report["note"] = "quantized matmul needs triton (not installed); dequantizing matmul instead"
    return report


def _place(pipe, device: str | None, offload: bool):
    if offload:
        target = device or _default_accelerator()
        if target is None or target.startswith("cpu"):
            return _Skip("model CPU offload needs an accelerator; the pipeline stays on the CPU")
        pipe.enable_model_cpu_offload(device=target)
        return f"model_cpu_offload:{target}"
    if device is None:
        return None
    pipe.to(device)
    return device


def _default_accelerator() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return str(acc.current_accelerator())
    return None


def _compile(pipe, recipe: Recipe, device: str | None):
    """torch.compile (Inductor), lazily on the first call, i.e. at warm-up."""
    kind = (device or str(getattr(pipe, "device", "cpu"))).partition(":")[0]
    if kind == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
        return _Skip("torch.compile on the CPU needs a C++ compiler (g++/clang++); none on PATH")
    if kind in ("cuda", "xpu") and importlib.util.find_spec("triton") is None:
        return _Skip(f"torch.compile on {kind} needs triton; not installed")
    done = []
    if recipe.compile_unet:
        pipe.unet.compile(mode=recipe.compile_mode)
        done.append("unet")
    if recipe.compile_vae:
        pipe.vae.decoder.compile(mode=recipe.compile_mode)
        done.append("vae.decoder")
    return {"mode": recipe.compile_mode, "modules": done}
