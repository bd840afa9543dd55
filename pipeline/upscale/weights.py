"""Upscaler weights: offline random-weight builds, a local ``.pth`` / safetensors file, or a hub file.

Place in the data flow: the upscaling stage (:mod:`pipeline.upscale.stage`) loads each upscaler a
request names once, on first use, and keeps it on the worker's device.

An upscaler spec is one of:

- an offline name (:data:`OFFLINE_UPSCALERS`): ``esrgan-x4-arch`` is the real ESRGAN / Real-ESRGAN
  ×4 size (23 RRDB blocks, 64 features, growth 32; 16.7 M parameters) with random weights, for
  benchmarks; ``tiny-esrgan-x4`` and ``tiny-esrgan-x2`` are one-block networks for tests;
- a local file ``….pth`` / ``….pt`` (``torch.load`` with ``weights_only``; the state dict may sit
  under ``params_ema`` or ``params``, as in the Real-ESRGAN releases) or ``….safetensors``;
- a hub file ``owner/repo/path/to/file.pth`` (downloaded with ``huggingface_hub.hf_hub_download``).

The network's shape is read from the state dict (:func:`pipeline.upscale.rrdbnet.config_from_state_dict`).
Diffusion upscalers (a hub id ``owner/name``, a directory, their offline names) are loaded by
:mod:`pipeline.upscale.diffusion` instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.upscale.rrdbnet import RRDBConfig, RRDBNet, config_from_state_dict

WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors")
#: Offline upscaler name → architecture (random weights, seeded).
OFFLINE_UPSCALERS: dict[str, RRDBConfig] = {
    "esrgan-x4-arch": RRDBConfig(scale=4, num_feat=64, num_block=23, num_grow_ch=32),
    "tiny-esrgan-x4": RRDBConfig(scale=4, num_feat=16, num_block=1, num_grow_ch=8),
    "tiny-esrgan-x2": RRDBConfig(scale=2, num_feat=16, num_block=1, num_grow_ch=8),
}
WEIGHT_SEED = 0


def random_rrdbnet(config: RRDBConfig, seed: int = WEIGHT_SEED) -> RRDBNet:
    """An RRDBNet with seeded random weights: PyTorch's default init, the trunk's convolutions
    scaled by 0.1 as ESRGAN initializes them (small residuals keep 23 blocks stable)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = RRDBNet(config)
    with torch.no_grad():
        for name, param in net.body.named_parameters():
            if name.endswith("weight"):
                param.mul_(0.1)
    return net


def read_state_dict(spec: str, *, cache_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The RRDBNet state dict of a local weight file or hub file ``spec`` (see the module docstring).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a suffix other than ``.pth``, ``.pt`` or ``.safetensors``, or a hub spec
            without ``owner/repo/file``.
    """
    if not spec.endswith(WEIGHT_SUFFIXES):
        raise ValueError(f"upscaler {spec!r}: not an offline upscaler ({', '.join(OFFLINE_UPSCALERS)}) "
                         f"nor a weight file ({', '.join(WEIGHT_SUFFIXES)})")
    path = Path(spec).expanduser()
    if not path.exists():
        if spec.startswith(("/", "./", "../", "~")) or spec.count("/") < 2:
            raise FileNotFoundError(f"upscaler weights {spec!r} do not exist (a hub file is owner/repo/file)")
        from huggingface_hub import hf_hub_download

        owner, repo, filename = spec.split("/", 2)
        path = Path(hf_hub_download(f"{owner}/{repo}", filename, cache_dir=cache_dir))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("params_ema", "params"):
        if isinstance(state, dict) and wrapper in state and isinstance(state[wrapper], dict):
            state = state[wrapper]
            break
    return state


def load_upscaler(spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  cache_dir: Path | None = None) -> RRDBNet:
    """The RRDBNet of ``spec``, in eval mode on ``device`` in ``dtype``.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_state_dict`; KeyError / RuntimeError: the
            file is not an RRDBNet state dict of the published layout.
    """
    if spec in OFFLINE_UPSCALERS:
        net = random_rrdbnet(OFFLINE_UPSCALERS[spec])
    else:
        state = read_state_dict(spec, cache_dir=cache_dir)
        net = RRDBNet(config_from_state_dict(state))
        net.load_state_dict(state, strict=True)
    return net.to(device=device, dtype=dtype).eval().requires_grad_(False)
