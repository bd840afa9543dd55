"""Diffusion upscalers in the upscaling stage: diffusers' SD ×4 upscaler and ×2 latent upscaler, offline
random-weight builds, sizes, seeds and prompts, tiles, loading from a saved directory."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from infra.schemas import RenderRequest
from pipeline.models.build import parameter_counts
from pipeline.upscale import OFFLINE_DIFFUSION_UPSCALERS, DiffusionSettings, DiffusionUpscaler, UpscaleStage
from pipeline.upscale.diffusion import is_diffusion_upscaler

X4, LATENT = "tiny-sd-x4-upscaler", "tiny-sd-x2-latent-upscaler"
FAST = DiffusionSettings(steps=2)


@pytest.fixture(scope="module")
def stage() -> UpscaleStage:
    return UpscaleStage(diffusion=FAST, diffusion_tile=32, pad=8)


def _images(n: int, size: tuple[int, int] = (64, 64)) -> list[PIL.Image.Image]:
    gen = torch.Generator().manual_seed(7)
    return [PIL.Image.fromarray((torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy())
            for _ in range(n)]


def test_the_x4_architecture_is_the_published_one():
    spec = OFFLINE_DIFFUSION_UPSCALERS["sd-x4-upscaler-arch"]
    assert spec.pipeline == "StableDiffusionUpscalePipeline"
    unet = spec.components["unet"][2]
    assert unet["in_channels"] == 7 and unet["num_class_embeds"] == 1000  # latents + low-res RGB; noise level label
    counts = parameter_counts(spec)
    assert abs(counts["unet"] - 473e6) / 473e6 < 0.01  # stable-diffusion-x4-upscaler's UNet: 473 M
    assert abs(counts["text_encoder"] - 340e6) / 340e6 < 0.01  # OpenCLIP ViT-H text, 23 layers


def test_specs_are_told_apart():
    assert is_diffusion_upscaler(X4) and is_diffusion_upscaler("sd-x4-upscaler")
    assert is_diffusion_upscaler("stabilityai/stable-diffusion-x4-upscaler")
    assert not is_diffusion_upscaler("tiny-esrgan-x4") and not is_diffusion_upscaler("owner/repo/RealESRGAN_x4plus.pth")


@pytest.mark.parametrize("spec, factor", [(X4, 4), (X4, 2), (LATENT, 2), (LATENT, 4)])
def test_sizes(stage, spec, factor):
    out = stage.upscale(_images(2, (64, 48)), spec, factor, prompts=["a fox", "一只狐狸"], seeds=[1, 2])
    assert [im.size for im in out] == [(64 * factor, 48 * factor)] * 2
    assert isinstance(stage.network(spec), DiffusionUpscaler)


@pytest.mark.parametrize("spec", [X4, LATENT])
def test_the_seed_and_the_prompt_decide_the_pixels(stage, spec):
    images = _images(1)

    def run(prompt: str, seed: int) -> torch.Tensor:
        out = stage.upscale(images, spec, 2, prompts=[prompt], negative_prompts=["blurry"], seeds=[seed])
        return torch.from_numpy(np.asarray(out[0])).float()

    first = run("a red fox", 3)
    assert torch.equal(first, run("a red fox", 3))
    assert not torch.equal(first, run("a red fox", 4))
    assert not torch.equal(first, run("a lighthouse at dusk", 3))


def test_the_x4_upscaler_runs_in_tiles_and_each_tile_batch_is_the_whole_group():
    calls: list[tuple[int, ...]] = []
    stage = UpscaleStage(diffusion=FAST, diffusion_tile=32, pad=8)
    net = stage.network(X4)
    assert isinstance(net, DiffusionUpscaler)
    unet = net.pipe.unet
    hook = unet.register_forward_pre_hook(lambda _m, args: calls.append(tuple(args[0].shape)))
    try:
        stage.upscale(_images(3, (64, 64)), X4, 4, prompts=["a", "b", "c"], seeds=[0, 1, 2])
    finally:
        hook.remove()
    # 4 tiles of 32² with up to 8 pixels of context each; classifier-free guidance doubles the batch
    assert {s[0] for s in calls} == {6} and {s[1] for s in calls} == {7}
    assert {s[2:] for s in calls} == {(40, 40)} and len(calls) == 4 * FAST.steps


def test_a_saved_upscaler_loads_from_its_directory(stage, tmp_path):
    saved = tmp_path / "x4-upscaler"
    stage.network(X4).pipe.save_pretrained(saved)
    by_path = stage.upscale(_images(1), X4, 4, prompts=["a fox"], seeds=[5])
    other = UpscaleStage(diffusion=FAST, diffusion_tile=32, pad=8, allowed=[str(saved)])
    assert other.upscale(_images(1), str(saved), 4, prompts=["a fox"], seeds=[5])[0].tobytes() == by_path[0].tobytes()


def test_a_directory_of_another_pipeline_is_refused(tmp_path):
    from pipeline.models.build import construct_pipeline

    construct_pipeline("tiny").save_pretrained(tmp_path / "tiny")
    with pytest.raises(ValueError, match="not an upscale pipeline"):
        UpscaleStage().network(str(tmp_path / "tiny"))


def test_a_renderer_passes_its_requests_prompts_and_seeds(stage):
    from pipeline.models.build import construct_pipeline
    from pipeline.render import Renderer

    renderer = Renderer(construct_pipeline("tiny"), model="tiny", upscale=stage)
    requests = [RenderRequest(prompt=p, model="tiny", seed=s, width=64, height=64, num_inference_steps=2,
                              upscale=4, upscaler=X4) for p, s in (("a fox", 1), ("一只狐狸", 2))]
    images = renderer.render(requests)
    assert [im.size for im in images] == [(256, 256)] * 2
    alone = np.asarray(renderer.render(requests[1:])[0], dtype=np.int16)
    # its own seed and prompt, whatever its batch-mates (float rounding of the batched kernels aside:
    # the batch-invariant kernels cover the base pipeline, not the upscaler)
    assert np.abs(alone - np.asarray(images[1], dtype=np.int16)).max() <= 2
    assert np.abs(alone - np.asarray(images[0], dtype=np.int16)).max() > 2
