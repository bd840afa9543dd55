"""Fixtures for the pipeline tests: one offline cache per session, one warm ``tiny`` renderer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty cache dir for offline model builds, shared by the whole session."""
    return tmp_path_factory.mktemp("renderfarm-cache")


@pytest.fixture(scope="session")
def tiny_pipe(offline_cache: Path):
    from pipeline.models import load_pipeline

    return load_pipeline("tiny", cache_dir=offline_cache)


@pytest.fixture(scope="session")
def tiny_renderer(tiny_pipe):
    from pipeline.render import Renderer

    return Renderer(tiny_pipe, model="tiny")
