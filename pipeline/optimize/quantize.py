"""Weight quantization of the denoiser and text encoders (approximate knobs).

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`quantize` (here), after the
dtype and before placement and compile.

* ``sdnq_uint4``: SDNQ uint4 static quantization, then quantized matmul switched on explicitly
  with ``apply_sdnq_options_to_model(..., use_quantized_matmul=True)``, as the ERNIE-Image-Turbo
  SDNQ uint4 model card (WaveCut/ERNIE-Image-Turbo-SDNQ-uint4-static) says current loaders need
  (``dequantize_fp32=False``, its recipe). On the CPU sdnq runs its PyTorch eager kernels.
* ``torchao_int8`` (weight-only), ``torchao_int8_dynamic``, ``torchao_fp8_dynamic`` (fp8 needs
  compute capability >= 8.9): torchao's ``quantize_``. Recipes only allow them together with
  ``compile_denoiser``: torchao's quantized layers are meant to be fused by Inductor, and run many
  times slower than unquantized layers in eager mode.
"""

from __future__ import annotations

import importlib.util

import torch

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "pe")


class Skip:
    """A step that was not applied, and why (recorded under ``skipped`` in the report)."""

    def __init__(self, reason: str):
        self.reason = reason


def targets(pipe, denoiser_name: str, with_text: bool) -> list[str]:
    """The components to quantize: the denoiser, and the text encoders present when ``with_text``."""
    names = [denoiser_name] + [n for n in TEXT_ENCODERS if with_text and getattr(pipe, n, None) is not None]
    return [n for n in names if isinstance(getattr(pipe, n, None), torch.nn.Module)]


def quantize(pipe, method: str, dtype: torch.dtype, denoiser_name: str):
    """Quantize in place; returns a report dict or a :class:`Skip`."""
    if method.startswith("torchao"):
        return _torchao(pipe, method, denoiser_name)
    if importlib.util.find_spec("sdnq") is None:
        return Skip("sdnq not installed")
    from sdnq import sdnq_post_load_quant
    from sdnq.loader import apply_sdnq_options_to_model

    names = targets(pipe, denoiser_name, with_text=True)
    state = {}
    for n in names:
        model = sdnq_post_load_quant(getattr(pipe, n), weights_dtype="uint4", torch_dtype=dtype,
                                     use_quantized_matmul=True, dequantize_fp32=False)
        model = apply_sdnq_options_to_model(model, use_quantized_matmul=True)
        setattr(pipe, n, model)
        config = getattr(model, "quantization_config", None)
        state[n] = bool(getattr(config, "use_quantized_matmul", False))
    return {"method": method, "components": names, "quantized_matmul": state,
            "triton": importlib.util.find_spec("triton") is not None}


def _torchao(pipe, method: str, denoiser_name: str):
    if importlib.util.find_spec("torchao") is None:
        return Skip("torchao not installed")
    from torchao import quantization as q

    if method == "torchao_int8":
        config = q.Int8WeightOnlyConfig()
    elif method == "torchao_int8_dynamic":
        config = q.Int8DynamicActivationInt8WeightConfig()
    else:
        device = next(getattr(pipe, denoiser_name).parameters()).device
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return Skip("fp8 dynamic quantization needs a CUDA device of compute capability >= 8.9")
        config = q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow())
    names = targets(pipe, denoiser_name, with_text=method == "torchao_int8")
    for n in names:
        q.quantize_(getattr(pipe, n), config)
    return {"method": method, "components": names}
