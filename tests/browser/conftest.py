"""Fixtures of the browser tests: headless Chromium driven by Playwright, and a null-model worker
that fails poison prompts for real.

Chromium is Debian's (``/usr/bin/chromium``, installed by ``make setup``); Playwright's own
browser downloads are never used. Screenshots go to ``test-artifacts/browser/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.localstack import WorkerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"
#: A prompt containing this fails on the poison worker (``worker.faults``: RuntimeError).
POISON = "poison-for-the-dashboard"
POISON_POOL = "null"


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where screenshots go (``test-artifacts/browser/``, gitignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium under Playwright, for the whole session."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make setup` (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, api_server):
    """A fresh page (1400×1000) whose console errors fail the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"browser console errors: {errors}"


@pytest.fixture(scope="module")
def poison_worker(farm_env: dict[str, str], run_dir: Path) -> Iterator[WorkerProcess]:
    """A ``null``-model worker behind the fault-injection wrapper: a group with a poison prompt
    raises, the runner bisects, and only the poison job fails (with its real error)."""
    worker = WorkerProcess("null", {**farm_env, "RENDERFARM_TEST_POISON_PROMPT": POISON}, "test-null-poison", 4,
                           run_dir=run_dir)
    with worker:  # started, and registered
        yield worker
