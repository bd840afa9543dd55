"""Wan 2.1 image-to-video (``wan-i2v``) on the tiny build (diffusers' WanImageToVideoPipeline with
random weights): frames from an init image read through the input loader, seeds, the image's
effect, the refusals, the warm-up from a grey image, First Block Cache on its blocks, and the
full-size 14B architecture counted on the ``meta`` device."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from infra.schemas import RenderRequest
from infra.video import frames_of
from pipeline.models import OFFLINE_MODELS, parameter_counts

MODEL = "tiny-wan-i2v"
RED, BLUE = "inputs/red.png", "inputs/blue.png"
IMAGES = {RED: PIL.Image.new("RGB", (80, 80), (250, 20, 20)), BLUE: PIL.Image.new("RGB", (48, 48), (20, 20, 250))}


@pytest.fixture(scope="module")
def cache(offline_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("RENDERFARM_CACHE_DIR", str(offline_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    yield offline_cache
    mp.undo()
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def renderer(cache):
    from pipeline.warm import prepare_renderer

    return prepare_renderer(MODEL, "cpu", "exact")[0]


@pytest.fixture
def read(renderer):
    keys: list[str] = []

    def loader(key: str) -> PIL.Image.Image:
        keys.append(key)
        return IMAGES[key]

    renderer.input_loader = loader
    yield keys
    renderer.input_loader = None


def video(**kw) -> RenderRequest:
    fields = {"prompt": "a red fox running in the snow", "model": MODEL, "seed": 3, "width": 64, "height": 64,
              "num_inference_steps": 2, "guidance_scale": 5.0, "kind": "video", "num_frames": 9, "init_image": RED,
              **kw}
    return RenderRequest(**fields)


def video_of(poster: PIL.Image.Image) -> tuple[np.ndarray, int]:
    attached = frames_of(poster)
    assert attached is not None, "no frames attached: an image, not a clip"
    return attached


def clip(renderer, request: RenderRequest) -> np.ndarray:
    (poster,) = renderer.render([request])
    frames, _ = video_of(poster)
    assert np.array_equal(np.asarray(poster), frames[0])
    return frames.astype(int)


def test_the_pinned_pipeline_is_wans_image_to_video_pipeline(renderer):
    pipe = renderer.pipe
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and renderer.family == "wan-i2v"
    assert pipe.transformer.config.in_channels == 36 and pipe.transformer.config.image_dim == 32
    assert type(pipe.image_encoder).__name__ == "CLIPVisionModel" and pipe.transformer_2 is None
    assert renderer.describe()["video"]["needs_image"] is True


def test_renders_the_asked_frames_from_the_init_image_read_through_the_loader(renderer, read):
    (poster,) = renderer.render([video(num_frames=13, width=96, height=64, fps=12)])
    frames, fps = video_of(poster)
    assert read == [RED]
    assert frames.dtype == np.uint8 and frames.shape == (13, 64, 96, 3) and fps == 12
    assert poster.size == (96, 64) and frames.std() > 1
    assert renderer._i2v is None  # no second pipeline: the pinned one takes the image


def test_a_seed_gives_the_same_frames_and_the_init_image_changes_them(renderer, read):
    red, again, blue = clip(renderer, video()), clip(renderer, video()), clip(renderer, video(init_image=BLUE))
    assert read == [RED, RED, BLUE]
    assert np.array_equal(red, again)
    # measured on the tiny build (2 steps): mean 1.57 of 255 between the red and the blue first frame's clips
    assert np.abs(red - blue).mean() > 0.5
    assert np.abs(red - clip(renderer, video(seed=4))).mean() > 0.5  # measured 1.81


def test_a_clip_without_an_image_or_without_a_loader_fails_with_the_reason(renderer, read):
    with pytest.raises(ValueError, match="init_image: .*image-to-video only: send an init_image"):
        renderer.render([video(init_image=None)])
    assert read == []
    renderer.input_loader = None
    with pytest.raises(ValueError, match="no input loader"):
        renderer.render([video()])
    with pytest.raises(ValueError, match="num_frames.*4k\\+1"):
        renderer.render([video(num_frames=10)])


def test_the_warm_up_renders_the_shortest_clip_from_a_grey_image(renderer):
    grey: list[PIL.Image.Image] = []
    hook = renderer.pipe.video_processor.preprocess

    def seen(image, *args, **kwargs):
        grey.append(image)
        return hook(image, *args, **kwargs)

    renderer.pipe.video_processor.preprocess = seen
    try:
        (poster,) = renderer.render([RenderRequest(prompt="warm-up", model=MODEL, seed=0, width=64, height=64,
                                                   num_inference_steps=1)])
    finally:
        del renderer.pipe.video_processor.preprocess
    frames, fps = video_of(poster)
    assert frames.shape == (5, 64, 64, 3) and fps == 16
    [image] = grey
    assert image.size == (64, 64) and image.getextrema() == ((128, 128),) * 3  # uniform grey


def test_first_block_cache_covers_the_image_to_video_blocks(cache):
    from pipeline.video.apply import cache_hooked_blocks
    from pipeline.warm import prepare_renderer

    cached, _ = prepare_renderer(MODEL, "cpu", "fast", '{"step_cache": true, "step_cache_threshold": 0.05}')
    assert len(cache_hooked_blocks(cached.pipe.transformer)) == 2  # both WanTransformerBlocks
    assert cached.recipe["report"]["applied"]["step_cache"]["blocks"] == 2
    cached.input_loader = IMAGES.__getitem__
    assert clip(cached, video(num_inference_steps=3)).shape == (9, 64, 64, 3)


def test_the_14b_architecture_counts_its_published_parameters_on_meta():
    counts = parameter_counts("wan2.1-i2v-14b-arch")
    d, ffn = 5120, 13824
    # per layer: self-attention, cross-attention with the image's added keys/values (10 d² + 10 d),
    # the FFN, norms and modulation; patch/text/time/image embeddings and the head add ~1.5 %
    per_layer = 10 * (d * d + d) + 2 * d * ffn + ffn + 14 * d
    assert counts["transformer"] == pytest.approx(40 * per_layer, rel=0.05)
    assert counts["transformer"] == 16_394_878_784
    # OpenCLIP ViT-H/14's image tower is 632.08M with its 1280 × 1024 projection, which the pipeline does not use
    assert counts["image_encoder"] == pytest.approx(632.08e6 - 1280 * 1024, rel=0.001)
    assert counts["text_encoder"] == 5_680_910_336  # UMT5-XXL, as Wan 2.1 T2V's
    for component, published in OFFLINE_MODELS["wan2.1-i2v-14b-arch"].published_params.items():
        assert counts[component] == pytest.approx(published, rel=0.005), component
    assert not OFFLINE_MODELS["wan2.1-i2v-14b-arch"].disk
