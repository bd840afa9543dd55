"""The dashboard's outputs in headless Chromium, against the session farm: the gallery shows the
newest images as thumbnails loaded straight from SeaweedFS through presigned URLs (which the
page's Content-Security-Policy must allow), a click shows one full size with the parameters
embedded in it, and a failed job's retry button puts it back in its queue.

Screenshots: ``test-artifacts/browser/gallery*.png``, ``retry.png``.
"""

from __future__ import annotations

import time

import httpx
import pytest

from infra.schemas import RenderRequest

from .conftest import POISON, POISON_POOL
from .test_dashboard import open_dashboard, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def test_gallery_shows_the_newest_images_from_the_bucket(page, client, farm_env, s3_server, artifacts):
    url = farm_env["RENDERFARM_API_URL"]
    csp = httpx.get(url + "/", timeout=10).headers["content-security-policy"]
    assert f"img-src 'self' data: {s3_server.url};" in csp and f"media-src 'self' data: {s3_server.url};" in csp, csp
    batch = client.submit_batch([RenderRequest(prompt=f"a lantern in the fog, study {i}", model="tiny", width=64,
                                               height=64, num_inference_steps=3, seed=40 + i) for i in range(3)])
    jobs = client.wait(batch.batch_id, timeout=600)
    assert [j.state for j in jobs] == ["succeeded"] * 3
    open_dashboard(page, url)
    newest = [figure.get_attribute("data-key") for figure in page.locator("#gallery figure").all()[:3]]
    assert set(newest) == {j.job_id for j in jobs}, "the newest images come first"
    for job in jobs:
        thumb = f'#gallery figure[data-key="{job.job_id}"] img'
        # loaded from S3 itself: the presigned URL works and the CSP let it in
        assert wait_until(page, thumb, "e => e.complete && e.naturalWidth === 64 && e.naturalHeight === 64")
        src = page.locator(thumb).get_attribute("src")
        assert src.startswith(f"{s3_server.url}/") and "X-Amz-Signature=" in src and job.job_id in src
    page.screenshot(path=str(artifacts / "gallery.png"), full_page=True)

    chosen = jobs[1]
    page.locator(f'#gallery figure[data-key="{chosen.job_id}"] button').click()
    viewer = page.locator("#viewer")
    viewer.wait_for(state="visible", timeout=15_000)
    assert wait_until(page, "#viewer-img", "e => e.complete && e.naturalWidth === 64")
    params = page.locator("#viewer-params").text_content()
    assert params.startswith("a lantern in the fog, study 1\n") and "Seed: 41" in params
    assert "Sampler: DDIM" in params, "the infotext names the tiny model's real scheduler"
    page.screenshot(path=str(artifacts / "gallery-viewer.png"))
    page.locator("#viewer-close").click()
    viewer.wait_for(state="hidden", timeout=5_000)


def test_a_failed_jobs_retry_button_puts_it_back_in_its_queue(page, client, poison_worker, farm_env, artifacts):
    batch = client.submit_batch([RenderRequest(prompt=f"{POISON}: retry me", model=POISON_POOL, width=64, height=64,
                                               seed=11)])
    [failed] = client.wait(batch.batch_id, timeout=120)
    assert failed.state == "failed"
    open_dashboard(page, farm_env["RENDERFARM_API_URL"])
    button = page.locator(f'#failed tr[data-key="{failed.job_id}"] button.retry')
    button.wait_for(timeout=15_000)
    page.screenshot(path=str(artifacts / "retry.png"), full_page=True)
    button.click()
    # the POST reached the farm: the job ran again on the poison worker, and failed again later
    deadline = time.monotonic() + 120
    while True:
        again = client.job(failed.job_id)
        if again.state == "failed" and again.finished_at > failed.finished_at:
            break
        assert time.monotonic() < deadline, f"the job was not retried: {again}"
        time.sleep(0.5)
    assert again.attempts > failed.attempts
