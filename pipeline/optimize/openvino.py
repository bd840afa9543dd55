"""OpenVINO as the CPU backend of a UNet (recipe knob ``backend: openvino``).

Place in the data flow: :func:`pipeline.optimize.apply_recipe` → :func:`to_openvino` (here), after
the dtype, fused QKV and attention steps (the converted graph is the optimized UNet) and before
placement. Only SD-style UNets without extra conditioning (SD 1.x / 2.x: sample, timestep, text
embeddings) are converted; anything else keeps PyTorch and the report says why.

OpenVINO is the engine fastsdcpu uses (SD-Turbo 512², 1 step, 1.7 s on an i7-12700). It is used
through the ``openvino`` wheel alone (``openvino.convert_model`` on the PyTorch module):
``optimum-intel`` cannot be installed beside this project's torch. The inference precision
follows the recipe's dtype (float32 → ``f32``, exact up to kernel rounding; bfloat16 → ``bf16``).
Its kernels may depend on the batch size: a pool that asks for batch invariance gets one UNet
call per sample (:func:`pipeline.invariance.make_per_sample`).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from pipeline import compile_count
from pipeline.invariance import PER_SAMPLE
from pipeline.optimize.quantize import Skip


class UNetCall(torch.nn.Module):
    """A UNet as a function of (sample, timestep, text embeddings) → noise prediction (for tracing)."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class OpenVinoModule(torch.nn.Module):
    """A compiled OpenVINO model standing in for the PyTorch ``source`` module it was converted
    from: its class name (``source_class``), ``dtype`` and ``device`` (an empty buffer that
    ``.to()`` moves and casts, so diffusers' dtype and device checks keep working). Every call
    runs the compiled model (there is no eager fallback) and counts as a compiled call
    (:func:`pipeline.compile_count.count_call`)."""

    #: Which runtime runs it (the benchmarks count this module's FLOPs from its ``source_class``).
    runtime = "openvino"
    _anchor: torch.Tensor  # a registered buffer

    def __init__(self, source: torch.nn.Module, compiled, precision: str):
        super().__init__()
        self.source_class = type(source).__name__
        self.compiled = compiled
        self.precision = precision
        self.register_buffer("_anchor", torch.zeros(0, dtype=next(source.parameters()).dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    @property
    def device(self) -> torch.device:
        return self._anchor.device


class OpenVinoUNet(OpenVinoModule):
    """A compiled OpenVINO model with the UNet's call signature, config, dtype and device.

    Inputs go in as float32 NumPy arrays; the output comes back in the input's dtype. Raises
    ValueError for conditioning it was not converted with (SDXL's ``added_cond_kwargs``, LCM's
    ``timestep_cond``, ControlNet residuals).
    """

    def __init__(self, unet, compiled, precision: str):
        super().__init__(unet, compiled, precision)
        self.config = unet.config

    def forward(self, sample, timestep, encoder_hidden_states, *args, return_dict: bool = True, **kwargs):
        extra = [k for k in ("added_cond_kwargs", "timestep_cond", "down_block_additional_residuals",
                             "mid_block_additional_residual") if kwargs.get(k) is not None]
        if args or extra:
            raise ValueError(f"the OpenVINO UNet was converted without {extra or 'extra positional inputs'}")
        t = torch.as_tensor(timestep).float().reshape(-1)[:1].reshape(())
        compile_count.count_call(compiled=True)
        out = self.compiled([sample.float().numpy(), t.numpy(), encoder_hidden_states.float().numpy()])[0]
        out = torch.from_numpy(np.ascontiguousarray(out)).to(sample.dtype)
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)


# Its kernels are not verified batch invariant: under the CPU kernels it runs one call per sample.
setattr(OpenVinoUNet, PER_SAMPLE, True)


def to_openvino(pipe, denoiser_name: str, dtype: torch.dtype, device: str | None, int8_weights: bool = False,
                ir_store=None):
    """Replace ``pipe.unet`` by its OpenVINO compilation; returns a report dict or a :class:`Skip`.

    ``int8_weights``: compress the weights of the converted model to int8 (asymmetric, per output
    channel; activations stay in ``dtype``) with NNCF's ``compress_weights``, as OpenVINO's "Weight
    Compression" guide describes: approximate, about a quarter of the float32 weight bytes. Skipped
    with its reason when the ``nncf`` package is not installed. The report's ``weights`` says
    which weights the compiled model holds.

    ``ir_store``: where converted models are shared (:class:`pipeline.optimize.openvino_ir.IRStore`;
    None: convert every time). With one, the converted model is read from it when stored, else
    converted and stored; the report's ``ir`` is the outcome (``hit``, ``miss``, ``corrupt`` or
    ``error``, with its reason, bytes and seconds).
    """
    if (device or "cpu").partition(":")[0] != "cpu":
        return Skip("the OpenVINO backend runs on the CPU only")
    if importlib.util.find_spec("openvino") is None:
        return Skip("openvino not installed (pip install openvino: it does not touch torch)")
    unet = getattr(pipe, denoiser_name)
    if denoiser_name != "unet" or unet.config.get("addition_embed_type") or unet.config.get("time_cond_proj_dim"):
        return Skip(f"only SD 1.x/2.x UNets are converted; this {type(unet).__name__} has other inputs")
    if int8_weights and importlib.util.find_spec("nncf") is None:
        return Skip("quantization=openvino_int8 needs the nncf package (the [cpu] extra)")
    import openvino as ov

    model, ir = converted(pipe, unet, lambda: _convert(unet, int8_weights), ir_store, int8_weights)
    weights = "as dtype"
    if int8_weights:
        import nncf

        weights = f"int8_asym (nncf {nncf.__version__})"
    precision = precision_of(dtype)
    compiled = compile_cpu(model, precision)
    setattr(pipe, denoiser_name, OpenVinoUNet(unet.to(dtype), compiled, precision))
    report = {"backend": "openvino", "version": ov.__version__, "precision": precision, "weights": weights}
    return {**report, "ir": ir} if ir is not None else report


def converted(pipe, module: torch.nn.Module, convert, ir_store, int8_weights: bool = False, component: str = "unet"):
    """The OpenVINO model of ``module`` (a component of ``pipe``): ``convert()``-ed, or read from
    ``ir_store`` when it holds this module's conversion
    (:func:`pipeline.optimize.openvino_ir.read_or_convert`; ``component`` is stored in its fields).
    Without a store, the local one of ``RENDERFARM_OPENVINO_IR_DIR`` when it is set
    (:func:`pipeline.optimize.openvino_ir.local_ir_store`).

    Returns:
        (``openvino.Model``, the IR cache outcome as a dict, or None without a store).
    """
    from pipeline.optimize.openvino_ir import local_ir_store, read_or_convert

    if ir_store is None:
        ir_store = local_ir_store()
    if ir_store is None:
        return convert(), None

    model, outcome = read_or_convert(module, convert, ir_store, int8_weights=int8_weights, component=component,
                                     model=str(getattr(pipe, "_renderfarm_model", "")
                                               or getattr(pipe, "name_or_path", "") or ""))
    return model, outcome.to_dict()


def precision_of(dtype: torch.dtype) -> str:
    """OpenVINO's ``INFERENCE_PRECISION_HINT`` for a torch dtype: ``bf16``, ``f16`` or ``f32``."""
    return "bf16" if dtype == torch.bfloat16 else "f16" if dtype == torch.float16 else "f32"


def compile_cpu(model, precision: str):
    """``model`` (an ``openvino.Model``) compiled for the CPU plugin at ``precision``
    (:func:`precision_of`); ``f32`` keeps float32 arithmetic even where the CPU has bf16 (AMX),
    which OpenVINO would otherwise pick by default."""
    import openvino as ov

    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision})


def dynamic_shapes(model, fixed: tuple[int, ...] = (1,)) -> None:
    """Make every input of ``model`` dynamic in every dimension except those in ``fixed`` (the
    channels by default): one compiled model then serves every batch, size and sequence length."""
    import openvino as ov

    shapes = {}
    for port in model.inputs:
        dims = list(port.get_partial_shape())
        shapes[port] = ov.PartialShape([d if i in fixed else ov.Dimension(-1) for i, d in enumerate(dims)])
    model.reshape(shapes)


def trace(module: torch.nn.Module, example: tuple[torch.Tensor, ...]):
    """``module`` (in eval mode) traced once on ``example`` in float32 and converted to an
    ``openvino.Model`` whose inputs are dynamic in every dimension but the second
    (:func:`dynamic_shapes`); ``module`` is back in its own dtype afterwards.

    Traced without torch.jit.trace's check (``check_trace`` re-traces and reruns the model to
    compare outputs, a diagnostic that changes nothing in the graph): on a 2-core AVX2 EPYC an
    SD 1.5-architecture UNet converted in 23.0-23.5 s without it, 32.9-43.6 s with it
    (docs/performance/time-to-ready.md).
    """
    import openvino as ov
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder

    dtype = next(module.parameters()).dtype
    try:
        with torch.inference_mode():
            decoder = TorchScriptPythonDecoder(module.float().eval(), example_input=example,
                                               trace_kwargs={"check_trace": False})
            model = ov.convert_model(decoder, example_input=example)
    finally:
        module.to(dtype)
    dynamic_shapes(model)
    return model


def _convert(unet, int8_weights: bool):
    """``unet`` traced into an OpenVINO model with dynamic batch, sides and sequence (float32
    weights; int8 ones after NNCF's ``compress_weights`` when asked)."""
    # An example latent whose sides are not multiples of the UNet's overall upsampling factor, so
    # the traced graph upsamples each level to its skip connection's size (diffusers'
    # forward_upsample_size path) rather than by a fixed 2x: one model then serves every latent
    # size the PyTorch UNet serves (64x72 pixels on an 8x upsampling UNet included); for sizes that
    # are multiples, nearest upsampling to twice the size is the same operation.
    up_factor = 2 ** len(getattr(unet, "up_blocks", ())[1:])
    side = max(1, unet.config.sample_size // 2 // up_factor) * up_factor + 1
    example = (torch.randn(1, unet.config.in_channels, side, side + 2), torch.tensor(999.0),
               torch.randn(1, 77, unet.config.cross_attention_dim))
    model = trace(UNetCall(unet), example)  # dynamic batch, height, width and sequence
    if int8_weights:
        import nncf

        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return model
