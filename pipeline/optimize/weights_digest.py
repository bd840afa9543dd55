"""Content digests of a module's weights, for cache keys that must change with any weight.

Place in the data flow: beside the caches of converted or compiled modules. The OpenVINO IR of
the UNet (:mod:`pipeline.optimize.openvino_ir`) and the AOTInductor packages of the frozen VAE
decoder (:mod:`pipeline.optimize.aot`) both hold a module's weights, so their keys hash them: a
fine-tuned or LoRA-fused module is another key, and an entry can never serve stale weights.

Hashing runs on a thread per usable core (``hashlib`` releases the GIL on large buffers): SHA-256
runs at about 1.8 GB/s on a core with the SHA extensions (the AMD EPYCs measured here) but at
0.38 GB/s on an AVX-512 Xeon without them (family 6 model 85), where one core spent about 9 s on
SD 1.5's 3.4 GB UNet.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline.device import usable_cpus


def hash_threads() -> int:
    """Threads for hashing: the CPUs this process may use (affinity and cgroup quota), at most 8."""
    return max(1, min(8, usable_cpus()))


def tensor_sha256(tensor: torch.Tensor) -> bytes:
    """SHA-256 of ``tensor``'s bytes (C-contiguous, moved to the CPU), as 32 raw bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).digest()


def update_with_weights(digest, module: torch.nn.Module) -> None:
    """Feed every tensor of ``module.state_dict()`` into ``digest`` (a ``hashlib`` object), in
    order: its name, shape and dtype, then the SHA-256 of its bytes. Cost: one pass over the
    weights, on :func:`hash_threads` threads."""
    tensors = list(module.state_dict().items())
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        for (name, tensor), tensor_digest in zip(tensors, pool.map(tensor_sha256, (t for _, t in tensors))):
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor_digest)


__all__ = ["hash_threads", "tensor_sha256", "update_with_weights"]
