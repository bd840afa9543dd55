"""The dashboard at GET / in headless Chromium, against the session farm (real API, Redis,
SeaweedFS and tiny-model workers): it loads, a running batch's progress bar advances, and a job
that really failed on a worker shows its error, with its user-supplied text shown as text.

Screenshots: ``test-artifacts/browser/*.png``.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from infra.schemas import RenderRequest

from .conftest import POISON, POISON_POOL

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TITLE = "renderfarm dashboard"


def wait_until(page, selector: str, js: str, arg=None, timeout_s: float = 30.0, interval_s: float = 0.25):
    """Poll ``js`` (a function of the element at ``selector`` and ``arg``) until it returns
    something truthy; returns it. (``page.wait_for_function`` evaluates strings, which the
    page's Content-Security-Policy forbids; this calls a function through the protocol.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        value = page.locator(selector).evaluate(js, arg)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{js} on {selector} stayed falsy for {timeout_s}s")
        time.sleep(interval_s)


def open_dashboard(page, url: str) -> None:
    response = page.goto(url)
    assert response is not None and response.status == 200
    # the status line turns "live" only once the inlined script ran (its CSP hash matched)
    # and every source answered
    wait_until(page, "#status", "e => e.textContent.startsWith('live')")


def test_page_loads_with_its_tables(page, api_server, workers, farm_env, artifacts):
    url = farm_env["RENDERFARM_API_URL"]
    csp = httpx.get(url + "/", timeout=10).headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    open_dashboard(page, url)
    assert page.title() == TITLE
    for table in ("pools", "workers", "batches", "failed"):
        assert page.locator(f"table#{table} thead th").count() >= 5, table
    for worker in workers:  # each live worker gets a row, with its device and recipe
        row = page.locator(f'#workers tr[data-key="{worker.worker_name}"]')
        row.wait_for(timeout=15_000)
        cells = row.locator("td").all_text_contents()
        assert cells[1] == "tiny" and cells[2].startswith("cpu") and cells[3] not in ("", "–"), cells
        headers = page.locator("table#workers thead th").all_text_contents()
        renders = cells[headers.index("compiled / eager renders")]  # beside recompiles, from the heartbeat
        assert re.fullmatch(r"(\d+|–) / (\d+|–)|–?", renders), cells
    page.locator('#pools tr[data-key="tiny"]').wait_for(timeout=15_000)
    assert page.locator("#tput").count() == 1
    page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)


def test_a_starting_worker_shows_its_state_and_time_left(page, api_server, farm_env, artifacts):
    """A worker in ``sizing`` (its heartbeat as worker.warmup's StartupState writes it, into the
    farm's Redis) is a row at once, with the state, renders done of the state's total and the
    seconds left; once it beats ``ready`` the cell says so."""
    from infra.state import registry
    from infra.state.connect import state_client

    client, name = state_client(farm_env["RENDERFARM_REDIS_URL"]), "starting@dashboard-test"
    beat = {"name": name, "model": "tiny", "pool": "tiny", "state": "sizing", "batch_size": None,
            "warmup": {"done": 1, "total": 2, "eta_s": 12.4, "report": None},
            "startup": {"phases": {"loading": 15.7}, "estimates": {}, "state_started_at": time.time()}}
    try:
        registry.heartbeat(client, name, beat, 60)
        open_dashboard(page, farm_env["RENDERFARM_API_URL"])
        row = page.locator(f'#workers tr[data-key="{name}"]')
        row.wait_for(timeout=15_000)
        headers = page.locator("table#workers thead th").all_text_contents()
        state = lambda: row.locator("td").all_text_contents()[headers.index("state")]  # noqa: E731
        assert state() == "sizing 1/2 · ~12 s left", row.locator("td").all_text_contents()
        page.screenshot(path=str(artifacts / "dashboard-starting-worker.png"), full_page=True)
        registry.heartbeat(client, name, {**beat, "state": "ready", "batch_size": 2}, 60)
        deadline = time.monotonic() + 15
        while state() != "ready":
            assert time.monotonic() < deadline, state()
            time.sleep(0.25)
    finally:
        registry.deregister(client, name)
        client.close()


def test_running_batch_progress_advances(page, client, farm_env, artifacts):
    batch = client.submit_batch([RenderRequest(prompt=f"a lighthouse in a storm, study {i}", model="tiny",
                                               width=64, height=64, num_inference_steps=5, seed=i)
                                 for i in range(24)])
    open_dashboard(page, farm_env["RENDERFARM_API_URL"])
    bar = f'#batches tr[data-key="{batch.batch_id}"] progress'
    page.wait_for_selector(bar, timeout=15_000)
    first = page.eval_on_selector(bar, "e => e.value")
    assert first < 1, "the batch finished before the page could watch it"
    wait_until(page, bar, "(e, v) => e.value > v", first, timeout_s=180)
    second = page.eval_on_selector(bar, "e => e.value")
    assert second > first
    page.screenshot(path=str(artifacts / "batch-running.png"), full_page=True)
    # the page keeps following it to the end, where every job succeeded
    wait_until(page, bar, "e => e.value >= 1", timeout_s=600, interval_s=0.5)
    row = page.locator(f'#batches tr[data-key="{batch.batch_id}"]')
    wait_until(page, f'#batches tr[data-key="{batch.batch_id}"]', "e => e.textContent.includes('done')")
    assert row.locator("td").nth(5).text_content() == "24"  # succeeded
    assert client.wait(batch.batch_id, timeout=60)[0].state == "succeeded"
    page.screenshot(path=str(artifacts / "batch-done.png"), full_page=True)


def test_failed_job_shows_its_error(page, client, poison_worker, farm_env, artifacts):
    # the poison prompt is also markup: the page must show it as text, never parse it
    evil = f'<img src=x onerror="document.title=\'pwned\'"><b>{POISON}</b>'
    requests = [RenderRequest(prompt=f"a quiet harbour {i}", model=POISON_POOL, width=64, height=64, seed=i)
                for i in range(3)]
    requests.insert(1, RenderRequest(prompt=evil, model=POISON_POOL, width=64, height=64, seed=99))
    batch = client.submit_batch(requests)
    statuses = client.wait(batch.batch_id, timeout=120)
    assert [s.state for s in statuses] == ["succeeded", "failed", "succeeded", "succeeded"]
    failed = statuses[1]
    assert failed.error.type == "RuntimeError" and POISON in failed.error.message

    open_dashboard(page, farm_env["RENDERFARM_API_URL"])
    row = page.locator(f'#failed tr[data-key="{failed.job_id}"]')
    row.wait_for(timeout=15_000)
    cells = row.locator("td").all_text_contents()
    assert cells[3] == poison_worker.worker_name
    assert cells[5] == "RuntimeError"
    assert cells[6] == failed.error.message and "poison request" in cells[6]
    assert cells[7] == evil  # the prompt, verbatim as text
    assert page.locator("#failed img, #failed b").count() == 0
    assert page.title() == TITLE
    batch_row = page.locator(f'#batches tr[data-key="{batch.batch_id}"]')
    wait_until(page, f'#batches tr[data-key="{batch.batch_id}"]', "e => e.textContent.includes('1 failed')")
    assert batch_row.locator("td").nth(6).text_content() == "1"
    row.scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts / "failed-job.png"), full_page=True)
