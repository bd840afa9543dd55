"""Tiled upscaling with overlap: memory bounded by the tile, not the image.

Place in the data flow: the upscaling stage (:mod:`pipeline.upscale.stage`) calls
:func:`upscale_tiled` on a group's decoded images, all at once (the batch is one tensor).

The image is cut into ``tile × tile`` input tiles; each is run with ``pad`` extra input pixels of
context on every side that has image there, and only its own region of the output is kept (the
tiling of Real-ESRGAN's inference script, Wang et al., ICCV 2021 workshops). Where ``pad`` is at
least the network's receptive-field radius, the kept pixels are the ones an untiled run gives; a
seam can differ only where the context was cut short, which is never at the image border (an
untiled run sees zero padding there too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def upscale_tiled(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, *, scale: int,
                  tile: int = 256, pad: int = 16) -> torch.Tensor:
    """Run ``model`` (``(N, C, h, w)`` → ``(N, C', h·scale, w·scale)``) over ``images``
    (``(N, C, H, W)``, any float dtype, on the model's device) in tiles.

    Args:
        scale: the model's output pixels per input pixel, per side.
        tile: input tile side, pixels; 0, or an image no larger than one tile, runs untiled.
        pad: input pixels of context around each tile (the overlap), clipped at the image border.
    Returns:
        ``(N, C', H·scale, W·scale)`` in the model's output dtype.
    Raises:
        ValueError: a negative ``tile`` or ``pad``.
    """
    if tile < 0 or pad < 0:
        raise ValueError(f"tile and pad must be >= 0, got tile={tile}, pad={pad}")
    n, _, height, width = images.shape
    if tile == 0 or (height <= tile and width <= tile):
        return model(images)
    out = None
    for y0 in range(0, height, tile):
        for x0 in range(0, width, tile):
            y1, x1 = min(y0 + tile, height), min(x0 + tile, width)
            py0, px0 = max(y0 - pad, 0), max(x0 - pad, 0)
            py1, px1 = min(y1 + pad, height), min(x1 + pad, width)
            result = model(images[:, :, py0:py1, px0:px1])
            if out is None:
                out = result.new_empty((n, result.shape[1], height * scale, width * scale))
            oy, ox = (y0 - py0) * scale, (x0 - px0) * scale
            out[:, :, y0 * scale:y1 * scale, x0 * scale:x1 * scale] = \
                result[:, :, oy:oy + (y1 - y0) * scale, ox:ox + (x1 - x0) * scale]
    assert out is not None  # at least one tile: height and width are positive
    return out


def tile_windows(height: int, width: int, tile: int) -> list[tuple[int, int, int, int]]:
    """The input tiles :func:`upscale_tiled` cuts, as ``(y0, y1, x0, x1)`` pixel bounds (end excluded)."""
    if tile == 0 or (height <= tile and width <= tile):
        return [(0, height, 0, width)]
    return [(y0, min(y0 + tile, height), x0, min(x0 + tile, width))
            for y0 in range(0, height, tile) for x0 in range(0, width, tile)]
