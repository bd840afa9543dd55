"""A video job in the dashboard, in headless Chromium: its gallery thumbnail is the animated WebP
preview loaded from the bucket, and the viewer plays its H.264 MP4 straight from a presigned URL
(the page's Content-Security-Policy allows the bucket in ``media-src``): the element reports the
clip's duration, seeks (range requests), and shows a decoded frame whose colours are the frame
the worker rendered at that time.

The job runs on the null renderer (``pipeline.null.null_video``: the seed's pattern shifted a
few pixels per frame), so the expected frame is known here without a model.

Screenshots: ``test-artifacts/browser/video-viewer.png`` and ``video-frame.png``.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from infra.schemas import RenderRequest
from pipeline.null import null_video

from .conftest import POISON_POOL
from .test_dashboard import open_dashboard, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration]

FRAMES, FPS = 16, 8  # 2.0 seconds
SEEK_S = 1.0  # frame 8


def test_a_video_plays_in_the_viewer_with_its_duration_and_a_decoded_frame(page, client, poison_worker, farm_env,
                                                                         s3_server, artifacts):
    url = farm_env["RENDERFARM_API_URL"]
    csp = httpx.get(url + "/", timeout=10).headers["content-security-policy"]
    assert f"media-src 'self' data: {s3_server.url};" in csp, csp
    request = RenderRequest(prompt="a teapot turning on a table", model=POISON_POOL, kind="video", num_frames=FRAMES,
                            fps=FPS, width=128, height=96, seed=5)
    [job] = client.wait(client.submit_batch([request]).batch_id, timeout=120)
    assert job.state == "succeeded", job.error
    assert job.result.content_type == "video/mp4" and job.result.duration_s == pytest.approx(FRAMES / FPS)

    open_dashboard(page, url)
    thumb = f'#gallery figure[data-key="{job.job_id}"] img'
    # the thumbnail is the animated WebP preview, from S3 itself
    assert wait_until(page, thumb, "e => e.complete && e.naturalWidth > 0")
    assert ".preview.webp" in page.locator(thumb).get_attribute("src")
    caption = page.locator(f'#gallery figure[data-key="{job.job_id}"] figcaption').text_content()
    assert caption.startswith("▶ 2 s") and "a teapot" in caption

    page.locator(f'#gallery figure[data-key="{job.job_id}"] button').click()
    page.locator("#viewer").wait_for(state="visible", timeout=15_000)
    assert page.locator("#viewer-img").is_hidden()
    duration = wait_until(page, "#viewer-video", "v => v.readyState >= 1 && v.duration", timeout_s=30)
    assert duration == pytest.approx(FRAMES / FPS, abs=0.05), "the element reads the clip's length from the MP4"
    params = page.locator("#viewer-params").text_content()
    assert params.startswith("a teapot turning on a table\n") and "Seed: 5" in params and "16 frames at 8 fps" in params

    # no controls over the picture while it is compared
    page.locator("#viewer-video").evaluate("(v, t) => { v.pause(); v.controls = false; v.currentTime = t; }", SEEK_S)
    assert wait_until(page, "#viewer-video",
                      "(v, t) => !v.seeking && v.readyState >= 2 && Math.abs(v.currentTime - t) < 0.07 && v.videoWidth",
                      SEEK_S) == 128
    page.screenshot(path=str(artifacts / "video-viewer.png"))
    shot = np.asarray(Image.open(io.BytesIO(page.locator("#viewer-video").screenshot(
        path=str(artifacts / "video-frame.png")))).convert("RGB"), dtype=np.float32)
    frames = np.asarray(null_video(request).info["renderfarm.video_frames"], dtype=np.float32)
    expected = frames[int(SEEK_S * FPS)]
    # the element scales the frame (and letterboxes it in its box): compare the colours of the
    # frame's area, resized to the frame's size, with the frame the worker rendered
    box = _content_box(shot)
    shown = np.asarray(Image.fromarray(shot[box].astype(np.uint8)).resize((128, 96)), dtype=np.float32)
    error = np.abs(shown - expected).mean()
    others = [np.abs(shown - frames[n]).mean() for n in (0, FRAMES - 1)]
    assert error < 20, f"the decoded frame differs from frame 8 by {error:.1f} levels on average"
    assert error < min(others), f"frame 8 ({error:.1f}) should match better than frames 0 and 15 ({others})"
    page.locator("#viewer-close").click()
    assert page.locator("#viewer-video").evaluate("v => v.paused")


def _content_box(shot: np.ndarray) -> tuple[slice, slice]:
    """The rows and columns of a video element's screenshot that hold the picture (letterbox bars
    are uniform: rows and columns whose pixels barely vary are cut)."""
    rows = np.where(shot.std(axis=(1, 2)) > 2.0)[0]
    cols = np.where(shot.std(axis=(0, 2)) > 2.0)[0]
    return slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)
