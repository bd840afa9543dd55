"""Fixtures for the pipeline tests: one offline cache per session (its models shared with the
session farm's cache), one warm ``tiny`` renderer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def offline_cache(cache_with_shared_models: Callable[[str], Path]) -> Path:
    """A cache dir for offline model builds, shared by the whole session; its ``models/`` is the
    session farm's, so a model the workers built is not built again here (nor the reverse)."""
    return cache_with_shared_models("renderfarm-cache")


@pytest.fixture(scope="session")
def tiny_pipe(offline_cache: Path):
    from pipeline.models import load_pipeline

    return load_pipeline("tiny", cache_dir=offline_cache)


@pytest.fixture(scope="session")
def tiny_renderer(tiny_pipe):
    from pipeline.render import Renderer

    return Renderer(tiny_pipe, model="tiny")
