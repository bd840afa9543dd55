"""Batch invariance: an image's pixels must not depend on which other requests share its batch.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. The worker
batches whatever compatible jobs it pulled, so a job's batch-mates are an accident of timing;
a seed must still reproduce its image exactly, alone or in any group.

What breaks that on CPU (float32, torch 2.13, MKL + oneDNN, 2 threads), found by hooking every
leaf module and looking for ones whose inputs are bit-identical alone and batched but whose
outputs are not:

* ``nn.Linear`` → MKL ``sgemm`` picks its algorithm by the row count M (= batch × tokens): with
  K = 1280 every M < 256 gives different low bits than M ≥ 256, so the time embedding (M = batch)
  and low-resolution attention differ (with CFG a lone request is M = 2, a group of 8 is M = 16).
* ``nn.Conv2d`` → ATen picks oneDNN or its native im2col path by a size heuristic (batch 1 with
  a small input goes native), so ``conv_in`` on the latents and the VAE's first convs differ.
* ``nn.GroupNorm`` on a channels-last tensor with H×W ≥ 1024 → ATen's kernel splits the rows of
  all samples evenly over the threads, so a sample's sum is split differently per batch size.
  diffusers' attention returns a channels-last view, and everything after it inherits it.

Fix, applied to the modules in place by :func:`make_batch_invariant`:

* Linear runs one GEMM per sample (split along dim 0): each GEMM has the same shape whatever the
  batch, so any BLAS takes the same path. Invariant by construction.
* Conv2d on CPU float32 always calls oneDNN (``aten.mkldnn_convolution``), which we measured
  invariant for batches 1…16 (1 and 2 threads, 13 shapes from 1x1 to 3x3, 1 to 1280 channels).
* GroupNorm makes large channels-last inputs contiguous (the NCHW kernel reduces each
  (sample, group) in one thread), and attention outputs are made contiguous so the layout
  after them stays NCHW instead of flipping back and forth.

Text encoders run one call per prompt (:func:`make_per_sample`, below) with their stock kernels:
each call then has the shapes the prompt has alone, which holds whatever the encoder's layout.
The Linear split above is along dimension 0, which is the batch only for batch-first models:
Kolors' ChatGLM keeps its states as (tokens, batch, hidden), so the split went per token, with
two rows per GEMM in a batch of two and one alone, and on an AVX-512 EPYC without AMX those GEMMs
differed in the last bit (found with the same hooks). SDPA attention, layer norms, the schedulers
and the latents (one generator per image) were found invariant as they are. Cost, measured single
threaded: the SD 1.5 UNet +11 % at 256 px (batch 4), the SD VAE decoder +10 %, the tiny model
+5 % end to end; up to 2x at 64 px, where per-sample GEMMs re-read the weights. These kernels are
verified on the CPU in float32 (the exact recipes); in bfloat16 the convolutions keep the stock
kernels and invariance is not verified.

**On accelerators** the CPU kernels above never run. cuBLAS and cuDNN also pick algorithms by
shape, so the only guarantee is to give every image the shapes it has alone:
:func:`make_per_sample` makes a module (text encoders, the denoiser) run one call per sample and
concatenate, and the VAE decodes with diffusers' slicing (one image at a time). That costs the
batching itself; it is the pool option ``batch_invariant`` (measured by ``bench.pipeline.gpu_checks``,
off by default on GPUs unless it costs under 10 %). ERNIE-Image cannot be made invariant: its
pipeline pads every prompt's text to the batch's longest, so batch-mates change the transformer's
input (``infra.pools.FAMILIES``: ``batch_invariant=False``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Keyword arguments that are never batched (FLUX's position ids and rotary embeddings).
_UNBATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "return_dict", "joint_attention_kwargs",
                        "cross_attention_kwargs", "attention_kwargs"})
#: Keyword arguments that are lists of batched tensors, one per block (the ControlNet residuals a
#: UNet, SD3's transformer and FLUX.1's take): each tensor is split, never the list.
_PER_BLOCK = frozenset({"down_block_additional_residuals", "down_intrablock_additional_residuals",
                        "block_controlnet_hidden_states", "controlnet_block_samples",
                        "controlnet_single_block_samples"})

_MARK = "_renderfarm_batch_invariant"
#: Set on a module whose kernels are not verified batch invariant (OpenVINO's UNet): under the
#: CPU kernels it runs one call per sample (:func:`make_per_sample`).
PER_SAMPLE = "_renderfarm_per_sample_for_invariance"


def _linear_per_sample(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2 or x.shape[0] == 1:
        return F.linear(x, self.weight, self.bias)
    parts = []
    for sample in x.split(1):
        if sample.data_ptr() % 64:  # keep the alignment a lone input would have
            sample = sample.clone()
        parts.append(F.linear(sample, self.weight, self.bias))
    return torch.cat(parts)


def _conv_onednn(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if (x.device.type == "cpu" and x.dtype == torch.float32 and self.padding_mode == "zeros"
            and not isinstance(self.padding, str) and torch.backends.mkldnn.is_available()):
        return torch.ops.aten.mkldnn_convolution(
            x, self.weight, self.bias, list(self.padding), list(self.stride), list(self.dilation), self.groups
        )
    return self._conv_forward(x, self.weight, self.bias)


def _group_norm_nchw(self: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4 and x.shape[2] * x.shape[3] >= 1024:  # ATen's channels-last kernel splits here
        x = x.contiguous()
    return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def _contiguous_output(module: nn.Module, args, output):
    return output.contiguous() if torch.is_tensor(output) and output.dim() == 4 else output


def make_batch_invariant(module: nn.Module) -> int:
    """Patch the Linear, Conv2d, GroupNorm and diffusers Attention modules of ``module``.

    In place and idempotent (patched modules are marked).

    Outputs keep their shapes and dtypes; only the kernel choice changes. Returns how many
    submodules were patched by this call.
    """
    patched = 0
    for sub in module.modules():
        if getattr(sub, _MARK, False):
            continue
        if type(sub) is nn.Linear:
            sub.forward = _linear_per_sample.__get__(sub)  # type: ignore[method-assign]  # patched forward
        elif type(sub) is nn.Conv2d:
            sub.forward = _conv_onednn.__get__(sub)  # type: ignore[method-assign]  # patched forward
        elif type(sub) is nn.GroupNorm:
            sub.forward = _group_norm_nchw.__get__(sub)  # type: ignore[method-assign]  # patched forward
        elif type(sub).__name__ == "Attention" and type(sub).__module__.startswith("diffusers."):
            sub.register_forward_hook(_contiguous_output)  # its NCHW output is a channels-last view
        else:
            continue
        setattr(sub, _MARK, True)
        patched += 1
    return patched


def _batch_of(args, kwargs) -> int:
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value) and value.dim() > 0:
            return value.shape[0]
    return 1


def _take(value, i: int, n: int):
    if torch.is_tensor(value):
        return value[i:i + 1] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _take(v, i, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and len(value) == n and all(torch.is_tensor(v) for v in value):
        return type(value)(value[i:i + 1])
    return value


def _take_each(value, i: int, n: int):
    """Sample ``i`` of each batched tensor of a list or tuple (None and other values as they are)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_take(v, i, n) for v in value)
    return value


def _batch_dim(tensors: list[torch.Tensor]) -> int:
    """The dimension that holds the batch in outputs of batch-1 calls: the first one of size 1 in
    all of them (0 for batch-first outputs; 1 for ChatGLM's sequence-first hidden states, shaped
    (tokens, batch, hidden)); 0 when none is."""
    for dim in range(tensors[0].dim()):
        if all(t.dim() > dim and t.shape[dim] == 1 for t in tensors):
            return dim
    return 0


def _concat(outputs: list):
    first = outputs[0]
    if torch.is_tensor(first):
        return torch.cat(outputs, dim=_batch_dim(outputs)) if first.dim() > 0 else first
    if first is None:
        return None
    if isinstance(first, dict):  # diffusers / transformers ModelOutput are ordered dicts
        return type(first)(**{k: _concat([o[k] for o in outputs]) for k in first.keys()})
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([o[j] for o in outputs]) for j in range(len(first)))
    return first


def make_per_sample(module: nn.Module) -> bool:
    """Make ``module`` compute a batch of n as n calls of batch 1 and concatenate: every GEMM,
    convolution and attention then has the shapes a lone request has, whatever kernels the
    device picks. Input tensors whose first dimension is the batch are split (also inside dicts,
    e.g. SDXL's ``added_cond_kwargs``); FLUX's position ids are not. Outputs are concatenated
    along their batch dimension, the first of size 1 in every call's output (dimension 1 for
    ChatGLM's (tokens, batch, hidden) states). Idempotent; returns True when it patched
    ``module`` now."""
    if getattr(module, "_renderfarm_per_sample", False):
        return False
    forward = module.forward

    def per_sample(*args, **kwargs):
        n = _batch_of(args, kwargs)
        if n <= 1:
            return forward(*args, **kwargs)
        outputs = [forward(*(_take(a, i, n) for a in args),
                           **{k: v if k in _UNBATCHED else _take_each(v, i, n) if k in _PER_BLOCK
                              else _take(v, i, n) for k, v in kwargs.items()})
                   for i in range(n)]
        return _concat(outputs)

    module.forward = per_sample
    module._renderfarm_per_sample = True  # type: ignore[assignment]  # a plain marker attribute
    return True
