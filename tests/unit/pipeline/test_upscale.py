"""The upscaling stage: RRDBNet in the published Real-ESRGAN key layout, weight files, tiling, the
stage's sizes, and a renderer that upscales a group."""

from __future__ import annotations

import PIL.Image
import pytest
import torch

from infra import pools
from infra.schemas import RenderRequest
from pipeline.upscale import OFFLINE_UPSCALERS, RRDBConfig, RRDBNet, UpscaleStage, load_upscaler, upscale_tiled
from pipeline.upscale.diffusion import OFFLINE_DIFFUSION_UPSCALERS
from pipeline.upscale.rrdbnet import config_from_state_dict
from pipeline.upscale.tiles import tile_windows
from pipeline.upscale.weights import random_rrdbnet

TINY = OFFLINE_UPSCALERS["tiny-esrgan-x4"]


def published_keys(num_block: int) -> set[str]:
    """The state-dict keys of Real-ESRGAN's RRDBNet checkpoints (RealESRGAN_x4plus.pth,
    ``params_ema``), written out by hand from the published layout."""
    keys = {f"{m}.{p}" for m in ("conv_first", "conv_body", "conv_up1", "conv_up2", "conv_hr", "conv_last")
            for p in ("weight", "bias")}
    for n in range(num_block):
        for rdb in (1, 2, 3):
            for conv in range(1, 6):
                keys |= {f"body.{n}.rdb{rdb}.conv{conv}.{p}" for p in ("weight", "bias")}
    return keys


def test_the_state_dict_has_the_published_key_layout_and_shapes():
    net = RRDBNet(RRDBConfig(scale=4, num_feat=64, num_block=23, num_grow_ch=32))
    state = net.state_dict()
    assert set(state) == published_keys(23)
    assert state["body.0.rdb1.conv1.weight"].shape == (32, 64, 3, 3)
    assert state["body.22.rdb3.conv5.weight"].shape == (64, 64 + 4 * 32, 3, 3)
    assert state["conv_first.weight"].shape == (64, 3, 3, 3)
    assert sum(p.numel() for p in net.parameters()) == 16_697_987  # RealESRGAN_x4plus: 16.7 M


@pytest.mark.parametrize("scale, in_ch", [(4, 3), (2, 12), (1, 48)])
def test_the_config_is_read_back_from_a_state_dict(scale, in_ch):
    config = RRDBConfig(scale=scale, num_feat=16, num_block=2, num_grow_ch=8)
    state = RRDBNet(config).state_dict()
    assert state["conv_first.weight"].shape[1] == in_ch
    assert config_from_state_dict(state) == config


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_weights_load_from_a_pth_or_safetensors_file(tmp_path, suffix):
    config = RRDBConfig(scale=2, num_feat=16, num_block=2, num_grow_ch=8)
    net = random_rrdbnet(config, seed=3).eval()
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    path = tmp_path / f"RealESRGAN_x2plus{suffix}"
    if suffix == ".pth":
        torch.save({"params_ema": state}, path)  # the Real-ESRGAN release wraps the weights like this
    else:
        from safetensors.torch import save_file

        save_file(state, str(path))
    loaded = load_upscaler(str(path))
    assert loaded.config == config
    x = torch.rand(1, 3, 16, 24)
    with torch.inference_mode():
        assert torch.equal(loaded(x), net(x))
    assert loaded(x).shape == (1, 3, 32, 48)


def test_a_missing_file_and_an_unknown_name_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_upscaler(str(tmp_path / "nope.pth"))
    with pytest.raises(ValueError, match="not an offline upscaler"):
        load_upscaler("no-such-upscaler")


def test_tiled_and_untiled_agree_when_the_overlap_covers_the_receptive_field():
    net = random_rrdbnet(TINY).eval()
    x = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = net(x)
        tiled = upscale_tiled(net, x, scale=4, tile=16, pad=24)  # one RRDB: radius 18 input pixels
    assert len(tile_windows(40, 56, 16)) == 12
    assert tiled.shape == whole.shape == (2, 3, 160, 224)
    torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=1e-5)


def test_with_a_short_overlap_only_the_pixels_near_inner_seams_differ():
    net = random_rrdbnet(TINY).eval()
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = net(x)
        tiled = upscale_tiled(net, x, scale=4, tile=32, pad=2)
    differs = (tiled - whole).abs().amax(dim=1)[0] > 1e-5
    rows, cols = torch.nonzero(differs, as_tuple=True)
    assert len(rows)  # the overlap is shorter than the receptive field: seams show
    # every differing output pixel lies within the receptive field (18 input px) of the inner seam at 32
    near_seam = ((rows // 4 - 32).abs() <= 20) | ((cols // 4 - 32).abs() <= 20)
    assert bool(near_seam.all())


def test_the_stage_upscales_a_batch_to_the_requested_factor():
    stage = UpscaleStage(tile=32, pad=8, allowed=["tiny-esrgan-x4", "tiny-esrgan-x2"])
    images = [PIL.Image.new("RGB", (48, 32), (200, 30, 30)), PIL.Image.new("RGB", (48, 32), (20, 30, 230))]
    assert [im.size for im in stage.upscale(images, "tiny-esrgan-x4", 4)] == [(192, 128)] * 2
    assert [im.size for im in stage.upscale(images, "tiny-esrgan-x4", 2)] == [(96, 64)] * 2  # ×4 net, resized
    assert [im.size for im in stage.upscale(images, "tiny-esrgan-x2", 2)] == [(96, 64)] * 2
    with pytest.raises(ValueError, match="not one of this worker's pool"):
        stage.upscale(images, "esrgan-x4-arch", 4)


def test_infra_knows_every_offline_upscaler():
    """infra may not import pipeline, so ``RENDERFARM_UPSCALERS``'s default is a list of names of its
    own: exactly the upscalers built offline here, none that downloads."""
    assert set(pools.OFFLINE_UPSCALERS) == set(OFFLINE_UPSCALERS) | set(OFFLINE_DIFFUSION_UPSCALERS)


def test_a_worker_of_no_declared_pool_loads_only_the_allowed_upscalers():
    """Without a declared pool the worker passes RENDERFARM_UPSCALERS: a request naming a hub file
    is refused before anything is downloaded; a declared pool's own list wins over it."""
    from pipeline.warm import PoolOptions, prepare_renderer

    renderer, _ = prepare_renderer("tiny", "cpu", "exact", upscalers=("tiny-esrgan-x4",))
    assert renderer.upscale.allowed == ("tiny-esrgan-x4",)
    with pytest.raises(ValueError, match="RENDERFARM_UPSCALERS"):
        renderer.upscale.network("owner/repo/RealESRGAN_x4plus.pth")
    assert isinstance(renderer.upscale.network("tiny-esrgan-x4"), RRDBNet)
    declared, _ = prepare_renderer("tiny", "cpu", "exact", pool=PoolOptions(upscalers=()),
                                   upscalers=("tiny-esrgan-x4",))
    assert declared.upscale.allowed == ()


def test_the_renderer_upscales_a_group(tiny_renderer):
    requests = [RenderRequest(prompt=p, model="tiny", seed=s, width=64, height=64, num_inference_steps=1,
                              upscale=2, upscaler="tiny-esrgan-x4") for p, s in (("a fox", 1), ("一只狐狸", 2))]
    images = tiny_renderer.render(requests)
    assert [im.size for im in images] == [(128, 128)] * 2
