"""The video renderer on the tiny Wan and LTX-Video builds (real diffusers classes, random weights):
frame count and size, seeds, step reports and stopping, image-to-video, requests it must refuse."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from infra.schemas import RenderRequest
from infra.video import frames_of

MODELS = ("tiny-wan", "tiny-ltx")


@pytest.fixture(scope="module")
def renderers(offline_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("RENDERFARM_CACHE_DIR", str(offline_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    from pipeline.warm import prepare_renderer

    yield {m: prepare_renderer(m, "cpu", "exact")[0] for m in MODELS}
    mp.undo()
    get_settings.cache_clear()


def video(model: str, **kw) -> RenderRequest:
    fields = {"prompt": "a red fox running in the snow", "model": model, "seed": 3, "width": 64, "height": 64,
              "num_inference_steps": 2, "guidance_scale": 5.0, "kind": "video", "num_frames": 9, **kw}
    return RenderRequest(**fields)


def clip(renderer, request: RenderRequest, on_step=None) -> np.ndarray:
    (poster,) = renderer.render([request], on_step)
    frames, _ = frames_of(poster)
    assert np.array_equal(np.asarray(poster), frames[0])  # the poster is the first frame
    return frames


@pytest.mark.parametrize("model", MODELS)
def test_renders_the_asked_frames_and_size_as_uint8(renderers, model):
    renderer = renderers[model]
    assert renderer.family == model.removeprefix("tiny-") and renderer.max_batch_size == 1
    (poster,) = renderer.render([video(model, num_frames=17, width=96, height=64, fps=12)])
    frames, fps = frames_of(poster)
    assert frames.dtype == np.uint8 and frames.shape == (17, 64, 96, 3) and fps == 12
    assert poster.size == (96, 64) and poster.mode == "RGB"
    assert frames.std() > 1  # not a blank clip


@pytest.mark.parametrize("model", MODELS)
def test_a_seed_gives_the_same_frames_and_another_seed_others(renderers, model):
    renderer = renderers[model]
    first, again = clip(renderer, video(model)), clip(renderer, video(model))
    other = clip(renderer, video(model, seed=4))
    assert np.array_equal(first, again)
    assert np.abs(first.astype(int) - other).mean() > 0.5  # measured: tiny-wan 1.5, tiny-ltx 36.5 (2 steps)


@pytest.mark.parametrize("model", MODELS)
def test_each_step_is_reported_and_an_exception_stops_the_render_between_steps(renderers, model):
    renderer = renderers[model]
    calls: list[int] = []
    hook = renderer.pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        steps: list[tuple[int, int]] = []
        clip(renderer, video(model, num_inference_steps=6), lambda s, t: steps.append((s, t)))
        assert steps == [(i, 6) for i in range(1, 7)]
        per_step = len(calls) // 6
        calls.clear()

        def cancel(step: int, total: int) -> None:
            steps.append((step, total))
            if step == 2:
                raise TimeoutError("past the job's timeout")

        steps.clear()
        with pytest.raises(TimeoutError):
            renderer.render([video(model, num_inference_steps=6)], cancel)
        assert steps == [(1, 6), (2, 6)] and len(calls) == 2 * per_step  # no third step's transformer calls
    finally:
        hook.remove()


def test_ltx_image_to_video_reads_the_init_image_through_the_loader(renderers):
    renderer = renderers["tiny-ltx"]
    images = {"inputs/red.png": PIL.Image.new("RGB", (80, 80), (250, 20, 20)),
              "inputs/blue.png": PIL.Image.new("RGB", (48, 48), (20, 20, 250))}
    read: list[str] = []
    renderer.input_loader = lambda key: read.append(key) or images[key]
    try:
        t2v = clip(renderer, video("tiny-ltx", num_inference_steps=4)).astype(int)
        red = clip(renderer, video("tiny-ltx", num_inference_steps=4, init_image="inputs/red.png")).astype(int)
        blue = clip(renderer, video("tiny-ltx", num_inference_steps=4, init_image="inputs/blue.png")).astype(int)
    finally:
        renderer.input_loader = None
    assert read == ["inputs/red.png", "inputs/blue.png"]
    assert red.shape == t2v.shape == (9, 64, 64, 3)
    # LTXImageToVideoPipeline.from_pipe: the same component objects, no second copy of the weights
    assert renderer._i2v.transformer is renderer.pipe.transformer and renderer._i2v.vae is renderer.pipe.vae
    # the image conditions the clip (with random VAE weights its first frame does not resemble it:
    # measured 110.4 vs 110.6 mean distance to a red image, so that is not asserted)
    assert np.abs(red - t2v).mean() > 5 and np.abs(red - blue).mean() > 1


def test_requests_a_family_cannot_render_fail_alone_with_the_reason(renderers):
    wan, ltx = renderers["tiny-wan"], renderers["tiny-ltx"]
    wan.input_loader = lambda key: PIL.Image.new("RGB", (64, 64))
    try:
        with pytest.raises(ValueError, match="init_image.*image-to-video"):
            wan.render([video("tiny-wan", init_image="inputs/a.png")])
    finally:
        wan.input_loader = None
    with pytest.raises(ValueError, match="no input loader"):
        ltx.render([video("tiny-ltx", init_image="inputs/a.png")])
    with pytest.raises(ValueError, match="num_frames.*4k\\+1"):
        wan.render([video("tiny-wan", num_frames=10)])
    with pytest.raises(ValueError, match="num_frames.*8k\\+1"):
        ltx.render([video("tiny-ltx", num_frames=13)])
    with pytest.raises(ValueError, match="own scheduler"):
        wan.render([video("tiny-wan", scheduler="euler")])
    with pytest.raises(ValueError, match="num_inference_steps: .*renders at least 2"):
        ltx.render([video("tiny-ltx", num_inference_steps=1)])


def test_a_clip_over_what_the_workers_memory_holds_fails_alone_before_rendering(renderers):
    wan = renderers["tiny-wan"]
    saved = wan.recipe.get("max_frames")
    wan.recipe["max_frames"] = {"max_frames": 9, "width": 64, "height": 64}  # as measured at start-up
    try:
        assert wan.frames_limit(64, 64) == 9 and wan.frames_limit(32, 64) == 18  # half the pixels, twice the frames
        with pytest.raises(ValueError, match="13 frames at 64x64 would not fit this worker's memory"):
            wan.render([video("tiny-wan", num_frames=13)])
        assert frames_of(wan.render([video("tiny-wan", num_frames=9)])[0])[0].shape[0] == 9
    finally:
        wan.recipe["max_frames"] = saved


@pytest.mark.parametrize("model, frames, fps", [("tiny-wan", 5, 16), ("tiny-ltx", 9, 25)])
def test_a_warm_up_image_request_renders_the_shortest_clip(renderers, model, frames, fps):
    # the warm-up's 1-step image request (pipeline.warm.warm_up): LTX-Video renders its 2 steps instead
    steps: list[int] = []
    (poster,) = renderers[model].render([RenderRequest(prompt="warm-up", model=model, seed=0, width=64, height=64,
                                                       num_inference_steps=1)], lambda s, t: steps.append(t))
    clip_frames, clip_fps = frames_of(poster)
    assert clip_frames.shape == (frames, 64, 64, 3) and clip_fps == fps  # 4k+1 / 8k+1 frames, the family's fps
    assert steps[-1] == (2 if model == "tiny-ltx" else 1)
