"""The ESRGAN generator, RRDBNet, written from its paper and the published key layout.

Place in the data flow: worker → pipeline renders a group → **the upscaling stage**
(:mod:`pipeline.upscale.stage`) runs this network on the decoded images → storage.

Source: Wang et al., "ESRGAN: Enhanced Super-Resolution Generative Adversarial Networks", ECCV 2018
workshops (Residual-in-Residual Dense Blocks without batch norm, residual scaling 0.2, nearest
upsampling + convolution); Wang et al., "Real-ESRGAN", ICCV 2021 workshops (the ×2 model feeds a
pixel-unshuffled input to the same network). The module and parameter names follow the published
Real-ESRGAN checkpoints (``conv_first``, ``body.N.rdb{1,2,3}.conv{1..5}``, ``conv_body``,
``conv_up1``, ``conv_up2``, ``conv_hr``, ``conv_last``), so their state dicts load as they are.

Why not a loader library: ``spandrel`` loads these checkpoints, but it requires torchvision, which
breaks beside this project's CPU torch build (DEVELOPERS.md: never add torchvision); the
architecture is small enough to own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class RRDBConfig(NamedTuple):
    """An RRDBNet's shape: ``scale`` (output pixels per input pixel per side: 1, 2 or 4),
    ``num_feat`` (channels of the trunk), ``num_block`` (RRDB blocks), ``num_grow_ch`` (channels
    each dense layer adds), ``num_in_ch``/``num_out_ch`` (image channels, 3 for RGB)."""

    scale: int = 4
    num_feat: int = 64
    num_block: int = 23
    num_grow_ch: int = 32
    num_in_ch: int = 3
    num_out_ch: int = 3


class ResidualDenseBlock(nn.Module):
    """Five 3×3 convolutions, each seeing the block input and every earlier output (dense
    connections); the last one's output scaled by 0.2 is added to the input (ESRGAN §3.1)."""

    def __init__(self, num_feat: int = 64, num_grow_ch: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(num_feat, num_grow_ch, 3, 1, 1)
        self.conv2 = nn.Conv2d(num_feat + num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv3 = nn.Conv2d(num_feat + 2 * num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv4 = nn.Conv2d(num_feat + 3 * num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv5 = nn.Conv2d(num_feat + 4 * num_grow_ch, num_feat, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    """Residual in Residual Dense Block: three dense blocks, residual-scaled by 0.2 (ESRGAN Fig. 4)."""

    def __init__(self, num_feat: int, num_grow_ch: int = 32) -> None:
        super().__init__()
        self.rdb1 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb2 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb3 = ResidualDenseBlock(num_feat, num_grow_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    """The ESRGAN generator: ``(N, 3, H, W)`` images in 0…1 → ``(N, 3, H·scale, W·scale)``.

    The trunk always upsamples ×4 (two nearest ×2 + conv stages); for ``scale`` 2 (1) the input
    is first pixel-unshuffled by 2 (4), as Real-ESRGAN's ×2 model does, so its input channels are
    12 (48). Output values are not clamped (the stage clamps).

    Raises:
        ValueError: ``scale`` other than 1, 2 or 4.
    """

    def __init__(self, config: RRDBConfig | None = None) -> None:
        super().__init__()
        config = config or RRDBConfig()
        if config.scale not in (1, 2, 4):
            raise ValueError(f"RRDBNet scale must be 1, 2 or 4, got {config.scale}")
        self.config = config
        in_ch = config.num_in_ch * {4: 1, 2: 4, 1: 16}[config.scale]
        nf = config.num_feat
        self.conv_first = nn.Conv2d(in_ch, nf, 3, 1, 1)
        self.body = nn.Sequential(*(RRDB(nf, config.num_grow_ch) for _ in range(config.num_block)))
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, config.num_out_ch, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    @property
    def scale(self) -> int:
        """Output pixels per input pixel, per side."""
        return self.config.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feat = x
        if self.config.scale == 2:
            feat = F.pixel_unshuffle(x, 2)
        elif self.config.scale == 1:
            feat = F.pixel_unshuffle(x, 4)
        feat = self.conv_first(feat)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


def config_from_state_dict(state: dict[str, torch.Tensor]) -> RRDBConfig:
    """The :class:`RRDBConfig` a state dict of the published layout was trained with, read from its
    shapes: blocks from the ``body.N`` indices, features and growth from the conv weights, the
    scale from ``conv_first``'s input channels (3 → ×4, 12 → ×2, 48 → ×1).

    Raises:
        KeyError: a key of the layout is missing (not an RRDBNet checkpoint, or the older ESRGAN
            ``model.N`` layout).
        ValueError: input channels that match no scale.
    """
    first = state["conv_first.weight"]
    num_feat, in_ch = int(first.shape[0]), int(first.shape[1])
    out_ch = int(state["conv_last.weight"].shape[0])
    blocks = {int(k.split(".")[1]) for k in state if k.startswith("body.")}
    grow = int(state["body.0.rdb1.conv1.weight"].shape[0]) if blocks else 32
    ratio = in_ch // out_ch if in_ch % out_ch == 0 else 0
    scale = {1: 4, 4: 2, 16: 1}.get(ratio)
    if scale is None:
        raise ValueError(f"conv_first takes {in_ch} channels for {out_ch} output channels: no RRDBNet scale fits")
    return RRDBConfig(scale=scale, num_feat=num_feat, num_block=len(blocks), num_grow_ch=grow,
                      num_in_ch=out_ch, num_out_ch=out_ch)
