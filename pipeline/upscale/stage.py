"""The upscaling stage: a group's decoded images → ``upscale``× larger images, on the same device.

Place in the data flow: worker → :class:`pipeline.render.Renderer` renders a group → **here**, when
the group's requests ask for ``upscale`` with an ``upscaler`` → storage (the result's width and
height are the upscaled size).

This is the second half of the Rapid Diffusion path (Alibaba PAI with South China University of
Technology, ACL 2023): render small, then upscale with a pre-trained ESRGAN network instead of a
second diffusion pass. The group's images go through the network as one batch, in tiles with
overlap (:mod:`pipeline.upscale.tiles`), so memory is bounded by the tile. A network whose own
scale differs from the requested factor (a ×4 network asked for ×2) is followed by an antialiased
bicubic resize to the requested size, as Real-ESRGAN's ``--outscale`` does with a resize.

Diffusion upscalers (diffusers' SD ×4 upscaler and ×2 latent upscaler, :mod:`pipeline.upscale.diffusion`)
are the alternative to a second diffusion pass at full size: they take the requests' prompts,
negative prompts and seeds, run :class:`DiffusionSettings` steps, the ×4 one in
``diffusion_tile``-pixel input tiles (128: the low-resolution crop size it was trained on).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch.nn import functional as F

from pipeline.upscale.diffusion import (
    DiffusionSettings,
    DiffusionUpscaler,
    is_diffusion_upscaler,
    load_diffusion_upscaler,
)
from pipeline.upscale.tiles import upscale_tiled
from pipeline.upscale.weights import load_upscaler

DEFAULT_TILE = 256
DEFAULT_PAD = 16
DEFAULT_DIFFUSION_TILE = 128


class UpscaleStage:
    """Loads upscalers on first use and runs them on batches of PIL images.

    Args:
        device: where the networks run (the renderer's device).
        dtype: their dtype (float32 on CPUs; float16 is fine on GPUs).
        tile, pad: input tile side and overlap, pixels (:func:`pipeline.upscale.tiles.upscale_tiled`).
        allowed: the upscaler specs this worker may load (its pool's); None = any.
        diffusion: steps, guidance and noise level of the diffusion upscalers.
        diffusion_tile: input tile side of the SD ×4 upscaler, pixels (0: untiled).
    """

    def __init__(self, *, device: str = "cpu", dtype: torch.dtype = torch.float32, tile: int = DEFAULT_TILE,
                 pad: int = DEFAULT_PAD, allowed: Sequence[str] | None = None, cache_dir: Path | None = None,
                 diffusion: DiffusionSettings | None = None, diffusion_tile: int = DEFAULT_DIFFUSION_TILE) -> None:
        self.device, self.dtype, self.tile, self.pad = device, dtype, tile, pad
        self.diffusion = diffusion or DiffusionSettings()
        self.diffusion_tile = diffusion_tile
        self.allowed = None if allowed is None else tuple(allowed)
        self.cache_dir = cache_dir
        self._nets: dict[str, torch.nn.Module] = {}
        self._lock = threading.Lock()

    def network(self, spec: str) -> torch.nn.Module:
        """The loaded network of ``spec`` (loaded on first use).

        Raises:
            ValueError: ``spec`` is not among :attr:`allowed`, or cannot be loaded.
        """
        if self.allowed is not None and spec not in self.allowed:
            allowed = ", ".join(self.allowed) or "none"
            raise ValueError(f"upscaler {spec!r} is not one of this worker's pool's ({allowed}; without a declared "
                             f"pool, RENDERFARM_UPSCALERS)")
        with self._lock:
            if spec not in self._nets:
                if is_diffusion_upscaler(spec):
                    try:
                        self._nets[spec] = load_diffusion_upscaler(spec, device=self.device, dtype=self.dtype,
                                                                   cache_dir=self.cache_dir)
                    except OSError as exc:  # offline hub id, a directory without a pipeline
                        raise ValueError(f"upscaler {spec!r} cannot be loaded: {exc}") from exc
                else:
                    self._nets[spec] = load_upscaler(spec, device=self.device, dtype=self.dtype,
                                                     cache_dir=self.cache_dir)
            return self._nets[spec]

    def upscale_tensor(self, images: torch.Tensor, spec: str, factor: int, *, prompts: Sequence[str] | None = None,
                       negative_prompts: Sequence[str | None] | None = None,
                       seeds: Sequence[int] | None = None) -> torch.Tensor:
        """``(N, 3, H, W)`` float images in 0…1 → ``(N, 3, H·factor, W·factor)`` in 0…1, float32, on
        :attr:`device`. ``prompts``, ``negative_prompts`` and ``seeds`` (one per image; default
        empty prompts and seeds 0…N-1) condition a diffusion upscaler; an ESRGAN network ignores them."""
        net = self.network(spec)
        n = images.shape[0]
        with torch.inference_mode():
            x = images.to(device=self.device, dtype=self.dtype)
            if isinstance(net, DiffusionUpscaler):
                generators = [torch.Generator("cpu").manual_seed(int(s)) for s in (seeds or range(n))]
                out = net.upscale(x, list(prompts or [""] * n), list(negative_prompts or [None] * n), generators,
                                  self.diffusion, tile=self.diffusion_tile, pad=self.pad)
            else:
                scale: int = net.scale  # type: ignore[assignment]  # RRDBNet.scale: an int attribute
                out = upscale_tiled(net, x, scale=scale, tile=self.tile, pad=self.pad).float()
            height, width = images.shape[-2] * factor, images.shape[-1] * factor
            if out.shape[-2:] != (height, width):
                out = F.interpolate(out, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
            return out.clamp_(0.0, 1.0)

    def upscale(self, images: Sequence[PIL.Image.Image], spec: str, factor: int, *,
                prompts: Sequence[str] | None = None, negative_prompts: Sequence[str | None] | None = None,
                seeds: Sequence[int] | None = None) -> list[PIL.Image.Image]:
        """Upscale equally sized RGB images by ``factor`` (2 or 4) with upscaler ``spec``, in one batch
        (prompts, negative prompts and seeds as :meth:`upscale_tensor`).

        Raises:
            ValueError: the images differ in size, or as :meth:`network`.
        """
        if not images:
            return []
        if len({im.size for im in images}) > 1:
            raise ValueError("the images of one upscale call must share a size")
        batch = torch.from_numpy(np.stack([np.asarray(im.convert("RGB")) for im in images])).permute(0, 3, 1, 2)
        out = self.upscale_tensor(batch.float().div_(255.0), spec, factor, prompts=prompts,
                                  negative_prompts=negative_prompts, seeds=seeds)
        arrays = (out * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [PIL.Image.fromarray(a) for a in arrays]
